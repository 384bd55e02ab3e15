"""What a checkpointed block could keep besides its attention outputs (issue #21, recompute): forward+backward ms
and peak memory of one micro-batch with every block checkpointed under the "attention" policy, against the same
with every block keeping its FFN output too (WanModel.checkpoint_ffn_blocks: the output of the block's one shrinking
matmul, the FFN's second projection, 8960 -> 1536 in the 1.3B model). That output is dim x 2 bytes per token in
bf16 (3 KB at dim 1536) and its recompute is 2 x ffn_dim x dim FLOPs per token (27.5 MFLOP, a third of a block's
non-attention matmuls), the most recompute per byte kept of anything in the block. The results give the profile's
memory.ffn_bytes_per_token and time_ms.ffn_recompute_frac (docs/calibration.md).

--compare open:open-elementwise measures the other end: every block open (nothing checkpointed), keeping all that
autograd saves, against every block open under WanModel.open_recompute "elementwise" (save_matmuls_policy: every
matmul and attention output kept, the norms, modulation, RoPE, gates and GELU recomputed in backward). Open blocks
hold the most memory per token (the profile's memory.block_bytes_per_token); what the elementwise recompute saves
of it, and what it costs in time, says whether the planner should open blocks that way.

--compare keep-ffn-function:keep-ffn (and open-elementwise-function:open-elementwise) measures the FFN as a custom
op (model/gelu_linear.py) against the autograd.Function it replaced, whose replay ran a GELU only to feed the
matmul the policy kept.

    python3 bench/model/ckpt_policy.py --out OUT [--cases img32,480p81,720p81,mixed] [--pairs 3] [--budget-s 400]
        [--compare attention:keep-ffn | open:open-elementwise | keep-ffn-function:keep-ffn | ...]
    CKPT_SMOKE=1 python3 bench/model/ckpt_policy.py --out /tmp/cp     # CPU: tiny model and shapes

The bare bf16 model as calibrate builds it (calibrate.engine.build_model: every block checkpointed, compiled
regions), calibrate's StepFn over it without DeepSpeed (packed_engine.PlainEngine), and after one warm-up of each
side A B B A pairs per case; with --profile-kernels one more profiled run of each side (kernel time by kind).
Writes OUT/ckpt-policy.json (every pair, fwd+bwd ms, peaks, the env)."""
import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for harness
import harness  # noqa: E402

SMOKE = os.environ.get("CKPT_SMOKE") == "1"
# case -> [(count, frames, height, width)] in pixels, as packed_model's specs
CASES = ({"img32": [(4, 1, 32, 64)], "480p81": [(1, 9, 64, 96)], "720p81": [(1, 9, 64, 128)],
          "mixed": [(1, 9, 64, 96), (2, 5, 32, 64), (6, 1, 32, 64)]} if SMOKE else
         {"img32": [(32, 1, 480, 832)], "480p81": [(1, 81, 480, 832)], "720p81": [(1, 81, 720, 1280)],
          "mixed": [(1, 81, 720, 1280), (2, 81, 480, 832), (40, 1, 480, 832)]})


# side -> the model's settings: (checkpoint_blocks and checkpoint_ffn_blocks as shares of the blocks,
# open_recompute); "half": the first half of the blocks checkpointed (attention policy), so that clips too large to
# run with every block open still compare their open blocks
SIDES = {"attention": (1, 0, "none"), "keep-ffn": (1, 1, "none"), "keep-ffn-function": (1, 1, "none"),
         "open": (0, 0, "none"), "open-elementwise": (0, 0, "elementwise"),
         "open-elementwise-function": (0, 0, "elementwise"),
         "half": (0.5, 0, "none"), "half-elementwise": (0.5, 0, "elementwise")}
COMPARE = ("attention:keep-ffn", "open:open-elementwise", "half:half-elementwise", "keep-ffn-function:keep-ffn",
           "open-elementwise-function:open-elementwise")


