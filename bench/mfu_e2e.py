"""bench/mfu.py's end-to-end part: launch/train_wan.py under the deepspeed launcher on the video-heavy synthetic mix,
one launch per variant (E2E), and its summary: e2e_mfu = model FLOPs / (step wall x peak) over the steps after
warm-up, data loading, optimizer and idle included, with each step's peak memory against the device's."""
import json
import os
import statistics
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mode -> (compiled: False, True (blocks whole) or "regions", checkpoint policy): "-attn" keeps the attention
# outputs of checkpointed blocks
MODES = {"eager": (False, "full"), "compile": (True, "full"), "eager-attn": (False, "attention"),
         "compile-attn": (True, "attention"), "regions": ("regions", "full"), "regions-attn": ("regions", "attention")}


def split(text, allowed):
    items = [s for s in text.split(",") if s]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"error: unknown {bad}; choose from {', '.join(allowed)}")
    return items


E2E = {  # variant -> (compiled blocks, train_wan flags, checkpoint policy); baseline: every block checkpointed, eager
    "baseline": (False, ["--checkpoint-blocks"], "full"),
}
# The levers as launch/train_wan.py's own flags, with the profile's memory section from the probed fields:
# variant -> the planner's policy. "packed" folds small image micro-batches into fuller ones.
TRAINER_FLAGS = ["--checkpoint-blocks", "auto", "--checkpoint-policy", "attention", "--compile-blocks"]
# train-regions-*: --compile-blocks regions (the elementwise steps compiled one by one: the same few graphs for any
# packed micro-batch), with the memory fields of mode regions-attn.
TRAINER_E2E = {"train-compile-attn": "balanced", "train-compile-attn-packed": "packed",
               "train-regions-attn": "balanced", "train-regions-attn-packed": "packed",
               "train-regions-attn-equal": "equal-tokens", "train-regions-attn-packed-cap": "packed"}
# Further adaptive_load keys per variant: "-cap" fills micro-batches to packed.pack_cap's choice (pack_tokens auto),
# which with the profile's recompute fractions (--e2e-recompute) leaves blocks open instead of checkpointing them.
TRAINER_KEYS = {"train-regions-attn-packed-cap": {"pack_tokens": "auto"}}
E2E.update({name: ("regions" if "regions" in name else True,
                   [*TRAINER_FLAGS, "regions" if "regions" in name else "block"], "attention") for name in TRAINER_E2E})

# -- the e2e part ---------------------------------------------------------------------------------------------------


def e2e_summary(recs, warmup, peak_tflops):
    """e2e_mfu = model FLOPs / (step wall x peak) summed over the trained steps after warm-up; warm_mfu the same
    over the steps that compiled no new block graph (where the step log counts them: block_graphs)."""
    trained = [r for r in recs if "skipped" not in r]
    body = trained[warmup:] if len(trained) > warmup else []
    keys = ("step", "samples", "tokens", "step_ms", "mfu", "mem_peak_gib")
    # compute_ms / data_ms (per rank): what of the step wall is forward+backward and what waits for data
    optional = ("pred_mem_gib", "block_graphs", "ckpt_k", "compute_ms", "data_ms")
    out = {"steps": len(body), "steps_logged": len(recs), "skipped_steps": len(recs) - len(trained),
           "per_step": [{**{k: r.get(k) for k in keys}, **{k: r[k] for k in optional if k in r}} for r in recs]}
    graphs = [r.get("block_graphs") for r in recs]
    warm = [r for i, r in enumerate(recs) if i and "skipped" not in r and graphs[i] is not None
            and graphs[i] == graphs[i - 1]]
    if warm:
        out.update(warm_steps=len(warm), warm_mfu=_wall_weighted_mfu(warm))
    if body:
        out.update(e2e_mfu=_wall_weighted_mfu(body),
                   step_ms_median=statistics.median(r["step_ms"] for r in body),
                   tokens_per_s=_per_s(body, "tokens"),
                   samples_per_s=_per_s(body, "samples"),
                   mem_peak_gib_max=max(r.get("mem_peak_gib", 0) for r in body),
                   mem_capacity_gib=body[-1].get("mem_capacity_gib"))
    return out


