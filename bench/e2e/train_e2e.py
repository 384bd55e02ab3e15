"""End-to-end training benchmark: the same synthetic video-heavy data trained under each policy
(equal-tokens, dual, balanced), with the fused LN-modulate op on and off, on 2 GPUs (dp=2) and once with
Ulysses sp=2, each run a `deepspeed --num_gpus 2 launch/train_wan.py` subprocess; then the trainer's step
logs are reduced side by side with the planner's simulation of the same run and of 8/64/1024 ranks.

    python bench/e2e/train_e2e.py --profile configs/profiles/h200-wan1.3b-zero3.yaml --out-dir OUT
    E2E_SMOKE=1 python bench/e2e/train_e2e.py --out-dir /tmp/e2e     # CPU: tiny model, 2 gloo ranks

Settings go to the trainer the documented way: a generated DeepSpeed JSON per run (its `adaptive_load`
section: profile, policy, seed) and the env var DS_ADAPTIVELOAD_LN_MODULATE (cuda = fused op required,
torch = the PyTorch chain). No trainer flag is added.

Metrics (measured steps only, warm-up steps dropped):
  idle        1 - sum_steps mean_rank(compute_ms) / sum_steps max_rank(compute_ms)   (ranks' own timings)
  samples/s   sum samples / sum step wall time; tokens/s likewise; MFU = step-time-weighted mean
  memory      per-rank peak allocated / capacity over steps: mean and p95
  OOM         steps the trainer skipped for out-of-memory (adaptive_load.on_oom skip when the trainer has
              it), plus 1 if the run died of one
  simulator   the plan's pred_ms of the same steps (from the step log): predicted idle and wall, and the
              relative error of the predicted wall against the measured one
Every policy runs the same number of steps over the same manifest; each plan covers a different subset,
so throughput is compared as samples/s and tokens/s, not as time to a fixed set.
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.e2e.e2e_report import render  # noqa: E402
from bench.harness import environment, quantile as percentile  # noqa: E402

SMOKE = os.environ.get("E2E_SMOKE") == "1"
# Variants in priority order: what is cut first when the time budget is short is at the end.
# name: (policy, fused op, sp)
VARIANTS = {
    "balanced": ("balanced", True, 1),
    "packed": ("packed", True, 1),
    "equal-tokens": ("equal-tokens", True, 1),
    "balanced-unfused": ("balanced", False, 1),
    "balanced-sp2": ("balanced", True, 2),
    "equal-tokens-unfused": ("equal-tokens", False, 1),
    "dual": ("dual", True, 1),
    "dual-unfused": ("dual", False, 1),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", default="configs/wan_tiny.yaml" if SMOKE else "configs/wan_1_3b.yaml")
    p.add_argument("--ds-base", default="configs/ds_tiny_cpu.json" if SMOKE else "configs/ds_zero3_bf16.json",
                   help="DeepSpeed JSON the runs start from (ZeRO-3, bf16, optimizer); batch/SP/adaptive_load "
                        "keys are set per run")
    p.add_argument("--profile", default="configs/profiles/tiny-cpu.yaml" if SMOKE else
                   "configs/profiles/h200-wan1.3b-zero3.yaml", help="cost profile (calibrated)")
    p.add_argument("--budget-tokens", type=int, default=0 if SMOKE else 75600,
                   help="override the profile's memory.budget_tokens for these runs (0: keep). Default 75600: "
                        "one 720p 81-frame clip per micro-batch, so steps stay short enough for the time budget")
    p.add_argument("--data", help="training manifest; default: synthesize --num samples of --mix into WORK")
    p.add_argument("--num", type=int, default=48 if SMOKE else 320, help="synthetic samples")
    p.add_argument("--mix", default="tiny" if SMOKE else "video-heavy")
    p.add_argument("--grad-accum", type=int, default=1, help="G: micro-batches per rank per step")
    # gloo (CPU) has no all-to-all, so the smoke run leaves out Ulysses.
    p.add_argument("--variants", default="balanced,equal-tokens,balanced-unfused" if SMOKE else ",".join(VARIANTS),
                   help=f"comma list in priority order, from {', '.join(VARIANTS)}")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1 if SMOKE else 2, help="steps dropped from every run")
    p.add_argument("--max-measured", type=int, default=2 if SMOKE else 12, help="measured steps per run (at most)")
    p.add_argument("--min-measured", type=int, default=2 if SMOKE else 4,
                   help="fewer than this per run: drop variants from the end of the list instead")
    p.add_argument("--time-budget", type=float, default=600 if SMOKE else 330,
                   help="seconds for all training runs together")
    p.add_argument("--launch-overhead", type=float, default=30 if SMOKE else 40,
                   help="seconds a launch costs besides its steps (imports, model init, deepspeed.initialize)")
    p.add_argument("--slowdown", type=float, default=1.0 if SMOKE else 1.25,
                   help="planned step time = profile prediction x this (2-GPU ZeRO-3 traffic not in a 1-GPU "
                        "calibration)")
    p.add_argument("--epoch", action="store_true",
                   help="each variant trains --warmup steps plus one whole epoch of its plan: throughput is then "
                        "compared over the same samples (the measured steps are the epoch after its first "
                        "--warmup steps plus that many from the next epoch); the step budget is not used")
    p.add_argument("--sim-ranks", default="8,64,1024", help="world sizes for the planner-only simulation")
    p.add_argument("--sim-samples-per-rank", type=int, default=400,
                   help="epochs of ~30 steps at G = 4; 64 per rank gave ratios 1.49-1.76x over 3 seeds at 8 ranks")
    p.add_argument("--work", default=None, help="run folders (logs, generated configs); default OUT/runs")
    p.add_argument("--out-dir", required=True, help="results JSON, plots, table, logs tarball")
    p.add_argument("--tag", default=None, help="file name tag (default train_e2e-DATE-h200x2 / -cpu)")
    p.add_argument("--render", help="only re-render plots and the table from an existing results JSON")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge the runs of results JSONs of one data set (e.g. from several runs on the GPU machine) into "
                        "OUT-DIR/TAG.json, re-reducing each run from its step logs under --logs, and render")
    p.add_argument("--logs", nargs="+", default=[], metavar="DIR",
                   help="--merge: folders holding VARIANT/steps.rank*.jsonl (the runs' work folders)")
    p.add_argument("--port", type=int, default=29540)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# Pure reductions of step logs (tested through the smoke run)


def read_steps(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pred_step_ms(rec):
    """The plan's predicted wall of a logged step: lockstep-aware (pred_wall_ms) in logs that have it, the
    slowest rank's prediction in older ones."""
    return rec.get("pred_wall_ms", max(rec["pred_ms"]))


