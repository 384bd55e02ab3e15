"""The optimizer step of the shipped config's engine (issue #21): what engine.step() costs per optimizer step with
each AdamW DeepSpeed can run on the GPU, and whether they agree.

    python3 bench/model/optim_step.py --out OUT [--configs configs/ds_zero2_bf16.json]
        [--variants foreach,torch-fused,ds-fused] [--steps 8]
    OPTIM_SMOKE=1 python3 bench/model/optim_step.py --out /tmp/os     # CPU: tiny model

Variants (the config's "optimizer.params", changed only in these keys):
- foreach: torch.optim.AdamW with its default multi-tensor path ("torch_adam": true, no "fused");
- torch-fused: torch.optim.AdamW(fused=True) ("torch_adam": true, "fused": true);
- ds-fused: DeepSpeed's FusedAdam ("torch_adam": false), its CUDA op JIT-built on first use.

One process per config and variant builds the engine as calibrate does (calibrate/engine.py: training's pieces,
every block checkpointed, eager blocks: the step does not depend on how the blocks run) and runs calibrate's StepFn
on one 480x832 image: a micro-step, then the optimizer step, timed apart. After --warmup steps the next --steps are
timed; one more runs under torch.profiler for its kernels. Every variant starts from the same seeded model and
inputs, so the fp32 master weights' change over the run (its norm, and its projections on seeded random vectors)
must agree between variants: the parent reports each variant's relative difference from the first.
Writes OUT/optim-step-<config>.json (every step's ms, the kernels of one step, the agreement)."""
import argparse
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for harness
import harness  # noqa: E402

# DeepSpeed 0.19.8's op builder cannot parse an arch list with a suffix such as the H200 machine's 9.0a (its
# FusedAdam crashed there, optim-step-2026-12-04-h200-s22-call1): the ds-fused child gets the list without it.
ARCH_SUFFIX = re.compile(r"(\d+\.\d+)[a-z]+")

VARIANTS = {"foreach": {"torch_adam": True, "fused": None},
            "torch-fused": {"torch_adam": True, "fused": True},
            "ds-fused": {"torch_adam": False, "fused": None}}
PROJECTIONS = 4


def with_variant(ds: dict, variant: str) -> dict:
    """The DeepSpeed config with its AdamW's params set as the variant says (None: the key removed)."""
    opt = dict(ds["optimizer"])
    params = dict(opt.get("params", {}))
    for key, value in VARIANTS[variant].items():
        params.pop(key, None)
        if value is not None:
            params[key] = value
    return {**ds, "optimizer": {**opt, "params": params}}


def master_flat(engine):
    """The optimizer's flat fp32 master partitions (ZeRO-1/2 and ZeRO-3 name them differently)."""
    opt = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        flat = getattr(opt, name, None)
        if flat:
            return list(flat)
    raise RuntimeError(f"optim_step: no flat fp32 master weights on {type(opt).__name__}")


def fingerprint(before, after, device) -> dict:
    """The change of the master weights: its norm and its projections on PROJECTIONS seeded N(0, 1) vectors."""
    import torch

    norm2, proj = 0.0, [0.0] * PROJECTIONS
    for i, (b, a) in enumerate(zip(before, after)):
        d = (a.detach().float() - b).double()
        norm2 += float((d * d).sum())
        for j in range(PROJECTIONS):
            g = torch.Generator(device=device).manual_seed(1000 * i + j)
            r = torch.randn(d.numel(), generator=g, device=device, dtype=torch.float32)
            proj[j] += float((d.view(-1) * r.double()).sum())
    return {"delta_norm": norm2 ** 0.5, "projections": proj}