# A step runs at the GPU's steady power state when its mean board power is within this fraction of the run's highest
# step mean: an H200 runs its first 2-3 minutes at ~1,850-1,940 MHz, then ~1,660-1,720 MHz at its 700 W cap.
STEADY_POWER = 0.95


def steady_summary(per_step, gpu) -> dict:
    """steady_mfu: e2e_mfu over the steps after the first one at the steady power state (gpu_per_step's mean power
    >= STEADY_POWER x the highest step's), which is what a long run sees; {} without GPU samples."""
    power = {g["step"]: g["power_w"] for g in gpu}
    level = STEADY_POWER * max(power.values(), default=0.0)
    first = min((s for s, w in power.items() if w >= level and s > 1), default=None)
    if first is None:
        return {}
    steady = [r for r in per_step if r["step"] >= first and r.get("mfu") is not None]
    if not steady:
        return {}
    return {"steady_steps": [steady[0]["step"], steady[-1]["step"]], "steady_mfu": _wall_weighted_mfu(steady),
            "steady_tokens_per_s": _per_s(steady, "tokens")}


def _per_s(recs, key):
    """recs' `key` (tokens, samples) per second of their summed step wall."""
    return sum(r[key] for r in recs) / (sum(r["step_ms"] for r in recs) / 1e3)


def _wall_weighted_mfu(recs):
    """Model FLOPs over wall x peak for these steps together (not a mean of per-step MFUs)."""
    return sum(r["mfu"] * r["step_ms"] for r in recs) / sum(r["step_ms"] for r in recs)


def write_trainer_profile(path, base_ds, memory, recompute=None):
    """The base DeepSpeed JSON's profile with its memory section's checkpoint fields (fixed, per-token,
    per-block, attention bytes; safety) from `memory`, for --checkpoint-blocks auto in the trainer; with `recompute`
    (recompute_frac, attention_recompute_frac) its time_ms fields too, so that the planner costs what the open
    blocks skip."""
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.config import read_json_object, zero_stage

    from ds_adaptiveload.shipped import config_profile

    ds = read_json_object(os.path.join(ROOT, base_ds), "DeepSpeed config")
    prof = CostProfile.load(config_profile(os.path.join(ROOT, base_ds)))
    keys = ("fixed_bytes", "bytes_per_token", "block_bytes_per_token", "attention_bytes_per_token",
            "block_bytes_per_sample", "safety")
    prof.memory.update({k: memory[k] for k in keys if memory.get(k) is not None})
    if memory.get("fixed_bytes") is not None:  # measured here, on one GPU under base_ds's stage: nothing to move
        prof.meta = {**prof.meta, "zero_stage": zero_stage(ds), "train_world_size": 1}  # (schedule/zero.for_run)
    if recompute:
        prof.recompute_frac, prof.attention_recompute_frac = recompute
    prof.to_yaml(path)


def copy_config_profile(path, base_ds):
    """--e2e-profile config: the base DeepSpeed JSON's own profile, unchanged (memory, block fields, recompute), as
    a user's run of that JSON plans with it."""
    import shutil

    from ds_adaptiveload.shipped import config_profile

    shutil.copyfile(config_profile(os.path.join(ROOT, base_ds)), path)


def epoch_plan(profile_path, manifest, policy, grad_accum, stage=2, **plan):
    """Epoch 0 of the plan the trainer makes for this variant on one GPU under ZeRO `stage` (lockstep, as under
    ZeRO-2; the profile's memory moved to that run, as the trainer moves it); plan: further PlanConfig keys."""
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.schedule.zero import for_run

    cfg = PlanConfig(policy=policy, grad_accum=grad_accum, lockstep=True, **plan)
    return make_plan(load_manifest(manifest), for_run(CostProfile.load(profile_path), stage, 1)[0], cfg)


def epoch_steps(profile_path, manifest, policy, grad_accum, stage=2, **plan) -> int:
    """Steps in epoch 0 of epoch_plan."""
    return len(epoch_plan(profile_path, manifest, policy, grad_accum, stage, **plan).steps)


