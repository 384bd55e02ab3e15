"""Packed micro-batches through the DeepSpeed engine (issue #19, item 5): forward+backward of one packed micro-batch
against the same samples as one-shape micro-batches, each a micro-step of the shipped config's engine, as training
runs them. bench/model/packed_model.py times the bare model, where nothing is paid per micro-batch but kernels; here
every micro-batch also pays DeepSpeed's per-micro-batch work (ZeRO's gradient reduction hooks and epilogue, ZeRO-3's
parameter gathers), which packing is meant to save.

    python3 bench/model/packed_engine.py --out OUT [--configs configs/ds_zero2_bf16.json,configs/ds_zero3_bf16.json]
        [--cases mixed,image-heavy,image-heavy-equal,mixed-split,mixed-small,mixed-plain] [--pairs 4] [--budget-s 400]
    PACKED_SMOKE=1 python3 bench/model/packed_engine.py --out /tmp/pe     # CPU: tiny model and shapes

One process per config builds the engine as calibrate does (calibrate/engine.py: training's own pieces, every
block checkpointed, the blocks compiled as `--compile-blocks` compiles them) and runs calibrate's StepFn: training's
micro_step, timed apart from the optimizer step that follows it. After one warm-up of each case (which compiles its
shapes), packed and its comparison are timed alternately A B B A (--pairs), so clock drift falls on both alike:
- the mixed pack (1 x 720p 81f, 2 x 480p 81f, 40 images) against its three one-shape micro-batches, summed;
- the image-heavy pack (112 images of 5 shapes) against 128 images of one shape (the best one-shape image batch of
  packed_model.py's sweep), in tokens/s;
- image-heavy-equal: the same mix of 5 shapes scaled to the 128-image batch's tokens (134 images, 199,056 tokens
  against 199,680), so that both sides pay a micro-batch's fixed costs over as many tokens;
- mixed-split: the mixed pack against itself with the value and cross-attention query gradients concatenated per
  block (layout._plain off), as the model ran it before packed_ops.split_linear;
- mixed-small: a pack of small shapes, the kind the packed policy fills slots with (1 x 480p 17f, 2 x 480p 5f,
  3 images; 18,720 tokens), against its three one-shape micro-batches. Their fwd+bwd is short enough that what a
  micro-step pays besides its kernels (host work, ZeRO's hooks and epilogue) shows; in the big mixed pack's
  micro-batches the GPU hides it;
- mixed-plain: the mixed pack against its three one-shape micro-batches as `mixed`, through a bare bf16 copy of the
  model in the same process (no DeepSpeed: loss.backward, the gradients dropped after each micro-batch), so that
  one machine shows what the engine's micro-step adds to each side.
Writes OUT/packed-engine-<config>.json per config (every timing, fwd+bwd and step ms apart, peaks; each side's wall
span, with its mean SM clock and power from OUT/gpu-<config>.csv, nvidia-smi sampled every 0.5 s)."""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for harness
import harness  # noqa: E402
import mfu_e2e  # noqa: E402  (its nvidia-smi monitor)


CASES = ("mixed", "image-heavy", "image-heavy-equal", "mixed-split", "mixed-small", "mixed-plain")  # comparisons


def scaled_mix(spec, tokens_of, target):
    """spec [(count, f, h, w)] with every count scaled by target / its tokens and rounded (at least 1)."""
    scale = target / sum(c * tokens_of(f, h, w) for c, f, h, w in spec)
    return [(max(1, round(c * scale)), f, h, w) for c, f, h, w in spec]


def micro_batches(spec, packed):
    """calibrate's StepFn inputs for a [(count, frames, height, width)] spec: one packed micro-batch (samples of a
    shape contiguous), or one tensor micro-batch per shape."""
    if packed:
        shapes = [tuple(s) for c, *s in spec for _ in range(c)]
        return [argparse.Namespace(shapes=shapes, B=len(shapes), role="packed")]
    return [argparse.Namespace(B=c, shape=tuple(s), role="fit") for c, *s in spec]


def concatenated(mbs):
    """mbs run with the projections' gradients concatenated, as before packed_ops.split_linear (mixed-split)."""
    return [argparse.Namespace(**vars(mb), concat=True) for mb in mbs]


def run_case(fn, mbs):
    """One case: every micro-batch's micro-step and optimizer step; (fwd+bwd ms summed, step ms summed, peak)."""
    from unittest import mock

    from ds_adaptiveload.model import layout

    fb, st, peak = 0.0, 0.0, 0
    for mb in mbs:
        with mock.patch.object(layout, "_plain", lambda *_: False) if getattr(mb, "concat", False) else nullcontext():
            a, b, p = fn(mb)
        fb, st, peak = fb + a, st + b, max(peak, p or 0)
    return fb, st, peak


