"""Analytic cost terms (pure, no torch): `calibrate --estimate` (a profile from the model's FLOPs and memory
arithmetic, no GPU) and the Ulysses conversion of terms measured on one GPU to per-GPU tokens."""
import math
from dataclasses import replace

from ds_adaptiveload.calibrate.fit import ZERO_BYTES_PER_PARAM, budget_tokens
from ds_adaptiveload.calibrate.grid import GRID_SHAPES, parse_shapes
from ds_adaptiveload.calibrate.result import build_profile, run_meta
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import Geometry

# --estimate defaults, from ../shared/reference/h200-wan1.3b-block-cost.json (one 1.3B block, fwd+bwd):
FIXED_MS_PER_LAYER = 1.84   # intercept of the 30-block fit (55.1 ms) / 30: launch-bound overhead per block
BLOCK_ACT_FP32_PER_DIM = 6  # fp32 values per token x dim saved by one block (modulation, residual math)


def estimate_profile(cfg, ds, args):
    """Analytic profile: time from WanConfig.flops_per_sample at peak * mfu, memory from arithmetic.

    - FLOPs per sample are a quadratic in tokens: f(S) = c0 + c1 S + c2 S^2 (flops_per_sample is exact).
      With checkpointing the forward runs twice: x 4/3. c0 (text embedding, cross-attention k/v) goes to
      `fixed` with the per-block launch overhead measured on one 1.3B block (FIXED_MS_PER_LAYER).
    - Ulysses (k = sequence_parallel_size): per GPU s = S/k tokens; linear work on s, attention on S^2/k
      -> per_token_sq on s is k x; all-to-all of q, k, v, out (4 s dim elements per layer, forward; x2
      with backward, x3 with recompute) over --link-gbs adds to per_token.
    - ZeRO-3 (N > 1 GPUs): parameter all-gathers (forward, recompute) and the gradient reduce-scatter,
      2 bytes x params each x (N-1)/N, over --link-gbs, are charged to `fixed` as if not overlapped.
    - Memory per token: checkpointed block inputs (layers x dim bf16) + one block's saved activations
      while it is recomputed (bf16 2 ffn + 16 dim, fp32 6 dim) + the loss tensors; fixed: 16 bytes/param
      over N (ZeRO-3 shards) + two gathered blocks in bf16 + 1 GiB of buffers and workspace."""
    sp = int(ds.get("sequence_parallel_size", 1))
    world = args.train_world_size or max(2, sp)
    if world % sp:
        raise UserError(f"--train-world-size {world} is not divisible by sequence_parallel_size {sp}")
    if not (0 < args.mfu <= 1) or args.peak_tflops <= 0 or args.device_memory_gib <= 0 or args.link_gbs <= 0:
        raise UserError("--mfu must be in (0, 1]; --peak-tflops, --device-memory-gib, --link-gbs must be > 0")
    flops = [cfg.flops_per_sample(n) for n in (0, 1, 2)]
    c0, c2 = flops[0], (flops[2] - 2 * flops[1] + flops[0]) / 2
    c1 = flops[1] - c0 - c2
    recompute = 4 / 3 if args.checkpoint_blocks else 1.0
    ms_per_flop = recompute / (args.peak_tflops * 1e12 * args.mfu) * 1000
    link = args.link_gbs * 1e9 / 1000  # bytes per ms
    passes = 3 if args.checkpoint_blocks else 2
    a2a = 4 * cfg.dim * 2 * cfg.num_layers * passes * (sp - 1) / sp / link if sp > 1 else 0.0
    per_token = c1 * ms_per_flop + a2a
    per_token_sq = c2 * ms_per_flop * sp
    params = cfg.num_params()
    zero_comm = (2 + (1 if args.checkpoint_blocks else 0)) * 2 * params * (world - 1) / world / link
    fixed = FIXED_MS_PER_LAYER * cfg.num_layers + c0 * ms_per_flop + zero_comm
    # Optimizer step: Adam reads/writes ~ 16 B + 2 B per parameter shard at the copy bandwidth (4.25 TB/s)
    # plus a per-tensor launch cost; small next to a step, kept for completeness.
    step_fixed = 36 * params / world / 4.25e12 * 1000 + 5.0
    d, f = cfg.dim, cfg.ffn_dim
    block_params = 2 * (4 * (d * d + d) + 2 * d) + 2 * d + (d * f + f) + (f * d + d) + 6 * d
    bpt = (cfg.num_layers * cfg.dim * 2 + 2 * (2 * cfg.ffn_dim + 16 * cfg.dim)
           + 4 * BLOCK_ACT_FP32_PER_DIM * cfg.dim + 5 * 4 * cfg.out_dim * math.prod(cfg.patch_size))
    fixed_bytes = ZERO_BYTES_PER_PARAM * params / world + 2 * 2 * block_params + 2**30
    capacity = args.device_memory_gib * 2**30
    budget = budget_tokens(capacity, args.safety, fixed_bytes, bpt)
    meta = {**run_meta(cfg, ds, args, sp, world), "estimated": True, "device": "estimate",
            "peak_tflops": args.peak_tflops, "mfu": args.mfu, "device_memory_gib": args.device_memory_gib,
            "link_gbs": args.link_gbs, "train_world_size": world}
    fit = {"method": "analytic (calibrate.estimate_profile)",
           "flops_per_sample": {"c0": c0, "c1": c1, "c2": c2},
           "terms_ms": {"compute_per_token": c1 * ms_per_flop, "ulysses_all_to_all_per_token": a2a,
                        "launch_fixed": FIXED_MS_PER_LAYER * cfg.num_layers, "zero3_comm_fixed": zero_comm},
           "bytes_per_token_terms": {"checkpoints": cfg.num_layers * cfg.dim * 2,
                                     "one_block_recompute": bpt - cfg.num_layers * cfg.dim * 2}}
    geo = Geometry(patch_size=cfg.patch_size)
    grid = parse_shapes(args.shapes, "--shapes") if args.shapes else GRID_SHAPES
    sizes = [-(-geo.tokens(*sh) // sp) for sh in grid]
    return build_profile(geo, (fixed, per_token, per_token_sq), step_fixed, (fixed_bytes, bpt), capacity,
                         args.safety, budget, meta, fit, dual_range=(min(sizes), max(sizes)), dual_sizes=sizes,
                         pin_dual=args.pin_dual)


def sp_terms(per_token, per_token_sq, cfg, k, checkpoint_blocks=True, link_gbs=200.0):
    """(per_token, per_token_sq, all_to_all_ms_per_token) on per-GPU tokens s = S/k from terms measured
    unsharded on one GPU: linear work is on S/k tokens but Ulysses attention costs S^2/k, i.e. k * s^2, and
    the all-to-all (q, k, v, out: 4 * s * dim bf16 elements per layer forward, x2 with backward, x3 with
    recompute, (k-1)/k of it crossing the link) is added at `link_gbs`. k = 1: unchanged."""
    if k <= 1:
        return per_token, per_token_sq, 0.0
    passes = 3 if checkpoint_blocks else 2
    a2a = 4 * cfg.dim * 2 * cfg.num_layers * passes * (k - 1) / k / (link_gbs * 1e6)
    return per_token + a2a, per_token_sq * k, a2a


def sp_profile(profile, cfg, k, link_gbs=200.0, source=None):
    """A profile measured without sequence parallelism (meta.sp 1), converted to per-GPU terms at sp = k
    with sp_terms; the fit report is replaced by the conversion's, and the source's header (which says how
    the source was measured) dropped."""
    pt, pt2, a2a = sp_terms(profile.per_token_ms, profile.per_token_sq_ms, cfg, k,
                            profile.meta.get("checkpoint_blocks", True), link_gbs)
    meta = {**profile.meta, "sp": k, "derived_from": source,
            "derivation": f"calibrate.sp_profile: calibrate.sp_terms, k = {k}, link {link_gbs} GB/s"}
    return replace(profile, per_token_ms=pt, per_token_sq_ms=pt2, meta=meta, header="",
                   fit={"sp_from_one_gpu": {"k": k, "all_to_all_ms_per_token": a2a, "link_gbs": link_gbs}})