def e2e_variant(args, name, manifest, memory, deadline):
    """One launch of launch/train_wan.py: the baseline as it is, TRAINER_E2E with TRAINER_FLAGS and a profile carrying
    the probed memory fields."""
    from train_e2e import read_steps, write_ds_json
    from train_steps import launch

    from ds_adaptiveload.train.config import zero_stage
    from ds_adaptiveload.train.setup import plan_checkpoint

    compiled, flags, policy = E2E[name]
    mode = {True: "compile", "regions": "regions"}.get(compiled, "eager") + ("-attn" if policy == "attention" else "")
    run = os.path.join(args.work, f"run_{name}")
    os.makedirs(run, exist_ok=True)
    for f in os.listdir(run):  # a warm machine keeps /tmp: the step log appends otherwise
        if f.endswith((".jsonl", ".json")):
            os.remove(os.path.join(run, f))
    with open(os.path.join(ROOT, args.config)) as f:
        grad_accum = json.load(f).get("gradient_accumulation_steps", 1)
    if name in TRAINER_E2E:
        if args.e2e_profile == "config":
            copy_config_profile(f"{run}/profile.yaml", args.config)
        else:
            write_trainer_profile(f"{run}/profile.yaml", args.config, memory[mode], args.e2e_recompute)
        write_ds_json(f"{run}/ds.json", os.path.join(ROOT, args.config), f"{run}/profile.yaml", TRAINER_E2E[name],
                      grad_accum=grad_accum, **TRAINER_KEYS.get(name, {}))
    else:
        write_ds_json(f"{run}/ds.json", os.path.join(ROOT, args.config), grad_accum=grad_accum)
    env = {}
    if compiled is True:
        env["DS_ADAPTIVELOAD_LN_MODULATE"] = args.compile_ln
    if name in TRAINER_E2E and args.compile_cache:
        flags = [*flags, "--compile-cache", os.path.abspath(args.compile_cache)]
    if args.e2e_attention:
        flags = [*flags, "--attention", args.e2e_attention]
    log = os.path.join(args.out, f"e2e_{name}_train.log")
    os.environ.update(env)
    gpu_csv = os.path.join(args.out, f"e2e_{name}_gpu.csv")
    monitor = gpu_monitor(gpu_csv)
    soak = heat_soak(f"{run}/steps.rank0.jsonl", args.e2e_soak_s)
    planned = None
    try:
        steps = args.e2e_steps
        if name in TRAINER_E2E and args.e2e_epochs:
            with open(f"{run}/ds.json") as f:
                stage = zero_stage(json.load(f))
            # as train_wan plans it: TRAINER_FLAGS' --checkpoint-blocks auto with the variant's policy
            plan = {**plan_checkpoint(SimpleNamespace(checkpoint_blocks="auto", checkpoint_policy=policy), stage),
                    **TRAINER_KEYS.get(name, {})}
            ep = epoch_plan(f"{run}/profile.yaml", manifest, TRAINER_E2E[name], grad_accum, stage, **plan)
            steps = args.e2e_epochs * len(ep.steps)
            planned = {"steps_per_epoch": len(ep.steps), "pack_tokens": ep.pack_tokens,
                       "micro_batch_tokens": [sum(ep.tokens[i] for i in mb) for mbs in ep.steps[0] for mb in mbs],
                       "predicted_epoch_s": round(sum(ep.pred_wall_ms) / 1e3, 2),
                       "recompute": args.e2e_recompute if args.e2e_profile == "probed" else "profile"}
        rc = launch(f"{run}/ds.json", manifest, steps, run, log, "--num_gpus 1", flags, args.model_config,
                    timeout=max(deadline - time.monotonic(), 10))
    finally:
        for k in env:
            os.environ.pop(k, None)
        if monitor is not None:
            monitor.terminate()
        soaked = end_soak(soak)
    steps_path = f"{run}/steps.rank0.jsonl"
    recs = read_steps(steps_path) if os.path.exists(steps_path) else []
    out = {"variant": name, "rc": rc, "env": env, "steps_asked": steps, "plan": planned,
           **e2e_summary(recs, args.e2e_warmup, args.peak_tflops),
           "gpu_per_step": gpu_per_step(gpu_csv, recs)}
    out.update(steady_summary(out["per_step"], out["gpu_per_step"]))
    if soaked is not None:
        out["soak"] = soaked
    return out


