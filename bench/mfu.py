"""Model FLOPs utilisation of the 1.3B Wan DiT on one H200 (issue #21): per micro-batch shape and end to end.

    python bench/mfu.py --out OUT                                  # shapes, then e2e, within --time-budget
    python bench/mfu.py --parts shapes --modes eager,compile --out OUT
    python bench/mfu.py --parts e2e --e2e-variants baseline,train-regions-attn-packed --memory-json OUT/mfu-...json --out OUT
    python bench/device/run.py --stages mfu=480 --args mfu="--parts shapes"          # on the GPU machine

shapes: the model in a DeepSpeed engine of --config (default ZeRO-2, bf16, G = 1 so a step is one micro-batch),
fwd+bwd ms (median after warm-up) of 32 images 480x832, 480p 81f and 720p 81f, each eager and with compiled
blocks (--modes), with every block checkpointed, none (when the measured memory model says it fits) and the
k of schedule/memory.py; MFU = flops_per_sample(S) * B / (ms * peak). Before them, B = 1 probes at two token
counts with all / no blocks checkpointed give the per-token activation bytes, written as the proposed profile
fields memory.block_bytes_per_token and time_ms.recompute_frac (= 1 - ms(none) / ms(all) of 480p 81f).
e2e: launch/train_wan.py under the deepspeed launcher on the video-heavy synthetic mix (the levers are the trainer's
--checkpoint-blocks, --checkpoint-policy and --compile-blocks); e2e_mfu = model FLOPs / (step wall x peak) over the steps after warm-up,
data loading, optimizer and idle included, with each step's peak memory against the device's; steady_mfu the same
from the first step at the GPU's steady power state (bench/mfu_e2e.steady_summary: at an H200's 700 W cap).
Writes OUT/mfu-<date>-h200.json (+ .md), saved after every measurement so a cut run keeps what it measured.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "e2e"))

import harness  # noqa: E402
from ds_adaptiveload.model.config import ATTENTION_BACKENDS  # noqa: E402

GIB = 2**30
# name -> (B, latent frames, latent height, latent width): 480x832 is 60x104, 720x1280 is 90x160 (stride 8)
SHAPES = {"img32": (32, 1, 60, 104), "480p81": (1, 21, 60, 104), "720p81": (1, 21, 90, 160)}
E2E_RESERVE_S = 200  # of --time-budget kept for e2e when both parts run
# 9,360 and 21,840 tokens: the activation-bytes slope. Earlier 4,680 and 9,360: the model then
# predicted 5-11% under the peaks of 32,760-75,600-token micro-batches with open blocks (docs/history/benchmarks.md),
# as if the smaller probe's peak sat on a floor (the optimizer step's, say) and the slope came out low; larger probes
# avoid it.
PROBES = ((1, 6, 60, 104), (1, 14, 60, 104))
SAMPLE_PROBE = (6, 1, 60, 104)  # 6 images, 9,360 tokens: the per-sample bytes beside that line

from mfu_e2e import (E2E, ESTIMATED_MEMORY, MODES, TRAINER_E2E, TRAINER_KEYS, e2e_memory, e2e_summary,  # noqa: E402,F401
                     e2e_variant, epoch_steps, part_e2e, split, write_trainer_profile)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--parts", default="shapes,e2e", help="comma list of shapes, e2e, z3 (14B shape, ZeRO-3)")
    p.add_argument("--config", default="configs/ds_zero2_bf16.json")
    p.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--modes", default="eager,compile",
                   help="eager, compile (blocks compiled whole, dynamic tokens), regions (their elementwise steps "
                        "compiled one by one), eager-attn, compile-attn, regions-attn (checkpointed blocks keep their "
                        "attention outputs: WanModel checkpoint_policy 'attention')")
    p.add_argument("--ckpt", default="all,k,none", help="all, k (schedule/memory.py), none: blocks checkpointed")
    p.add_argument("--reps", type=int, default=3, help="timed micro-batches per variant (after one warm-up)")
    p.add_argument("--safety", type=float, default=0.9, help="share of device memory k may plan for")
    p.add_argument("--compile-ln", default="torch", choices=["torch", "auto"],
                   help="DS_ADAPTIVELOAD_LN_MODULATE for compiled blocks (auto once the op is a custom op)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for the blocks")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (tests: aot_eager)")
    p.add_argument("--e2e-variants", default="baseline,train-regions-attn-packed", help=f"comma list of {', '.join(E2E)}")
    p.add_argument("--compile-cache", help="train-* e2e variants: train_wan --compile-cache FILE (compiled artifacts "
                                           "loaded if present, saved as they grow; carry it to the next call)")
    p.add_argument("--e2e-num", type=int, default=48, help="video-heavy synthetic samples")
    p.add_argument("--e2e-steps", type=int, default=10)
    p.add_argument("--e2e-epochs", type=int, default=0,
                   help="train-* variants: train this many whole epochs of each variant's own plan instead of "
                        "--e2e-steps, so that the variants train the same samples")
    p.add_argument("--e2e-warmup", type=int, default=3, help="steps left out of e2e_mfu (start-up, compiles)")
    p.add_argument("--e2e-attention", choices=ATTENTION_BACKENDS, default=None,
                   help="the trainer's --attention (default: the trainer's own, auto)")
    p.add_argument("--e2e-soak-s", type=float, default=0.0,
                   help="load the GPU (bench/gpu_soak.py) while each e2e variant starts, until its first step is "
                        "logged or this many seconds pass, so that its warm steps run at the steady power state; "
                        "0: off")
    p.add_argument("--memory-json", help="proposed profile fields from an earlier run (for e2e without shapes)")
    p.add_argument("--e2e-profile", choices=["probed", "config"], default="probed",
                   help="train-* variants: the trainer's profile is --config's own with the memory fields probed here "
                        "(or --memory-json's) and --e2e-recompute (probed), or --config's profile unchanged, as a "
                        "user's run of that JSON plans (config)")
    p.add_argument("--e2e-recompute", type=recompute_pair, default=None, metavar="FULL,ATTN",
                   help="train-* variants: time_ms.recompute_frac and attention_recompute_frac in the trainer's profile "
                        "(the H200's compiled 720p 81f clip: 0.22,0.16, docs/calibration.md), so that the planner "
                        "costs what open blocks skip; needed by train-regions-attn-packed-cap's pack_tokens auto")
    p.add_argument("--z3-config", default="configs/ds_zero3_bf16.json", help="z3 part: its ZeRO-3 JSON")
    p.add_argument("--z3-layers", type=int, default=4, help="z3 part: blocks of the 14B-shaped model")
    p.add_argument("--z3-model-config", default="configs/wan_14b.yaml")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--time-budget", type=float, default=470.0, help="seconds; what would not fit is skipped")
    p.add_argument("--work", default="/tmp/bench_mfu")
    return p.parse_args(argv)


class Doc:
    """The result document, written after every change."""

    def __init__(self, args):
        self.path = os.path.join(args.out, f"mfu-{datetime.date.today().isoformat()}-h200.json")
        self.doc = {"config": args.config, "model_config": args.model_config, "peak_tflops": args.peak_tflops,
                    "rows": [], "per_shape": [], "e2e": [], "skipped": []}

    def save(self):
        env = harness.environment(gpu=True)  # the e2e part alone imports no torch here
        self.doc.update(env=env, device=env.get("device"), torch=env.get("torch"), deepspeed=env.get("deepspeed"))
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.doc, f, indent=1)
        with open(self.path[:-5] + ".md", "w") as f:
            f.write(tables(self.doc))


def tables(doc) -> str:
    cols = ["shape", "B", "tokens", "mode", "ckpt", "k", "ms", "mfu", "peak_gib", "pred_peak_gib", "status"]
    fmt = {"ms": ".0f", "mfu": ".3f", "peak_gib": ".1f", "pred_peak_gib": ".1f"}
    out = "## Per micro-batch\n\n" + harness.markdown_table(doc["rows"], cols, fmt=fmt)
    ecols = ["variant", "e2e_mfu", "steady_mfu", "steps", "step_ms_median", "tokens_per_s", "mem_peak_gib_max",
             "mem_capacity_gib", "block_graphs", "rc"]
    efmt = {"e2e_mfu": ".3f", "steady_mfu": ".3f", "step_ms_median": ".0f", "tokens_per_s": ".0f",
            "mem_peak_gib_max": ".1f", "mem_capacity_gib": ".1f"}
    return out + "\n## End to end\n\n" + harness.markdown_table(doc["e2e"], ecols, fmt=efmt)


# -- shapes ------------------------------------------------------------------------------------------------


def micro_step(engine, cfg, shape, seed, device, dtype):
    """One micro-batch on random inputs: flow-matching loss and backward (timed, peak memory), then the
    optimizer step (timed apart). Returns (fwd+bwd ms, step ms, peak bytes; 0 on the CPU, loss, the global
    gradient norm DeepSpeed saw: a non-finite one means the step was skipped as an overflow)."""
    import torch

    from ds_adaptiveload.train import flow

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    B, *lat = shape
    g = torch.Generator(device=device).manual_seed(seed)
    x0 = torch.randn(B, cfg.in_dim, *lat, generator=g, device=device).to(dtype)
    text = torch.randn(B, cfg.text_len, cfg.text_dim, generator=g, device=device).to(dtype)
    eps = torch.randn(x0.shape, generator=g, device=device)
    t = torch.rand(B, generator=g, device=device)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = flow.flow_matching_loss(engine, x0, text, eps, t).mean()
    engine.backward(loss)
    sync()
    t1 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    engine.step()
    sync()
    norm = engine.get_global_grad_norm()
    norm = float(norm) if norm is not None else None
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, peak, float(loss), norm


class Levers:
    """Checkpointed blocks, their policy and compiled blocks switched between measurements through the model's own
    per-micro-batch settings (WanModel.set_checkpointing) and model/compile.py."""

    def __init__(self, model, compile_mode, backend):
        from ds_adaptiveload.model.wan import WanModel

        self.model = next(m for m in model.modules() if isinstance(m, WanModel))
        self.mode, self.backend, self.compiled = compile_mode, backend, False
        self.num_layers = len(self.model.blocks)

    def set(self, k: int, compiled, policy: str) -> None:
        """k first blocks checkpointed with `policy`; compiled: True (blocks whole), "regions" or False (eager)."""
        from ds_adaptiveload.model.compile import compile_blocks, compile_regions, uncompile_blocks

        self.model.set_checkpointing(k, 0, policy=policy)
        if compiled != self.compiled:
            uncompile_blocks(self.model)  # compiled code stays cached for the next switch back
            if compiled:
                (compile_blocks if compiled is True else compile_regions)(self.model, mode=self.mode,
                                                                          backend=self.backend)
            self.compiled = compiled


class Bench:
    """The engine, its levers and one micro-batch step: flow-matching loss, backward (timed), step (apart)."""

    def __init__(self, args):
        import torch

        from ds_adaptiveload.calibrate.engine import init_engine
        from ds_adaptiveload.model import WanConfig
        self.torch, self.args = torch, args
        self.cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
        with open(os.path.join(ROOT, args.config)) as f:
            ds = json.load(f)
        t0 = time.perf_counter()
        self.engine, _, _, self.device, self.dtype = init_engine(self.cfg, ds, SimpleNamespace(
            checkpoint_blocks=False, seed=0))
        self.build_s = time.perf_counter() - t0
        self.levers = Levers(self.engine.module, args.compile_mode, args.compile_backend)
        self.cuda = self.device.type == "cuda"  # CPU: the tests' smoke run (no peak memory, host RAM as capacity)
        self.capacity = (torch.cuda.get_device_properties(self.device).total_memory if self.cuda
                         else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        self.calls = 0
        self.after_oom = False
        # eager rows run what the environment asks (bench/device/run.py says torch when the op build failed)
        self.ln_eager = os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE", "auto")

    def step(self, shape):
        """(fwd+bwd ms, step ms, peak bytes of fwd+bwd) of one micro-batch of shape (B, F, H, W)."""
        self.calls += 1
        return micro_step(self.engine, self.cfg, shape, self.calls, self.device, self.dtype)

    def measure(self, shape, k, mode, reps):
        """Warm-up then reps steps with k blocks checkpointed in `mode` (MODES); a row (status ok / oom)."""
        torch = self.torch
        compiled, policy = MODES[mode]
        # blocks compiled whole trace the op's PyTorch path (--compile-ln); regions call the op eagerly
        ln = os.environ["DS_ADAPTIVELOAD_LN_MODULATE"] = self.args.compile_ln if compiled is True else self.ln_eager
        self.levers.set(k, compiled, policy)
        row = {"k": k, "mode": mode, "policy": policy, "after_oom": self.after_oom, "ln_modulate": ln}
        try:
            t0 = time.perf_counter()
            self.step(shape)
            row["warmup_s"] = round(time.perf_counter() - t0, 2)
            runs = [self.step(shape) for _ in range(reps)]
        except torch.cuda.OutOfMemoryError as e:
            self.engine.zero_grad()
            torch.cuda.empty_cache()  # a ZeRO-2 step cut in backward may leave its buckets half reduced: say so
            self.after_oom = True
            return {**row, "status": "oom", "error": str(e).splitlines()[0][:200]}
        ms = [r[0] for r in runs]
        return {**row, "status": "ok", "ms": statistics.median(ms), "ms_all": [round(m, 1) for m in ms],
                "step_ms": statistics.median(r[1] for r in runs), "peak_gib": max(r[2] for r in runs) / GIB,
                "loss": [round(r[3], 4) for r in runs], "grad_norm": [r[4] for r in runs]}


def tokens_of(shape, cfg):
    B, f, h, w = shape
    pt, ph, pw = cfg.patch_size
    return (f // pt) * (h // ph) * (w // pw)


def memory_fields(bench, mode, profile_memory):
    """Per-token bytes with all / no blocks checkpointed from the two B = 1 probes, and per-sample bytes from
    SAMPLE_PROBE against that line -> the memory dict schedule/memory.py plans with (profile_memory's
    bytes_per_sample kept; the probes' own per-sample bytes with every block checkpointed are reported)."""
    L = bench.levers.num_layers
    probe = {}
    for k in (L, 0):
        rows = [bench.measure(s, k, mode, 1) for s in (*PROBES, SAMPLE_PROBE)]
        if any(r["status"] != "ok" for r in rows):
            return None, rows
        (s1, s2, sm), (p1, p2, pm) = ([tokens_of(s, bench.cfg) for s in PROBES + (SAMPLE_PROBE,)],
                                      [r["peak_gib"] * GIB for r in rows])
        slope = (p2 - p1) / (s2 - s1)
        fixed = p1 - slope * s1
        n = SAMPLE_PROBE[0]
        probe[k] = (slope, fixed, (pm - fixed - slope * sm * n) / (n - 1))  # per token, intercept, per sample
    (bpt_all, fixed, ps_all), (bpt_none, _, ps_none) = probe[L], probe[0]
    mem = {"capacity_bytes": bench.capacity, "safety": bench.args.safety, "fixed_bytes": round(fixed),
           "bytes_per_token": round(bpt_all), "block_bytes_per_token": round(max(bpt_none - bpt_all, 0) / L),
           "block_bytes_per_sample": round(max(ps_none - ps_all, 0) / L),
           "bytes_per_sample": profile_memory.get("bytes_per_sample", 0.0)}
    return mem, {"bytes_per_token_all": round(bpt_all), "bytes_per_token_none": round(bpt_none),
                 "bytes_per_sample_all": round(ps_all), "bytes_per_sample_none": round(ps_none),
                 "fixed_bytes": round(fixed), "probe_tokens": [tokens_of(s, bench.cfg) for s in PROBES],
                 "sample_probe": list(SAMPLE_PROBE)}


def run_mode(bench, doc, mode, shapes, ckpts, profile_memory, deadline):
    """Probes, then every shape x checkpointing variant of one mode; returns the proposed profile fields."""
    from ds_adaptiveload.schedule.memory import blocks_to_checkpoint, predicted_peak_bytes

    L, a = bench.levers.num_layers, bench.args
    t0 = time.perf_counter()
    mem, probe = memory_fields(bench, mode, profile_memory)
    proposed = {"mode": mode, "probe": probe, "probe_s": round(time.perf_counter() - t0, 1)}
    doc.doc.setdefault("proposed_profile", {})[mode] = proposed
    doc.save()
    if mem is None:
        return proposed
    proposed["memory"] = {k: mem[k] for k in ("block_bytes_per_token", "bytes_per_token", "fixed_bytes",
                                              "block_bytes_per_sample")}
    for name in shapes:
        shape = SHAPES[name]
        B, S = shape[0], tokens_of(shape, bench.cfg)
        k_auto = blocks_to_checkpoint(B * S, B, mem, L)
        ks = list(dict.fromkeys({"all": L, "k": k_auto, "none": 0}[c] for c in ckpts))
        for k in ks:
            base = {"shape": name, "B": B, "S": S, "tokens": B * S, "k_auto": k_auto,
                    "ckpt": "all" if k == L else "none" if k == 0 else "k",
                    "pred_peak_gib": predicted_peak_bytes(B * S, B, mem, L, k) / GIB}
            if time.monotonic() > deadline:
                doc.doc["skipped"].append({**base, "mode": mode, "k": k, "why": "time budget"})
                continue
            if base["pred_peak_gib"] * GIB > 0.98 * bench.capacity:
                doc.doc["rows"].append({**base, "mode": mode, "k": k, "status": "skipped: predicted over capacity"})
                continue
            row = {**base, **bench.measure(shape, k, mode, a.reps if S < 60000 else max(1, a.reps - 1))}
            if row["status"] == "ok":
                row["mfu"] = bench.cfg.flops_per_sample(S) * B / (row["ms"] / 1e3 * a.peak_tflops * 1e12)
            row["capacity_gib"] = bench.capacity / GIB
            doc.doc["rows"].append(row)
            print(f"[mfu] {json.dumps({k2: row.get(k2) for k2 in ('shape', 'mode', 'k', 'ms', 'mfu', 'peak_gib', 'status')})}",
                  flush=True)
            doc.save()
    proposed["time_ms"] = {"recompute_frac": recompute_frac(doc.doc["rows"], mode, L)}
    return proposed


def recompute_pair(text):
    """--e2e-recompute FULL,ATTN -> (float, float), each in [0, 1)."""
    try:
        full, attn = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FULL,ATTN (two fractions), got {text!r}") from None
    if not (0 <= attn <= full < 1):
        raise argparse.ArgumentTypeError(f"need 0 <= ATTN <= FULL < 1, got {text!r}")
    return full, attn


def recompute_frac(rows, mode, L):
    """1 - ms(none) / ms(all) of the largest shape where both ran in this mode (None where none did)."""
    ok = {(r["shape"], r["k"]): r for r in rows if r.get("mode") == mode and r.get("status") == "ok"}
    pairs = [(ok[s, L]["tokens"], 1 - ok[s, 0]["ms"] / ok[s, L]["ms"]) for s, k in ok if k == 0 and (s, L) in ok]
    return round(max(pairs)[1], 4) if pairs else None


def best_per_shape(rows):
    """The issue's per_shape list: the best MFU of each shape over the variants, with what ran it."""
    best = {}
    for r in rows:
        if r.get("status") == "ok" and r["mfu"] > best.get(r["shape"], {}).get("mfu", -1):
            best[r["shape"]] = r
    return [{"shape": r["shape"], "B": r["B"], "mfu": round(r["mfu"], 4), "ms": round(r["ms"], 1), "mode": r["mode"],
             "policy": r.get("policy", "full"), "k": r["k"], "peak_gib": round(r["peak_gib"], 2)} for r in best.values()]


def part_shapes(args, doc, deadline):
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.model.compile import compile_stats
    from ds_adaptiveload.calibrate.engine import op_state

    from ds_adaptiveload.shipped import config_profile

    profile_memory = CostProfile.load(config_profile(os.path.join(ROOT, args.config))).memory
    bench = Bench(args)
    doc.doc["build_s"] = round(bench.build_s, 1)
    doc.doc["ln_modulate_op"] = op_state(bench.device)  # what eager rows ran: the fused op, or PyTorch and why
    shapes, ckpts = split(args.shapes, SHAPES), split(args.ckpt, ("all", "k", "none"))
    for mode in split(args.modes, MODES):
        if time.monotonic() > deadline:
            doc.doc["skipped"].append({"mode": mode, "why": "time budget"})
            continue
        run_mode(bench, doc, mode, shapes, ckpts, profile_memory, deadline)
        doc.doc["per_shape"] = best_per_shape(doc.doc["rows"])
        doc.doc["compile_stats"] = compile_stats()
        doc.save()


# -- z3: the 14B shape under ZeRO-3 -------------------------------------------------------------------------

Z3_OVERRIDES = {  # one 14B block is 351M parameters: prefetch a whole block; keep the small vectors resident
    "stage3_prefetch_bucket_size": 4e8, "stage3_param_persistence_threshold": 1e6,
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}


def z3_engine(args, cfg, leaf):
    """build_model (zero.Init, partitioned at construction) + deepspeed.initialize, one process."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from ds_adaptiveload.train import config as tconfig
    from ds_adaptiveload.train.build import build_model
    from ds_adaptiveload.train.engine import single_process_env

    single_process_env()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(verbose=False)
    ds, _ = tconfig.load_ds_config(os.path.join(ROOT, args.z3_config))
    ds.update(gradient_accumulation_steps=1, steps_per_print=10**9)
    tconfig.ds_batch_keys(ds, 1)
    ds["zero_optimization"].update(Z3_OVERRIDES)
    for key in ("csv_monitor", "tensorboard", "wandb"):
        ds.pop(key, None)
    model = build_model(cfg, ds, checkpoint_blocks=True, seed=0, leaf_blocks=leaf)
    partitioned = all(hasattr(p, "ds_tensor") for p in model.parameters())
    with GatheredParameters([model.head.head.weight], modifier_rank=0), torch.no_grad():
        model.head.head.weight.normal_(std=0.02)  # a zero head makes every other gradient zero
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    return engine, partitioned


def part_z3(args, doc, deadline):
    """The 14B shape with --z3-layers blocks under ZeRO-3, WanBlock as leaf module or not: fwd+bwd ms of
    1 image and 480p 81f, and the per-micro-batch overhead (ms of 1 image)."""
    import gc

    import torch

    from ds_adaptiveload.model import WanConfig

    cfg = WanConfig.from_dict({**WanConfig.from_yaml(os.path.join(ROOT, args.z3_model_config)).to_dict(),
                               "num_layers": args.z3_layers})
    doc.doc["z3"] = {"config": args.z3_config, "overrides": Z3_OVERRIDES, "num_layers": args.z3_layers,
                     "params": cfg.num_params(), "rows": []}
    for leaf in (True, False):
        if time.monotonic() > deadline:
            doc.doc["skipped"].append({"z3_leaf": leaf, "why": "time budget"})
            continue
        engine, partitioned = z3_engine(args, cfg, leaf)
        device = next(engine.module.parameters()).device
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        for name, shape in (("img1", (1, 1, 60, 104)), ("480p81", SHAPES["480p81"])):
            runs = [micro_step(engine, cfg, shape, i, device, dtype) for i in range(1 + args.reps)][1:]
            ms = statistics.median(r[0] for r in runs)
            S = tokens_of(shape, cfg)
            doc.doc["z3"]["rows"].append({
                "leaf_blocks": leaf, "partitioned_at_construction": partitioned, "shape": name, "B": shape[0],
                "ms": ms, "step_ms": statistics.median(r[1] for r in runs), "peak_gib": max(r[2] for r in runs) / GIB,
                "mfu": cfg.flops_per_sample(S) * shape[0] / (ms / 1e3 * args.peak_tflops * 1e12)})
            doc.save()
        engine.destroy()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv=None):
    from ds_adaptiveload.train.config import default_alloc_conf

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    default_alloc_conf()
    deadline = time.monotonic() + args.time_budget
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    doc = Doc(args)
    parts = split(args.parts, ("shapes", "e2e", "z3"))
    if parts == ["shapes"]:
        part_shapes(args, doc, deadline)
    elif "shapes" in parts:
        # in a child process, so that the e2e runs get the GPU's memory back (and a crash there keeps e2e)
        import subprocess

        rc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--parts", "shapes", "--time-budget",
                             str(max(args.time_budget - E2E_RESERVE_S, 30))], cwd=ROOT).returncode
        if os.path.exists(doc.path):
            with open(doc.path) as f:
                doc.doc.update({k: v for k, v in json.load(f).items() if k not in ("e2e", "env")})
        doc.doc["shapes_rc"] = rc
    if "e2e" in parts:
        part_e2e(args, doc, deadline)
    if "z3" in parts:
        part_z3(args, doc, deadline)
    doc.save()
    print(f"[mfu] wrote {doc.path}: e2e_mfu {doc.doc.get('e2e_mfu')}, per_shape {doc.doc['per_shape']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