def _function_ffn():
    """The FFN's GELU and second projection as they ran Earlier: an autograd.Function with
    model/gelu_linear's math, whose replay under a policy that keeps the matmul's output still runs the GELU. The
    "-function" sides run it, so one call measures what the custom op saves."""
    import torch
    import torch.nn.functional as F

    from ds_adaptiveload.model import gelu_linear

    class GeluLinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, weight, bias):
            ctx.save_for_backward(h, weight)
            ctx.has_bias = bias is not None
            return F.linear(F.gelu(h, approximate="tanh"), weight, bias)

        @staticmethod
        def backward(ctx, dout):
            return gelu_linear._backward(ctx, dout)  # the op's own backward: only the replay differs

    return lambda self, h: GeluLinearFunction.apply(h, self.weight, self.bias)


def _shrinking_matmul_policy(base):
    """The FFN policy as it ran with the Function: the policy sees the addmm / mm inside the Function, not the op, and
    kept the one whose reduction dim exceeds its output's (weight.t() [K, N], K > N: the FFN's second projection).
    Without it the "-function" side would keep no FFN output at all: the attention policy's memory and recompute."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    first = {torch.ops.aten.addmm.default: 1, torch.ops.aten.mm.default: 0}

    def policy(ctx, op, *args, **kwargs):
        i = first.get(op)
        if i is not None and args[i + 1].shape[0] > args[i + 1].shape[1]:
            return CheckpointPolicy.MUST_SAVE
        return base(ctx, op, *args, **kwargs)
    return policy


@contextmanager
def policy_of(model, side):
    """side "attention": every block checkpointed, keeping its attention outputs only; "keep-ffn": its FFN output too
    (WanModel.checkpoint_ffn_blocks, model/wan.save_attention_ffn_policy); "open": no block checkpointed;
    "open-elementwise": none, each recomputing its elementwise steps (WanModel.open_recompute); "half" and
    "half-elementwise": likewise for the second half of the blocks, the first half checkpointed. Restores the
    model's settings afterwards."""
    from ds_adaptiveload.model import wan
    from ds_adaptiveload.model.gelu_linear import GeluLinear

    before = (model.checkpoint_blocks, model.checkpoint_full_blocks, model.checkpoint_ffn_blocks), model.open_recompute
    blocks, ffn, open_recompute = SIDES[side]
    n = len(model.blocks)
    model.set_checkpointing(True if blocks == 1 else int(blocks * n), model.checkpoint_full_blocks, int(ffn * n))
    model.open_recompute = open_recompute
    op_forward, ffn_policy = GeluLinear.forward, wan.save_attention_ffn_policy
    if side.endswith("-function"):
        GeluLinear.forward = _function_ffn()
        wan.save_attention_ffn_policy = _shrinking_matmul_policy(ffn_policy)
    try:
        yield
    finally:
        model.set_checkpointing(*before[0])
        model.open_recompute = before[1]
        GeluLinear.forward, wan.save_attention_ffn_policy = op_forward, ffn_policy


def compared_blocks(side, n) -> int:
    """How many blocks side b runs differently from side a: its open blocks that recompute elementwise, or its
    blocks that keep their FFN output."""
    blocks, ffn, open_recompute = SIDES[side]
    return n - int(blocks * n) if open_recompute == "elementwise" else int(ffn * n)


def kernel_split(fn, point, model, sides, device, top=15) -> dict:
    """--profile-kernels: one more profiled fwd+bwd of each side (after the pairs: compiled and warm), GPU kernel
    time by kind as packed_profile.py sorts it, and the kernels whose time differs most between the sides (b - a)."""
    import packed_profile as pp
    import torch

    class Sync:  # what profile_once needs of packed_model's Bench
        cuda = device.type == "cuda"

        def sync(self):
            if self.cuda:
                torch.cuda.synchronize()

    runs = {}
    for side in sides:
        with policy_of(model, side):
            runs[side] = pp.profile_once(Sync(), lambda: fn(point))
    a, b = (runs[side]["kernel_ms"] for side in sides)
    diff = sorted(((b.get(n, 0.0) - a.get(n, 0.0), n) for n in set(a) | set(b)), key=lambda d: -abs(d[0]))
    return {**{side: pp.summarise(r) for side, r in runs.items()},
            "largest_differences_ms": [{"kernel": n[:160], "kind": pp.kind(n), "b_minus_a_ms": round(d, 2)}
                                       for d, n in diff[:top]]}