def reduce_run(rank_logs, warmup, dp_size):
    """rank_logs: per rank, the list of step records. Returns the run's measured metrics."""
    recs = rank_logs[0][warmup:]
    if not recs:
        return {"measured_steps": 0}
    compute = [r["compute_ms"] for r in recs]
    step_s = [r["step_ms"] / 1000 for r in recs]
    wall = sum(step_s)
    sum_max = sum(max(c) for c in compute)
    sum_mean = sum(sum(c) / len(c) for c in compute)
    # The plan's prediction for exactly these steps; pred_ms has one entry per dp rank.
    # Under ZeRO-3 the step's predicted wall is lockstep (sum over rounds of the slowest micro-batch).
    pred = [r["pred_ms"] for r in recs]
    pred_step = [pred_step_ms(r) for r in recs]
    pred_wall = sum(pred_step) / 1000
    pred_idle = 1 - sum(sum(p) / len(p) for p in pred) / sum(pred_step) if dp_size > 1 else 0.0
    mem = [r["mem_peak_gib"] / r["mem_capacity_gib"] for log in rank_logs for r in log[warmup:]
           if r.get("mem_capacity_gib")]
    samples = sum(r["samples"] for r in recs)
    tokens = sum(r["tokens"] for r in recs)
    # Epoch 0 whole, warm-up steps included: with --epoch every policy trains exactly these samples, so the
    # ratio of these walls is the time-to-same-work comparison (the warm-up cost is in both).
    ep0 = [r for r in rank_logs[0] if r.get("epoch", 0) == 0]
    out = {
        "epoch0_steps": len(ep0), "epoch0_wall_s": sum(r["step_ms"] for r in ep0) / 1000,
        "epoch0_samples": sum(r["samples"] for r in ep0), "epoch0_tokens": sum(r["tokens"] for r in ep0),
        "epoch0_pred_wall_s": sum(pred_step_ms(r) for r in ep0) / 1000,
        "measured_steps": len(recs),
        "samples": samples, "tokens": tokens, "wall_s": wall,
        "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
        "mfu": sum(r["mfu"] * s for r, s in zip(recs, step_s)) / wall,
        "idle_fraction": 1 - sum_mean / sum_max if sum_max else 0.0,
        "step_idle": [r["idle_fraction"] for r in recs],
        "compute_ms": compute,
        "step_ms": [r["step_ms"] for r in recs],
        "pred_ms": pred,
        "pred_step_ms": pred_step,
        "pred_step_idle": [r["pred_idle_fraction"] for r in recs],  # the trainer's, lockstep-aware
        "pred_idle_fraction": pred_idle,
        "pred_wall_s": pred_wall,
        "pred_wall_err": pred_wall / wall - 1,
        "compute_wall_s": sum_max / 1000,
        "pred_compute_err": pred_wall / (sum_max / 1000) - 1 if sum_max else None,
        "loss_last": recs[-1]["loss"],
        "skipped_steps": sum(bool(r.get("skipped")) for r in recs),
    }
    if mem:
        out.update(mem_frac_mean=statistics.fmean(mem), mem_frac_p95=percentile(mem, 0.95),
                   mem_peak_gib_max=max(r["mem_peak_gib"] for log in rank_logs for r in log[warmup:]))
    return out