GPU_FIELDS = "timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,memory.used"
# gpu_per_step's columns of gpu_monitor's CSV; the throttle reasons, where the driver has them, come last
SM_COL, POWER_COL = (GPU_FIELDS.split(",").index(f) for f in ("clocks.sm", "power.draw"))
REASONS_COL = len(GPU_FIELDS.split(","))


class GpuMonitor:
    """nvidia-smi sampled every `interval` s into `path` (CSV, header first), one nvidia-smi process per sample: a
    looping `nvidia-smi -lms ... -f path` writes its file in 4 KB blocks and loses the last one when it is stopped
    (an earlier packed run kept 8,192 bytes, none of its last step)."""

    def __init__(self, path, fields, interval=2.0):
        import threading

        self.path, self.fields, self.interval = path, fields, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self, header: bool):
        """One nvidia-smi query: its CSV text, or None where it failed."""
        import subprocess

        fmt = "csv" if header else "csv,noheader"
        try:
            res = subprocess.run(["nvidia-smi", f"--query-gpu={self.fields}", f"--format={fmt}"], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout if res.returncode == 0 and res.stdout.strip() else None

    def start(self, first: str):
        with open(self.path, "w") as f:
            f.write(first)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            text = self.sample(header=False)
            if text:
                with open(self.path, "a") as f:  # whole lines, each sample at once
                    f.write(text)

    def terminate(self):
        self._stop.set()
        self._thread.join(timeout=15)


def gpu_monitor(path, interval=2.0):
    """A GpuMonitor sampling the GPU's clocks, temperature and power into `path` while a variant trains, so a change
    in step time can be told apart from a throttled GPU; None without a working nvidia-smi."""
    import shutil

    if shutil.which("nvidia-smi") is None:
        return None
    for fields in (GPU_FIELDS + ",clocks_event_reasons.active", GPU_FIELDS):  # older drivers lack the reasons
        mon = GpuMonitor(path, fields, interval)
        first = mon.sample(header=True)
        if first:
            return mon.start(first)
    return None


def heat_soak(steps_path, max_s):
    """--e2e-soak-s: bench/gpu_soak.py loading the GPU while the variant starts, until its step log (steps_path) has
    its first line or max_s pass, so that the variant's step 2 on runs at the GPU's steady power state; None: off."""
    import subprocess
    import sys

    if not max_s or max_s <= 0:
        return None
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "gpu_soak.py"), "--until", steps_path,
                             "--max-s", str(max_s)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def end_soak(proc):
    """The soak's last JSON line (seconds, GEMMs, why it stopped); one still running (the variant ended before its
    first step) is killed and says so. None where no soak ran."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.kill()
    from harness import last_json

    rec = last_json(proc.communicate()[0], "SOAK ") or {}
    return rec if "stopped" in rec else {**rec, "stopped": "killed"}


def gpu_per_step(csv_path, recs) -> list:
    """Per step record with an end_time: mean SM clock (MHz) and power (W) of the nvidia-smi samples inside the step
    ([end_time - step_ms, end_time]) and whether any sample reported a power cap (throttle bit 0x4); [] without.
    nvidia-smi's timestamps are the machine's local time, read as UTC (the GPU machine's zone)."""
    import csv
    import datetime

    if not os.path.exists(csv_path):
        return []
    samples = []
    with open(csv_path) as f:
        for row in csv.reader(f, skipinitialspace=True):
            try:
                t = datetime.datetime.strptime(row[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
                samples.append((t.timestamp(), float(row[SM_COL].split()[0]), float(row[POWER_COL].split()[0]),
                                int(row[REASONS_COL], 16) if len(row) > REASONS_COL else 0))
            except (ValueError, IndexError):  # the header, a unit-less "[N/A]"
                continue
    out = []
    for r in recs:
        if "end_time" not in r:
            continue
        inside = [x for x in samples if r["end_time"] - r["step_ms"] / 1e3 <= x[0] <= r["end_time"]]
        if inside:
            out.append({"step": r["step"], "sm_mhz": round(statistics.mean(x[1] for x in inside)),
                        "power_w": round(statistics.mean(x[2] for x in inside), 1),
                        "power_capped": any(x[3] & 0x4 for x in inside), "samples": len(inside)})
    return out


# Used only where neither this run nor --memory-json measured the fields: from the H200 numbers, ZeRO-2
# on one GPU holds ~23 GB of states (16 bytes/param), 224 kB/token with every block checkpointed (calibrated
# profile), ~3 MB/token eager without (-> 92 kB per open block), compiled 480p 81f 85 GB (-> 56 kB).
ESTIMATED_MEMORY = {"eager": {"fixed_bytes": 23e9, "bytes_per_token": 224e3, "block_bytes_per_token": 92e3},
                    "compile": {"fixed_bytes": 23e9, "bytes_per_token": 224e3, "block_bytes_per_token": 56e3}}
ESTIMATED_MEMORY["regions"] = ESTIMATED_MEMORY["eager"]  # unmeasured: plan as eager (more checkpointing, safe)
# "-attn": a checkpointed block also keeps its two attention outputs (2 x 3 KB per token at dim 1536, bf16)
ESTIMATED_MEMORY.update({f"{m}-attn": {**v, "bytes_per_token": v["bytes_per_token"] + 30 * 6.2e3,
                                       "block_bytes_per_token": v["block_bytes_per_token"] - 6.2e3}
                         for m, v in list(ESTIMATED_MEMORY.items())})


def e2e_memory(args, doc):
    """The memory dicts k is chosen with, per mode: this run's proposed fields, else --memory-json's, else the
    estimate above (doc records which)."""
    src, origin = doc.doc.get("proposed_profile"), "measured in this run"
    if not src and args.memory_json:
        with open(args.memory_json) as f:
            src, origin = json.load(f).get("proposed_profile", {}), args.memory_json
    out = {}
    for mode in MODES:
        measured = (src or {}).get(mode, {}).get("memory")
        out[mode] = {"capacity_bytes": None, "safety": args.safety, **(measured or ESTIMATED_MEMORY[mode])}
        doc.doc.setdefault("e2e_memory_source", {})[mode] = origin if measured else "estimated (ESTIMATED_MEMORY)"
    for mode in ("eager", "compile", "regions"):  # the attention policy plans from the full policy's fields plus the
        full, attn = out[mode], out[f"{mode}-attn"]  # bytes a block keeping its attention adds per token
        if doc.doc["e2e_memory_source"][mode] != doc.doc["e2e_memory_source"][f"{mode}-attn"]:
            # one measured, the other estimated: the -attn plan would mix the two (an earlier call 2 planned
            # k with the eager estimate of block bytes for this reason); measure both modes (--modes X,X-attn)
            doc.doc.setdefault("warnings", []).append(f"e2e memory: {mode} and {mode}-attn from different sources")
            print(f"[mfu] warning: {doc.doc['warnings'][-1]}", flush=True)
        out[f"{mode}-attn"] = {**full, "attention_bytes_per_token": max(
            0.0, (attn["bytes_per_token"] - full["bytes_per_token"]) / bench_layers(args))}
    return out


def bench_layers(args):
    from ds_adaptiveload.model import WanConfig

    return WanConfig.from_yaml(os.path.join(ROOT, args.model_config)).num_layers


def part_e2e(args, doc, deadline):
    from ds_adaptiveload.schedule.mixes import make_mix
    from train_steps import write_data

    manifest = write_data(os.path.join(args.work, f"data_video-heavy_{args.e2e_num}"),
                          make_mix("video-heavy", args.e2e_num, seed=0))
    memory = e2e_memory(args, doc)
    for name in split(args.e2e_variants, E2E):
        if time.monotonic() > deadline - 60:
            doc.doc["skipped"].append({"e2e": name, "why": "time budget"})
            continue
        doc.doc["e2e"].append(e2e_variant(args, name, manifest, memory, deadline))
        ok = [e for e in doc.doc["e2e"] if e.get("e2e_mfu") is not None]
        doc.doc["e2e_mfu"] = max((e["e2e_mfu"] for e in ok), default=None)
        doc.doc["e2e_best"] = max(ok, key=lambda e: e["e2e_mfu"])["variant"] if ok else None
        doc.save()