def run(args) -> dict:
    import torch
    from packed_engine import micro_batches, plain_step

    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.config import default_alloc_conf

    default_alloc_conf()
    t0 = time.perf_counter()
    cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
    geo = CostProfile.load(os.path.join(ROOT, "configs/profiles/h200-wan1.3b-zero2.yaml")).geometry
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    opts = argparse.Namespace(seed=0, checkpoint_blocks=True, compile_blocks=args.compile_blocks or None)
    fn = plain_step(cfg, opts, geo, device, dtype, None)
    model = fn.engine.module
    model.set_checkpointing(model.checkpoint_blocks, 0, policy="attention")  # plain_step: every block checkpointed
    a, b = args.compare.split(":")
    out = {"model_config": args.model_config, "compile_blocks": args.compile_blocks, "compare": [a, b],
           "cases": [], "build_s": round(time.perf_counter() - t0, 1)}
    for case in args.cases.split(","):
        spec = CASES[case]
        point, = micro_batches(spec, packed=len(spec) > 1)  # one packed micro-batch, or the one shape's
        tokens = sum(c * geo.tokens(f, h, w) for c, f, h, w in spec)
        rec = {"case": case, "spec": spec, "tokens": tokens, "warmup_ms": {}, "pairs": []}
        for side in (a, b):
            with policy_of(model, side):
                rec["warmup_ms"][side] = round(fn(point)[0], 1)
        for i in range(args.pairs):
            if time.perf_counter() - t0 > args.budget_s:
                rec["status"] = "cut: time budget"
                break
            got = {}
            for side in ((a, b) if i % 2 == 0 else (b, a)):
                with policy_of(model, side):
                    ms, _, peak = fn(point)
                got[side] = (ms, (peak or 0) / 2**30)
            rec["pairs"].append({"a_ms": round(got[a][0], 1), "b_ms": round(got[b][0], 1),
                                 "a_peak_gib": round(got[a][1], 3), "b_peak_gib": round(got[b][1], 3),
                                 "speedup": round(got[a][0] / got[b][0], 5)})
        if rec["pairs"]:
            # speedup above 1: side b is faster; extra bytes: what side b holds more per token and block
            rec["speedup_median"] = statistics.median(p["speedup"] for p in rec["pairs"])
            extra = statistics.median(p["b_peak_gib"] - p["a_peak_gib"] for p in rec["pairs"]) * 2**30
            rec["blocks_compared"] = compared_blocks(b, cfg.num_layers)
            rec["extra_bytes_per_token_block"] = round(extra / (tokens * rec["blocks_compared"]))
            if b == "keep-ffn":  # the FFN output's size
                rec["expected_bytes_per_token_block"] = cfg.dim * (2 if dtype == torch.bfloat16 else 4)
        if args.profile_kernels:
            rec["kernels"] = kernel_split(fn, point, model, (a, b), device)
        print("CASE " + json.dumps(rec), flush=True)
        out["cases"].append(rec)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-config", default="configs/wan_tiny.yaml" if SMOKE else "configs/wan_1_3b.yaml")
    ap.add_argument("--compile-blocks", default="" if SMOKE else "regions",
                    help="as training's --compile-blocks ('' for eager blocks)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}, run in that order")
    ap.add_argument("--pairs", type=int, default=3, help="ABBA pairs per case")
    ap.add_argument("--budget-s", type=float, default=400.0, help="no pair starts after this many seconds")
    ap.add_argument("--compare", default=COMPARE[0], choices=COMPARE, help="side a:side b, timed in ABBA pairs")
    ap.add_argument("--profile-kernels", action="store_true",
                    help="then one profiled fwd+bwd of each side: kernel time by kind, the largest differences")
    args = ap.parse_args(argv)
    harness.comma_choices(ap, "--cases", args.cases, CASES)
    os.makedirs(args.out, exist_ok=True)
    res = {**run(args), "env": harness.environment()}
    with open(os.path.join(args.out, "ckpt-policy.json"), "w") as f:
        json.dump(res, f, indent=1)
    for c in res["cases"]:
        print(f"[ckpt_policy] {c['case']}: {args.compare}: b's speed-up {c.get('speedup_median')}, "
              f"{c.get('extra_bytes_per_token_block')} B more per token per block, pairs {len(c['pairs'])}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