def kernels_of_step(fn, point, device, top: int = 12) -> dict:
    """One more StepFn call under torch.profiler: the optimizer step's GPU kernels (count, total ms, the top)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if device.type != "cuda":
        return {}
    engine, marks = fn.engine, {}
    step = engine.step

    def marked_step(*a, **k):
        with record_function("optim_step"):
            return step(*a, **k)

    engine.step = marked_step
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(point)
    finally:
        engine.step = step
    events = prof.events()
    span = [e for e in events if e.name == "optim_step"]
    if not span:
        return {}
    lo, hi = span[0].time_range.start, span[0].time_range.end
    # StepFn synchronises before the step and after it, so every kernel that starts after the step's CPU span
    # opens is the step's
    for e in events:
        if (e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= lo
                and not getattr(e, "is_user_annotation", False)):
            m = marks.setdefault(e.name, [0, 0.0])
            m[0] += 1
            m[1] += e.time_range.elapsed_us() / 1000
    rows = sorted(marks.items(), key=lambda kv: -kv[1][1])
    return {"kernels": sum(c for c, _ in marks.values()), "kernel_ms": round(sum(t for _, t in marks.values()), 2),
            "cpu_span_ms": round((hi - lo) / 1000, 2),
            "top": [{"name": n[:120], "count": c, "ms": round(t, 2)} for n, (c, t) in rows[:top]]}


def child(args) -> dict:
    """One engine of args.child's config and args.variant: warm-up, timed steps, one profiled step."""
    import torch

    from ds_adaptiveload.calibrate.engine import StepFn, init_engine
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.shipped import config_profile

    t0 = time.perf_counter()
    cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
    with open(os.path.join(ROOT, args.child)) as f:
        ds = with_variant(json.load(f), args.variant)
    geo = CostProfile.load(config_profile(os.path.join(ROOT, args.child), cfg)).geometry
    opts = argparse.Namespace(seed=0, checkpoint_blocks=True, compile_blocks=None)
    engine, dims, seq_shard, device, dtype = init_engine(cfg, ds, opts)
    fn = StepFn(engine, cfg, geo, seq_shard, device, dtype, seed=0, dims=dims)
    shape = (1, 64, 64) if args.smoke else (1, 480, 832)
    point = argparse.Namespace(B=1, shape=shape, role="fit", s=geo.tokens(*shape), tokens=geo.tokens(*shape))
    before = [t.detach().float().clone() for t in master_flat(engine)]
    fb, st = [], []
    for i in range(args.warmup + args.steps):
        a, b, _ = fn(point)
        if i >= args.warmup:
            fb.append(round(a, 2))
            st.append(round(b, 2))
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the basic optimizer
    out = {"config": args.child, "variant": args.variant, "optimizer": type(inner).__name__,
           "flags": {k: inner.defaults.get(k) for k in ("fused", "foreach", "adam_w_mode") if k in inner.defaults},
           "fwd_bwd_ms": fb, "step_ms": st, "step_ms_median": statistics.median(st),
           "fingerprint": fingerprint(before, master_flat(engine), device),
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}
    out["profile"] = kernels_of_step(fn, point, device)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def child_env(variant: str):
    """The child's environment changes: ds-fused gets TORCH_CUDA_ARCH_LIST without arch suffixes (ARCH_SUFFIX)."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if variant != "ds-fused" or not ARCH_SUFFIX.search(arch):
        return None
    return {"TORCH_CUDA_ARCH_LIST": ARCH_SUFFIX.sub(r"\1", arch)}


def agreement(results: list) -> None:
    """Each result's relative difference from the first's master-weight change (norm and projections)."""
    ref = results[0].get("fingerprint") if results else None
    for r in results:
        fp = r.get("fingerprint")
        if not (ref and fp):
            continue
        scale = max(ref["delta_norm"], 1e-30)
        r["vs_first"] = {"delta_norm_rel": abs(fp["delta_norm"] - ref["delta_norm"]) / scale,
                         "projection_rel_max": max(abs(a - b) for a, b in zip(fp["projections"], ref["projections"]))
                         / scale}


def main(argv=None):
    smoke = os.environ.get("OPTIM_SMOKE") == "1"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="configs/ds_tiny_cpu.json" if smoke else "configs/ds_zero2_bf16.json",
                    help="DeepSpeed JSONs, comma-separated")
    ap.add_argument("--variants", default="foreach,torch-fused" if smoke else ",".join(VARIANTS),
                    help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--model-config", default="configs/wan_tiny.yaml" if smoke else "configs/wan_1_3b.yaml")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.smoke = smoke
    variants = harness.comma_choices(ap, "--variants", args.variants, VARIANTS)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rc = 0
    for config in args.configs.split(","):
        results = []
        for variant in variants:
            res, p = harness.run_child([os.path.abspath(__file__), *(argv or sys.argv[1:]), "--child", config,
                                        "--variant", variant], "RESULT ", env=child_env(variant))
            if res is None:
                res, rc = {"config": config, "variant": variant, "rc": p.returncode,
                           "stderr_tail": p.stderr[-4000:]}, 1
            res["env_override"] = child_env(variant)
            results.append(res)
            print(f"[optim_step] {config} {variant}: step ms median {res.get('step_ms_median')} "
                  f"({res.get('optimizer')}), kernels {res.get('profile', {}).get('kernels')}", flush=True)
        agreement(results)
        name = os.path.splitext(os.path.basename(config))[0]
        with open(os.path.join(args.out, f"optim-step-{name}.json"), "w") as f:
            json.dump({"config": config, "results": results, "env": harness.environment(gpu=True)}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