class PlainEngine:
    """The engine's interface for calibrate's StepFn over a bare model: forward, loss.backward, and a step that
    drops the gradients (no optimizer, no ZeRO hooks)."""

    def __init__(self, model):
        self.module = model

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.module.zero_grad(set_to_none=True)

    zero_grad = step


def plain_step(cfg, opts, geo, device, dtype, dims):
    """StepFn over a bare copy of the model as init_engine builds it (calibrate.engine.build_model), in dtype."""
    from ds_adaptiveload.calibrate.engine import StepFn, build_model

    model, seq_shard = build_model(cfg, opts)  # one process: no sequence parallelism
    return StepFn(PlainEngine(model.to(device, dtype)), cfg, geo, seq_shard, device, dtype, seed=0, dims=dims)


def comparisons(pm, geo) -> dict:
    """case -> (name, packed micro-batches, comparison micro-batches, their tokens) for packed_model's mixes."""
    best = (pm.SWEEP[True][-1], *pm.IMAGE)
    equal = scaled_mix(pm.IMAGE_MIX[True], geo.tokens, best[0] * geo.tokens(*best[1:]))
    tokens = {k: sum(c * geo.tokens(f, h, w) for c, f, h, w in spec)
              for k, spec in (("mixed", pm.MIXED[True]), ("image-heavy", pm.IMAGE_MIX[True]), ("best", [best]),
                              ("equal", equal), ("small", pm.MIXED[False]))}
    pairs = {"mixed": ("mixed: packed / separate", micro_batches(pm.MIXED[True], True),
                       micro_batches(pm.MIXED[True], False), tokens["mixed"], tokens["mixed"]),
             "image-heavy": (f"image-heavy packed / images-B{best[0]}", micro_batches(pm.IMAGE_MIX[True], True),
                             micro_batches([best], False), tokens["image-heavy"], tokens["best"]),
             "image-heavy-equal": (f"image-heavy {sum(c for c, *_ in equal)} images packed / images-B{best[0]}",
                                   micro_batches(equal, True), micro_batches([best], False), tokens["equal"],
                                   tokens["best"]),
             "mixed-split": ("mixed packed: split projections / concatenated gradients",
                             micro_batches(pm.MIXED[True], True), concatenated(micro_batches(pm.MIXED[True], True)),
                             tokens["mixed"], tokens["mixed"]),
             # packed_model's mix for runs without checkpointing: small shapes only
             "mixed-small": ("mixed-small: packed / separate", micro_batches(pm.MIXED[False], True),
                             micro_batches(pm.MIXED[False], False), tokens["small"], tokens["small"])}
    pairs["mixed-plain"] = ("mixed-plain: packed / separate, bare model", *pairs["mixed"][1:])
    return pairs