# ----------------------------------------------------------------------------------------------------
# Planning the benchmark: steps per run from the time budget


def stage_of(ds_json) -> int:
    """The DeepSpeed config's ZeRO stage, read as the trainer reads it."""
    from ds_adaptiveload.train.config import zero_stage

    with open(ds_json) as f:
        return zero_stage(json.load(f))


def lockstep_of(ds_json):
    """What the trainer derives from the DeepSpeed config: ZeRO-2/3 synchronise at every micro-batch."""
    return stage_of(ds_json) >= 2


def plan_step_s(manifest, profile, policy, sp, world, grad_accum, lockstep, seed=0):
    """Predicted wall seconds of every step of the run's epoch-0 plan (what the trainer runs), and the
    plan summary (what `python -m ds_adaptiveload plan` prints)."""
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan

    samples = load_manifest(manifest, profile.geometry)
    plan = make_plan(samples, profile, PlanConfig(policy=policy, world_size=world, sp=sp, grad_accum=grad_accum,
                                                  seed=seed, on_oversize="skip", lockstep=lockstep))
    return [w / 1000 for w in plan.pred_wall_ms], plan.summary(), hash(repr(plan.steps))


def first_steps_s(per_step, steps):
    """Seconds of the first `steps` steps; past one epoch the next epoch's steps cost about the same."""
    return sum(per_step[i % len(per_step)] for i in range(steps))


def choose_steps(costs, budget, overhead, warmup, max_measured, min_measured):
    """costs: per variant (priority order), a function m -> predicted seconds of warmup+m steps. Keeps the
    longest prefix of variants that fits the budget at min_measured steps each, then gives them the most
    steps (<= max_measured) that still fit. Returns (measured steps, variants kept)."""
    names = list(costs)

    def total(ns, m):
        return sum(overhead + costs[n](warmup + m) for n in ns)

    while len(names) > 1 and total(names, min_measured) > budget:
        names = names[:-1]
    m = min_measured
    while m < max_measured and total(names, m + 1) <= budget:
        m += 1
    return m, names


