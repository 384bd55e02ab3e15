"""Where a packed micro-batch's time goes, against the same samples as one micro-batch per shape: GPU kernel time
by kind (GEMM, attention, compiled elementwise, copies, other) and the kernels whose time differs most, from one
profiled fwd+bwd of each after a warm-up (bench/model/packed_model.py's model, samples and runs; 1.3B, bf16,
every block checkpointed, compiled regions).

    python bench/model/packed_profile.py --out OUT [--mix mixed|image-heavy] [--packed-variants default,merges]

--packed-variants merges: the packed run again with the attention's ends as they were until 2026-12-02, for an A/B in one run: RoPE per group on views of q and k, whose gradients autograd concatenates, and
the groups' attention outputs merged into one tensor before the output projection. (The earlier A/B of
the gated add's regions, --packed-variants previous, is in this file at commit 4b33636.)
"""
import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import packed_model as pm  # noqa: E402  (sets the allocator before torch touches CUDA)
import torch  # noqa: E402

KINDS = (("attention", r"cudnn|flash|fmha|attention|sdpa"), ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|cublas"),
         ("ln_modulate", r"lnmod|ln_modulate|fwd_vec|bwd_vec|_fwd_|_bwd_"), ("compiled", r"^triton_"),
         ("copy", r"copy|cat|Cat|memcpy|Memcpy|memset|fill"))


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name):
            return k
    return "other"


def profile_once(b, fn) -> dict:
    """Wall ms of one fwd+bwd (synchronised) and its kernels' GPU time by name (on a CPU: the ops' self times, for
    a smoke run)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    b.sync()
    with profile(activities=[ProfilerActivity.CUDA if b.cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        fn()
        b.sync()
        wall = (time.perf_counter() - t) * 1000
    per = defaultdict(float)
    count = defaultdict(int)
    for e in prof.events():
        if not b.cuda or getattr(e.device_type, "name", "") == "CUDA":
            per[e.name] += (e.time_range.elapsed_us() if b.cuda else e.self_cpu_time_total) / 1000
            count[e.name] += 1
    return {"wall_ms": round(wall, 1), "kernel_ms": per, "calls": count}


def summarise(run: dict) -> dict:
    by_kind = defaultdict(float)
    for name, ms in run["kernel_ms"].items():
        by_kind[kind(name)] += ms
    return {"wall_ms": run["wall_ms"], "gpu_ms": round(sum(run["kernel_ms"].values()), 1),
            "kernels": sum(run["calls"].values()), "by_kind_ms": {k: round(v, 1) for k, v in sorted(by_kind.items())}}


@contextlib.contextmanager
def merges():
    """Layout.rope_qk and Layout.rows as before 2026-12-02, for the duration."""
    from ds_adaptiveload.model.layout import Layout
    from ds_adaptiveload.model.packing import merge

    saved = Layout.rope_qk, Layout.rows
    Layout.rope_qk, Layout.rows = Layout.rope_per_group, lambda self, parts: merge(parts).flatten(1)
    try:
        yield
    finally:
        Layout.rope_qk, Layout.rows = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mix", default="mixed", choices=("mixed", "image-heavy"))
    p.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    p.add_argument("--profile", default="configs/profiles/h200-wan1.3b-zero3.yaml")
    p.add_argument("--compile", default="regions", choices=("none", "regions"))
    p.add_argument("--packed-variants", default="default",
                   help="comma list of default, merges (module docstring)")
    args = p.parse_args(argv)
    args.reps, args.heavy_reps, args.budget_s = 1, 1, 1e9
    b = pm.Bench(args)
    b.model.set_checkpointing(True, 0)
    spec = (pm.MIXED if args.mix == "mixed" else pm.IMAGE_MIX)[True]
    smp = b.samples(spec)
    runs = {}
    for variant in args.packed_variants.split(","):
        if variant not in ("default", "merges"):
            raise SystemExit(f"error: --packed-variants: unknown {variant!r}")
        with merges() if variant == "merges" else contextlib.nullcontext():
            runs["packed" if variant == "default" else f"packed-{variant}"] = profile_once(b, b.packed_fn(smp))
    runs["separate"] = profile_once(b, b.separate_fn(smp))
    if "packed" not in runs:
        runs["packed"] = runs[next(iter(runs))]
    names = set(runs["packed"]["kernel_ms"]) | set(runs["separate"]["kernel_ms"])
    diff = sorted(((runs["packed"]["kernel_ms"].get(n, 0.0) - runs["separate"]["kernel_ms"].get(n, 0.0), n)
                   for n in names), key=lambda d: -abs(d[0]))
    res = {"date": b.res["date"], "device": b.res["device"], "torch": torch.__version__, "mix": args.mix,
           "spec": spec, "compile": args.compile, "packed_variants": args.packed_variants,
           **{k: summarise(v) for k, v in runs.items()},
           "largest_differences_ms": [{"kernel": n[:160], "kind": kind(n), "packed_minus_separate_ms": round(d, 2),
                                       "calls_packed": runs["packed"]["calls"].get(n, 0),
                                       "calls_separate": runs["separate"]["calls"].get(n, 0)} for d, n in diff[:40]]}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"packed-profile-{args.mix}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in runs}, indent=1))
    for d in res["largest_differences_ms"][:15]:
        print(json.dumps(d))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