def child(args) -> dict:
    """One engine of args.child's config: warm-up and ABBA pairs of each comparison asked for."""
    import packed_model as pm  # its module import sets the allocator the profiles were calibrated under

    from ds_adaptiveload.calibrate.engine import StepFn, init_engine
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.shipped import config_profile

    t0 = time.perf_counter()
    cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
    with open(os.path.join(ROOT, args.child)) as f:
        ds = json.load(f)
    geo = CostProfile.load(config_profile(os.path.join(ROOT, args.child), cfg)).geometry
    opts = argparse.Namespace(seed=0, checkpoint_blocks=True, compile_blocks=args.compile_blocks or None)
    engine, dims, seq_shard, device, dtype = init_engine(cfg, ds, opts)
    fn = StepFn(engine, cfg, geo, seq_shard, device, dtype, seed=0, dims=dims)
    pairs = comparisons(pm, geo)
    cases = args.case_list  # in the order asked for
    fns = {"mixed-plain": plain_step(cfg, opts, geo, device, dtype, dims)} if "mixed-plain" in cases else {}
    out = {"config": args.child, "compile_blocks": args.compile_blocks, "world": dims.world,
           "engine_s": round(time.perf_counter() - t0, 1), "comparisons": []}
    for case in cases:
        name, a, b, tok_a, tok_b = pairs[case]
        step = fns.get(case, fn)
        warm = [run_case(step, a), run_case(step, b)]  # compiles the shapes; not counted
        rec = {"name": name, "through": "bare model" if case in fns else "engine", "tokens_a": tok_a,
               "tokens_b": tok_b, "micro_batches_b": len(b),
               "warmup_ms": [round(w[0], 1) for w in warm], "pairs": []}
        for i in range(args.pairs):
            if time.perf_counter() - t0 > args.budget_s:
                rec["status"] = "cut: time budget"
                break
            got, span = {}, {}
            for key, mbs in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
                t_start = time.time()  # wall clock: lines the side up with a GPU clock / power log
                got[key] = run_case(step, mbs)
                span[key] = [round(t_start, 3), round(time.time(), 3)]
            (fa, sa, pa), (fb, sb, pb) = got["a"], got["b"]
            rec["pairs"].append({"a_fwd_bwd_ms": round(fa, 1), "b_fwd_bwd_ms": round(fb, 1), "a_step_ms": round(sa, 1),
                                 "b_step_ms": round(sb, 1), "a_peak_gib": round(pa / 2**30, 2),
                                 "b_peak_gib": round(pb / 2**30, 2), "ratio": round(tok_a / fa / (tok_b / fb), 5),
                                 "a_wall": span["a"], "b_wall": span["b"]})
        if rec["pairs"]:
            # above 1: packed trains its tokens faster (fwd+bwd) than its comparison
            rec["ratio_median"] = round(statistics.median(p["ratio"] for p in rec["pairs"]), 5)
            rec["saved_ms_median"] = round(statistics.median(
                p["b_fwd_bwd_ms"] * tok_a / tok_b - p["a_fwd_bwd_ms"] for p in rec["pairs"]), 1)
        print("PAIR " + json.dumps(rec), flush=True)
        out["comparisons"].append(rec)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def gpu_by_side(res, gpu_csv):
    """Each pair's sides get the mean SM clock and power of the nvidia-smi samples inside their wall span (a_gpu,
    b_gpu), so a side that ran at lower clocks (power cap) shows; nothing without the log."""
    sides = [(pair, side) for c in res.get("comparisons", []) for pair in c["pairs"] for side in ("a", "b")]
    spans = [pair[f"{side}_wall"] for pair, side in sides]
    recs = [{"step": i, "end_time": t1, "step_ms": (t1 - t0) * 1e3} for i, (t0, t1) in enumerate(spans)]
    for got in mfu_e2e.gpu_per_step(gpu_csv, recs):  # one read of the log; sides without samples are left out
        pair, side = sides[got.pop("step")]
        pair[f"{side}_gpu"] = got


def main(argv=None):
    smoke = os.environ.get("PACKED_SMOKE") == "1"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="configs/ds_zero2_bf16.json", help="DeepSpeed JSONs, comma-separated")
    ap.add_argument("--model-config", default="configs/wan_tiny.yaml" if smoke else "configs/wan_1_3b.yaml")
    ap.add_argument("--compile-blocks", default="" if smoke else "regions",
                    help="as training's --compile-blocks ('' for eager blocks)")
    ap.add_argument("--pairs", type=int, default=4, help="ABBA pairs per comparison")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}, run in that order")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="no pair starts after this many seconds (each config: an equal share of what is left)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.case_list = harness.comma_choices(ap, "--cases", args.cases, CASES)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    t0, rc = time.perf_counter(), 0
    configs = args.configs.split(",")
    for i, config in enumerate(configs):
        # each config an equal share of what is left (an earlier first config took all but ZeRO-3's
        # image-heavy pairs); the child's --budget-s: argparse keeps the last one
        left = (args.budget_s - (time.perf_counter() - t0)) / (len(configs) - i)
        name = os.path.splitext(os.path.basename(config))[0]
        gpu_csv = os.path.join(args.out, f"gpu-{name}.csv")
        mon = mfu_e2e.gpu_monitor(gpu_csv, interval=0.5)
        try:
            res, p = harness.run_child([os.path.abspath(__file__), *(argv or sys.argv[1:]), "--child", config,
                                        "--budget-s", str(max(left, 0.0))], "RESULT ")
        finally:
            if mon is not None:
                mon.terminate()
        if res is None:
            res, rc = {"config": config, "rc": p.returncode, "stderr_tail": p.stderr[-4000:]}, 1
        res["env"] = harness.environment(gpu=True)
        gpu_by_side(res, gpu_csv)
        with open(os.path.join(args.out, f"packed-engine-{name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        for c in res.get("comparisons", []):
            print(f"[packed_engine] {name}: {c['name']}: ratio {c.get('ratio_median')}, saved "
                  f"{c.get('saved_ms_median')} ms (pairs {len(c['pairs'])})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