# ----------------------------------------------------------------------------------------------------
# Running


def profile_for(sp, run_profile, model_config):
    """The profile a variant plans with: for an SP variant, a one-GPU profile converted to per-GPU terms at
    sp = k (calibrate.sp_terms, what calibrate writes for a k-way config measured on one GPU; unconverted,
    the 1.3B sp = 2 run was predicted 33% low)."""
    from ds_adaptiveload.calibrate import sp_profile
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile

    prof = CostProfile.load(run_profile)
    if sp == prof.meta.get("sp", 1) or prof.meta.get("sp", 1) != 1:
        return run_profile
    path = os.path.join(os.path.dirname(run_profile), f"profile-sp{sp}.yaml")
    sp_profile(prof, WanConfig.from_yaml(model_config), sp, source=run_profile).to_yaml(path)
    return path


def write_ds_json(path, base, profile_path=None, policy=None, sp=1, grad_accum=1, seed=0, **adaptive):
    """The benchmarks' DeepSpeed JSON, through ds_adaptiveload.train.config.derive_ds_config: micro-batch 1,
    G, SP (with reduce_scatter, which SP needs: train/sp.py), monitors off; with a profile, an adaptive_load
    section of its own (policy, seed, oversize and OOM steps skipped), without one the base's; adaptive:
    further adaptive_load keys (on_oom, profile, policy, ...)."""
    from ds_adaptiveload.train.config import MONITORS, derive_ds_config, read_json_object

    src = read_json_object(base, "DeepSpeed config")
    top = {k: {**src[k], "enabled": False} for k in MONITORS if k in src}
    if sp > 1:
        top["zero_optimization"] = {**src.get("zero_optimization", {}), "reduce_scatter": True}
    ds = derive_ds_config(src, grad_accum=grad_accum, sp=sp, train_micro_batch_size_per_gpu=1, train_batch_size=None,
                          **top)
    if profile_path is not None:
        # Its own section: an oversize sample or an OOM step is skipped and logged instead of ending the run (the
        # trainer skips OOM steps under ZeRO-3 only: train/setup.py).
        z3 = ds.get("zero_optimization", {}).get("stage", 0) == 3
        ds["adaptive_load"] = {"profile": os.path.abspath(profile_path), "policy": policy, "seed": seed,
                               "on_oversize": "skip", "on_oom": "skip" if z3 else "error"}
    elif policy is not None:
        adaptive["policy"] = policy
        if policy != "packed":
            adaptive.setdefault("pack_tokens", None)  # a base's packed cap (ds_tiny_cpu.json) is the packed policy's
    ds["adaptive_load"] = {**ds.get("adaptive_load", {}), **adaptive}
    with open(path, "w") as f:
        json.dump(ds, f, indent=1)


def run_variant(name, args, manifest, profile_path, steps, timeout, port):
    policy, fused, sp = VARIANTS[name]
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cfg = os.path.join(work, "ds.json")
    write_ds_json(cfg, args.ds_base, profile_path, policy, sp, args.grad_accum, 0)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # auto, not cuda: a shape the op refuses falls back with a warning instead of killing the run; the
    # warning is looked for in the log below and reported (fused_fallback), so nothing is silent.
    env["DS_ADAPTIVELOAD_LN_MODULATE"] = "auto" if fused else "torch"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.num_gpus),
           "--master_port", str(port), "launch/train_wan.py", "--deepspeed_config", cfg,
           "--model-config", args.model_config, "--data", manifest, "--output", work,
           "--max-steps", str(steps), "--num-workers", "1" if SMOKE else "2"]
    if not SMOKE:
        cmd.append("--checkpoint-blocks")
    with open(os.path.join(ROOT, "launch", "train_wan.py")) as f:
        if "--no-final-save" in f.read():  # a 1.3B ZeRO-3 checkpoint is ~20 GB: time and disk
            cmd.append("--no-final-save")
    t0 = time.monotonic()
    log_path = os.path.join(work, "train.log")
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # Own process group: on timeout the launcher *and* its rank processes are killed, so no rank
        # keeps a GPU busy into the next run.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    elapsed = time.monotonic() - t0
    shutil.rmtree(os.path.join(work, "checkpoints"), ignore_errors=True)
    with open(log_path, errors="replace") as f:
        text = f.read()
    died_oom = rc != 0 and "out of memory" in text.lower()
    logs = []
    for r in range(args.num_gpus):
        path = os.path.join(work, f"steps.rank{r}.jsonl")
        logs.append(read_steps(path) if os.path.exists(path) else [])
    res = {"name": name, "policy": policy, "fused": fused, "sp": sp, "dp": args.num_gpus // sp, "rc": rc,
           "elapsed_s": elapsed, "steps_run": len(logs[0]), "died_of_oom": died_oom,
           "fused_fallback": fused and "ln_modulate: using the PyTorch implementation" in text}
    if rc != 0:
        res["error_tail"] = "\n".join(text.strip().splitlines()[-15:])
    if logs[0] and len(logs[0]) > args.warmup:
        res.update(reduce_run(logs, args.warmup, args.num_gpus // sp))
    # OOM steps the trainer skipped (adaptive_load.on_oom skip), warm-up included, plus a run that died of one
    res["oom_count"] = sum((r.get("skipped") or {}).get("reason") == "oom" for r in logs[0]) + int(died_oom)
    return res


def simulate(profile, ranks_list, samples_per_rank, grad_accum, mix, lockstep):
    """The planner alone at larger scale: predicted idle and wall per policy (what `plan` prints)."""
    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan

    rows = []
    for ranks in ranks_list:
        samples = make_mix(mix, ranks * samples_per_rank, seed=0)
        for policy in ("equal-tokens", "dual", "balanced"):
            t0 = time.perf_counter()
            s = make_plan(samples, profile, PlanConfig(policy=policy, world_size=ranks, grad_accum=grad_accum,
                                                       on_oversize="skip", lockstep=lockstep)).summary()
            rows.append({"ranks": ranks, "policy": policy, "samples": len(samples), "steps": s["steps"],
                         "pred_idle_fraction": s["idle_fraction"], "pred_wall_s": s["predicted_wall_s"],
                         "samples_per_s_pred": s["samples_planned"] / s["predicted_wall_s"],
                         "mix_tv": s["mix_tv"], "plan_s": time.perf_counter() - t0})
    return rows


def merge(args):
    """One results file from several runs' JSONs: metadata of the first, every run re-reduced from its raw
    step logs with this file's reduce_run (so all runs carry the same metrics), simulation of the last."""
    docs = []
    for path in args.merge:
        with open(path) as f:
            docs.append(json.load(f))
    res = {**docs[0], "merged_from": [os.path.basename(p) for p in args.merge], "runs": []}
    res["variants_dropped"] = []
    for doc in docs:
        for run in doc["runs"]:
            if any(r["name"] == run["name"] for r in res["runs"]):
                continue
            folder = next((os.path.join(d, run["name"]) for d in args.logs
                           if os.path.exists(os.path.join(d, run["name"], "steps.rank0.jsonl"))), None)
            if folder is None:
                raise SystemExit(f"error: no step logs for run {run['name']!r} under {args.logs}")
            logs = [read_steps(os.path.join(folder, f"steps.rank{k}.jsonl")) for k in range(doc["num_gpus"])]
            run = {**run, **reduce_run(logs, doc["warmup_steps"], run["dp"])}
            res["runs"].append(run)
    # The simulation is planning only (CPU): redone here with this file's settings and the runs' profile.
    from ds_adaptiveload.schedule.profile import CostProfile
    res["simulation"] = simulate(CostProfile.from_dict(res["profile_used"]),
                                 [int(v) for v in args.sim_ranks.split(",") if v], args.sim_samples_per_rank,
                                 res["grad_accum"], res["mix"], res.get("lockstep", False)) if args.sim_ranks else []
    res["simulation_samples_per_rank"] = args.sim_samples_per_rank
    tag = args.tag or os.path.splitext(os.path.basename(args.merge[0]))[0]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    render(res, args.out_dir, tag)
    return 0


def write_run_profile(args):
    """The runs' profile: the calibrated one, with the planning budget override recorded in meta. Returns (its
    path under args.work, the loaded profile, the calibrated budget)."""
    from ds_adaptiveload.schedule.profile import CostProfile

    prof_doc = CostProfile.load(args.profile)
    run_profile = os.path.join(args.work, "profile.yaml")
    calibrated_budget = prof_doc.budget_tokens
    if args.budget_tokens:
        prof_doc.budget_tokens = args.budget_tokens
        prof_doc.meta = {**prof_doc.meta, "budget_tokens_calibrated": calibrated_budget,
                         "budget_override": "bench/e2e/train_e2e.py --budget-tokens (a planning choice)"}
    prof_doc.to_yaml(run_profile)
    return run_profile, CostProfile.load(run_profile), calibrated_budget


def ensure_data(args) -> str:
    """--data, else a synthetic manifest under args.work (written once: a warm machine reuses it)."""
    if args.data:
        return args.data
    manifest = os.path.join(args.work, "synthetic", "manifest.jsonl")
    if not os.path.exists(manifest):
        from ds_adaptiveload.model import WanConfig

        mc = WanConfig.from_yaml(args.model_config)
        subprocess.run([sys.executable, "-m", "ds_adaptiveload", "synthesize", "--out", os.path.dirname(manifest),
                        "--num", str(args.num), "--mix", args.mix, "--text-dim", str(mc.text_dim),
                        "--text-len", str(mc.text_len), "--dtype", "fp32" if SMOKE else "bf16"],
                       cwd=ROOT, check=True)
    return manifest


def plan_variants(args, names, manifest, run_profile, lockstep):
    """Each variant's epoch plan and step-time model: (plans, costs, same_plan, profile_paths). A variant whose
    plan equals an earlier one's with the same kernel and SP is not run again (same_plan names the twin)."""
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.schedule.zero import for_run

    plans, costs, same_plan, profile_paths = {}, {}, {}, {}
    stage = stage_of(args.ds_base)
    for n in names:
        policy, fused, sp = VARIANTS[n]
        profile_paths[n] = profile_for(sp, run_profile, args.model_config)
        # the profile as the trainer plans with it: its memory moved to this run's ZeRO stage and GPUs
        prof = for_run(CostProfile.load(profile_paths[n]), stage, args.num_gpus)[0]
        per_step, plans[n], steps_key = plan_step_s(manifest, prof, policy, sp, args.num_gpus, args.grad_accum,
                                                    lockstep)
        # dual equals equal-tokens when the compute cap never binds harder than memory (profile.derive_dual:
        # the longest sample fills M_mem): the same micro-batches, so running it again measures nothing new.
        twin = next((m for m in costs if VARIANTS[m][1:] == (fused, sp) and plans[m]["_key"] == steps_key), None)
        plans[n]["_key"] = steps_key
        if twin:
            same_plan[n] = twin
            continue
        costs[n] = lambda steps, per_step=per_step: first_steps_s(per_step, steps) * args.slowdown
        plans[n]["_epoch_steps"] = len(per_step)
    for n, twin in same_plan.items():
        print(f"[e2e] {n}: plan identical to {twin}'s (the compute cap does not bind at this budget): not run")
    return plans, costs, same_plan, profile_paths


def steps_per_run(args, plans, costs):
    """(measured, kept, steps_of): --epoch runs each variant's whole epoch; else choose_steps picks one measured
    count that fits the time budget, dropping variants that do not. steps_of adds the warm-up steps."""
    if args.epoch:
        kept = list(costs)
        return "epoch", kept, {n: args.warmup + plans[n]["_epoch_steps"] for n in kept}
    measured, kept = choose_steps(costs, args.time_budget, args.launch_overhead, args.warmup,
                                  args.max_measured, args.min_measured)
    return measured, kept, {n: args.warmup + measured for n in kept}


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.render:
        with open(args.render) as f:
            res = json.load(f)
        render(res, args.out_dir, os.path.splitext(os.path.basename(args.render))[0])
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    args.work = args.work or os.path.join(args.out_dir, "runs")
    os.makedirs(args.work, exist_ok=True)
    t_start = time.monotonic()
    run_profile, profile, calibrated_budget = write_run_profile(args)
    manifest = ensure_data(args)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"error: unknown variant(s) {bad}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    lockstep = lockstep_of(args.ds_base)
    plans, costs, same_plan, profile_paths = plan_variants(args, names, manifest, run_profile, lockstep)
    measured, kept, steps_of = steps_per_run(args, plans, costs)
    dropped = [n for n in costs if n not in kept]
    print(f"[e2e] steps per run {steps_of} ({args.warmup} warm-up); variants {kept}"
          + (f"; dropped for time: {dropped}" if dropped else ""), flush=True)

    info = environment(gpu=True)  # the runs themselves are subprocesses
    date = datetime.date.today().isoformat()
    tag = args.tag or f"train_e2e-{date}-{'cpu-smoke' if SMOKE else 'h200x2'}"
    path = os.path.join(args.out_dir, f"{tag}.json")
    runs = []
    res = {"what": __doc__.split("\n")[0], "date": date, **info, "smoke": SMOKE,
           "model_config": args.model_config, "ds_base": args.ds_base, "profile": args.profile,
           "profile_used": profile.to_dict(), "budget_tokens": profile.budget_tokens,
           "budget_tokens_calibrated": calibrated_budget,
           "manifest": manifest, "num_samples": args.num, "mix": args.mix, "grad_accum": args.grad_accum,
           "num_gpus": args.num_gpus, "lockstep": lockstep, "warmup_steps": args.warmup, "measured_steps": measured,
           "settings": {"time_budget_s": args.time_budget, "launch_overhead_s": args.launch_overhead,
                        "slowdown": args.slowdown, "min_measured": args.min_measured,
                        "max_measured": args.max_measured},
           "variants_dropped": dropped, "variants_same_plan": same_plan, "runs": runs, "simulation": [],
           "partial": True}

    def save():
        res["elapsed_s"] = time.monotonic() - t_start
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    save()  # rewritten after every run: a stage killed from outside still leaves its finished runs
    deadline = t_start + args.time_budget * 1.1
    for i, n in enumerate(kept):
        steps = steps_of[n]
        left = deadline - time.monotonic()
        if left < args.launch_overhead:
            dropped.append(n)
            print(f"[e2e] {n}: skipped, {left:.0f} s left", flush=True)
            continue
        timeout = min(left, 3 * (args.launch_overhead + costs[n](steps)) + 60)
        print(f"[e2e] {n}: launching ({steps} steps, timeout {timeout:.0f} s)", flush=True)
        r = run_variant(n, args, manifest, profile_paths[n], steps, timeout, args.port + i)
        r["plan_epoch"] = {k: v for k, v in plans[n].items() if not k.startswith("_")}
        runs.append(r)
        save()
        print(f"[e2e] {n}: rc={r['rc']} in {r['elapsed_s']:.0f} s; " + (
            f"{r['samples_per_s']:.2f} samples/s, idle {r['idle_fraction']:.1%} (pred {r['pred_idle_fraction']:.1%}), "
            f"wall err {r['pred_wall_err']:+.1%}" if "samples_per_s" in r else "no measured steps"), flush=True)

    res["simulation"] = simulate(profile, [int(v) for v in args.sim_ranks.split(",") if v],
                                 args.sim_samples_per_rank, args.grad_accum, args.mix, lockstep) if args.sim_ranks else []
    res["partial"] = False
    save()
    print(f"[e2e] wrote {path}")
    render(res, args.out_dir, tag)
    return 0 if runs and all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
