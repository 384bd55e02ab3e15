"""`python -m ds_adaptiveload calibrate`: measure the real training step and write a cost profile.

    python -m ds_adaptiveload calibrate --model-config configs/wan_1_3b.yaml \
        --deepspeed_config configs/ds_zero3_bf16.json --out profile.yaml            # on a GPU
    python -m ds_adaptiveload calibrate --model-config configs/wan_1_3b.yaml \
        --deepspeed_config configs/ds_zero3_bf16.json --out profile.yaml --estimate  # no GPU: analytic
    deepspeed --num_gpus 2 --no_local_rank --module ds_adaptiveload calibrate --model-config \
        configs/wan_1_3b.yaml --deepspeed_config configs/ds_zero3_bf16_sp2.json --out profile.yaml  # Ulysses sp=2
    (--no_local_rank: the launcher would put --local_rank=N before the subcommand, which the CLI rejects.)

Measured mode runs the step exactly as the trainer does (deepspeed.initialize with the JSON: ZeRO stage,
bf16, optimizer; per-block activation checkpointing; the fused LN-modulate op through the model; Ulysses
when launched on k ranks with sequence_parallel_size k; the flow-matching loss of train/flow.py) on a grid
of (B, S) shapes, times forward+backward and the optimizer step separately (medians after a warm-up),
records the peak memory of every point, and fits

    time_ms(B, s) = smax(floor, fixed + per_token * B*s + per_token_sq * B*s^2)   (s = per-GPU tokens)
    peak_bytes(B, s) = max(floor, fixed_bytes + bytes_per_token * B*s + bytes_per_sample * B)
    budget_tokens = (capacity * safety - fixed_bytes) / bytes_per_token
    sample_tokens = bytes_per_sample / bytes_per_token    (a micro-batch holds B * (s + sample_tokens) <= budget)

An out-of-memory point is caught, excluded from the fit and recorded as a bound. Held-out shapes (not
fitted) are measured too and their prediction error is reported. The fitting and scheduling functions
below are pure (no torch) so they are tested on synthetic timings (tests/test_calibrate.py).
docs/calibration.md explains the choices.
"""
import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.fileio import read_json_object
from ds_adaptiveload.schedule.profile import smooth_max

# Fitted grid: an image, then 480p clips of growing length, then 720p clips up to the longest (81 frames).
GRID_SHAPES = [(1, 480, 832), (9, 480, 832), (21, 480, 832), (45, 480, 832), (81, 480, 832),
               (49, 720, 1280), (81, 720, 1280)]
# Held out (never fitted): other shapes of the video-heavy mix (mixes.py), between and beside the grid's.
HELDOUT_SHAPES = [(1, 1024, 1024), (33, 480, 832), (17, 720, 1280), (241, 240, 416), (161, 320, 576)]
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ZERO_BYTES_PER_PARAM = 16   # ZeRO-3, bf16 + Adam: bf16 param + fp32 master + Adam m, v (+ grad) per shard
# --estimate defaults, from ../shared/reference/h200-wan1.3b-block-cost.json (one 1.3B block, fwd+bwd):
FIXED_MS_PER_LAYER = 1.84   # intercept of the 30-block fit (55.1 ms) / 30: launch-bound overhead per block
BLOCK_ACT_FP32_PER_DIM = 6  # fp32 values per token x dim saved by one block (modulation, residual math)


# ----------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p):
    p.add_argument("--model-config", required=True, help="WanConfig YAML (configs/wan_*.yaml)")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="the DeepSpeed JSON the training run uses (ZeRO stage, bf16, optimizer, "
                        "sequence_parallel_size)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--estimate", action="store_true",
                   help="no GPU: write an analytic profile from the model's FLOPs and memory arithmetic")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds for the whole measured calibration, start-up included (default 300)")
    p.add_argument("--safety", type=float, default=0.9, help="fraction of device memory the budget may use")
    p.add_argument("--checkpoint-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="per-block activation checkpointing, as the trainer's --checkpoint-blocks (default on)")
    p.add_argument("--train-world-size", type=int, default=None,
                   help="GPUs of the training run the budget is for (ZeRO-3 shards scale with 1/N); "
                        "default: this run's world size, at least sequence_parallel_size (--estimate: at least 2)")
    p.add_argument("--shapes", default=None,
                   help="fitted shapes FxHxW,... (default: 1x480x832 up to 81x720x1280)")
    p.add_argument("--heldout", default=None, help="held-out shapes FxHxW,... ('' for none)")
    p.add_argument("--batches", default=None, help="batch sizes to try per shape, e.g. 1,2,4,8 (default 1..64)")
    p.add_argument("--probe-tokens", type=int, default=None,
                   help="largest B*s (per-GPU tokens) probed per micro-batch (default: the largest shape's s)")
    p.add_argument("--probe-budget", action=argparse.BooleanOptionalAction, default=True,
                   help="after the fit, run one micro-batch at the extrapolated budget when time allows (an OOM "
                        "there lowers the budget)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point after one warm-up (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin-dual", action="store_true",
                   help="write the dual (p, m_comp) fitted over the calibrated range into the profile's dual: "
                        "section (default: only report it under fit:, and the planner derives it per dataset)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    p.add_argument("--json", help="also write the raw measurements here (JSON)")
    # --estimate
    p.add_argument("--peak-tflops", type=float, default=989.0, help="--estimate: per-GPU peak (H200 bf16 dense)")
    p.add_argument("--mfu", type=float, default=0.5,
                   help="--estimate: achieved fraction of the peak (one 1.3B block reached 0.47-0.52 for S >= 7800)")
    p.add_argument("--device-memory-gib", type=float, default=141.0, help="--estimate: device memory (H200: 141)")
    p.add_argument("--link-gbs", type=float, default=200.0,
                   help="effective per-GPU link bandwidth GB/s for ZeRO-3 gathers and the Ulysses all-to-all "
                        "(--estimate, and measured runs on one GPU for a config with sequence_parallel_size > 1)")


def run(args) -> int:
    from ds_adaptiveload.model import WanConfig

    cfg = WanConfig.from_yaml(args.model_config)
    ds = read_json_object(args.deepspeed_config, "DeepSpeed config")
    if not 0 < args.safety <= 1:
        raise UserError(f"--safety must be in (0, 1], got {args.safety}")
    shapes = parse_shapes(args.shapes, "--shapes") if args.shapes is not None else GRID_SHAPES
    heldout = parse_shapes(args.heldout, "--heldout") if args.heldout is not None else HELDOUT_SHAPES
    if not shapes:
        raise UserError("--shapes: at least one shape is needed")
    if args.estimate:
        doc = estimate_profile(cfg, ds, args)
    else:
        from ds_adaptiveload.train.config import default_alloc_conf

        default_alloc_conf()  # before the first CUDA allocation: the allocator the trainer uses
        doc = measure_profile(cfg, ds, args, shapes, heldout)
        if doc is None:  # not rank 0 of a multi-rank calibration
            return 0
    write_profile(doc, args.out)
    from ds_adaptiveload.schedule.profile import CostProfile

    prof = CostProfile.load(args.out)  # what the planner will read: must load
    print(f"wrote {args.out}: fixed {prof.fixed_ms:.2f} ms, floor {prof.floor_ms:.1f} ms, per_token {prof.per_token_ms:.4g} ms, "
          f"per_token_sq {prof.per_token_sq_ms:.4g} ms, step_fixed {prof.step_fixed_ms:.1f} ms, "
          f"budget {prof.budget_tokens} tokens"
          + (f", dual p={prof.dual_p:.3f} m_comp={prof.dual_m_comp:.4g} (pinned)" if prof.dual_p else ""))
    return 0


def parse_shapes(text, what):
    out = []
    for tok in filter(None, (t.strip() for t in text.split(","))):
        try:
            f, h, w = (int(v) for v in tok.lower().split("x"))
        except ValueError:
            raise UserError(f"{what}: {tok!r} is not FRAMESxHEIGHTxWIDTH") from None
        out.append((f, h, w))
    return out


# ----------------------------------------------------------------------------------------------------
# Pure: the grid, the schedule, the fits


@dataclass
class Point:
    B: int
    """Samples in the micro-batch."""
    shape: tuple
    """(frames, height, width) of every sample."""
    S: int
    """Full-sequence tokens of one sample."""
    s: int
    """Per-GPU tokens of one sample (ceil(S / sp))."""
    role: str = "fit"
    """fit | heldout | anchor (a large micro-batch for the memory fit, before the probe) | probe (a check of
    the memory budget). Only fit points enter the time fit; every ok point with a peak enters the memory fit."""
    status: str = "pending"
    """ok | oom | skipped (time budget) | error."""
    ms: list = field(default_factory=list)
    """Forward+backward times of the timed steps (ms)."""
    step_ms: list = field(default_factory=list)
    """Optimizer-step times (ms)."""
    peak_bytes: int = None
    """torch.cuda.max_memory_allocated over the point's steps (None on CPU)."""
    reserved_bytes: int = None
    """torch.cuda.max_memory_reserved over the point's steps: the allocator's footprint (allocated plus
    cached and fragmented blocks), reported beside the peak; not fitted."""
    note: str = ""

    @property
    def tokens(self) -> int:
        return self.B * self.s

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms) if self.ms else None


def grid_points(shapes, heldout, geometry, sp=1, batches=BATCHES, probe_tokens=None):
    """All points in measuring priority, so that a run cut short by the time budget still has a
    well-posed fit and a held-out check:

    1. B = 1 of the shortest shape, then its largest B (separates the per-micro-batch fixed cost from
       the per-token cost), then B = 1 of the longest shape (anchors the quadratic term);
    2. B = 1 of the other shapes, shortest first;
    3. B = 1 of the held-out shapes, cheapest first;
    4. the largest B of the other shapes; 5. the remaining batch sizes and held-out B > 1, cheapest first."""
    def tok(shape):
        S = geometry.tokens(*shape)
        return S, -(-S // sp)

    fit = sorted((tok(sh) + (sh,) for sh in shapes), key=lambda z: z[1])
    cap = probe_tokens or max(s for _, s, _ in fit)
    ones, bigs, rest = [], [], []
    for S, s, shape in fit:
        bs = [b for b in batches if b * s <= cap] or [batches[0]]
        ones.append(Point(bs[0], shape, S, s))
        bigs.append(Point(bs[-1], shape, S, s) if len(bs) > 1 else None)
        rest += [Point(b, shape, S, s) for b in bs[1:-1]]
    head = [ones[0]] + ([bigs[0]] if bigs[0] else []) + ([ones[-1]] if len(ones) > 1 else [])
    middle = ones[1:-1]
    held_ones = []
    for S, s, shape in sorted((tok(sh) + (sh,) for sh in heldout), key=lambda z: z[1]):
        held_ones.append(Point(1, shape, S, s, role="heldout"))
        b = max(1, min(4, cap // s))
        if b > 1:
            rest.append(Point(b, shape, S, s, role="heldout"))
    rest.sort(key=_work)
    return head + middle + held_ones + [p for p in bigs[1:] if p] + rest


def nnls(rows, y, weights=None):
    """Non-negative least squares for a handful of columns: min sum w_i^2 (rows_i . c - y_i)^2, c >= 0.

    Exact by enumeration of the active set (2^n - 1 subsets, n <= 4 here): each subset's unconstrained
    solution is kept when it is non-negative, and the best is returned. Returns the coefficient list."""
    import numpy as np

    A = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    w = np.ones(len(b)) if weights is None else np.asarray(weights, dtype=float)
    A, b = A * w[:, None], b * w
    n = A.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            c = np.zeros(n)
            c[list(cols)] = sol
            res = float(np.sum((A @ c - b) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = c, res
    return [float(v) for v in best]


def fit_time(points):
    """(fixed, per_token, per_token_sq, floor) in ms from the ok fitted points' medians, relative weighting
    (each point's error counts as a fraction of its own time, so 2 ms image steps matter as much as
    10 s clips): time = smax(floor, fixed + per_token * B*s + per_token_sq * B*s^2), see predict_ms.

    The floor: under ZeRO-3 the host gathers and releases every parameter each step, and on one H200 that
    takes ~1 s for the 1.3B model however small the micro-batch (measured 2026-11-30: 1 to 16 images,
    1,560 to 25k tokens, all 0.95-1.3 s). Host and GPU work overlap only partly, so near the knee a step
    takes longer than either (a hard max underestimated held-out shapes there); a smooth max models that.
    Floor and line are fitted jointly (_soft_fit). The floor is kept when it is above the line at 3 or more
    fitted points (else nothing measured it: noise bent the line) and it predicts the fitted points left out
    one at a time better than the plain line does (median relative error), so it is chosen on the fitted
    points alone; otherwise floor = 0 (the plain line)."""
    pts = [p for p in points if p.role == "fit" and p.status == "ok"]
    if len(pts) < 3:
        raise UserError(f"calibrate: only {len(pts)} shape(s) measured, the time fit needs 3 "
                        f"(raise --time-budget or give cheaper --shapes)")
    line = (*_line_fit(pts), 0.0)
    soft = _soft_fit(pts) if len(pts) >= 5 else None  # 4 coefficients: left-one-out needs 4 others
    if not soft or sum(soft[0] + soft[1] * p.B * p.s + soft[2] * p.B * p.s * p.s < soft[3] for p in pts) < 3:
        return line
    # 1e-6: rounding, so that exact data keeps the plain line
    return soft if _loo_median(pts, _soft_fit) + 1e-6 < _loo_median(pts, _plain_fit) else line


def predict_ms(coef, B, s):
    """Predicted fwd+bwd ms of a micro-batch of B samples of s per-GPU tokens under fit_time's model:
    (floor^q + line^q)^(1/q), q = TIME_FLOOR_Q; the plain line when floor = 0."""
    fixed, a, b, floor = coef
    return smooth_max(floor, fixed + a * B * s + b * B * s * s, TIME_FLOOR_Q)


def _line_fit(pts):
    """(fixed, per_token, per_token_sq): relative-weighted NNLS of the points' medians."""
    y = [p.median_ms for p in pts]
    return nnls([(1.0, p.B * p.s, p.B * p.s * p.s) for p in pts], y, [1 / v for v in y])


def _soft_fit(pts, iters=60):
    """predict_ms's coefficients minimising the squared relative errors over `pts`: Gauss-Newton on
    (fixed, a, b, floor) >= 0, each step an NNLS of the linearised model, halved until the error drops.
    The error surface has a flat valley at floor = 0 (no gradient there), so it starts from a floor at the
    smallest time and from one at the median of the lowest third of the times (the line through the
    points above it); the better end point wins."""
    y = [p.median_ms for p in pts]
    w = [1 / v for v in y]
    x = [(1.0, p.B * p.s, p.B * p.s * p.s) for p in pts]
    q = TIME_FLOOR_Q

    def sse(th):
        return sum(((predict_ms(th, p.B, p.s) - v) * wi) ** 2 for p, v, wi in zip(pts, y, w))

    starts = [(*_line_fit(pts), min(y))]
    low = sorted(y)[:max(1, len(y) // 3)]
    floor = statistics.median(low)
    above = [p for p in pts if p.median_ms > floor * TIME_FLOOR_MARGIN]
    if len(above) >= 3:
        starts.append((*_line_fit(above), floor))
    best, best_err = None, math.inf
    for th in starts:
        err = sse(th)
        for _ in range(iters):
            rows, target = [], []
            for xi, v in zip(x, y):
                line = th[0] * xi[0] + th[1] * xi[1] + th[2] * xi[2]
                g = smooth_max(th[3], line, q)
                jl = (max(line, 0.0) / g) ** (q - 1) if g > 0 else 0.0
                jf = (th[3] / g) ** (q - 1) if g > 0 else 0.0
                row = (jl * xi[0], jl * xi[1], jl * xi[2], jf)
                rows.append(row)
                target.append(v - g + sum(r * t for r, t in zip(row, th)))
            step = [n - t for n, t in zip(nnls(rows, target, w), th)]
            t = 1.0
            while t > 1e-4:
                cand = tuple(max(0.0, v + t * d) for v, d in zip(th, step))
                cand_err = sse(cand)
                if cand_err < err:
                    break
                t /= 2
            else:
                break  # no step lowers the error: converged
            converged = err - cand_err <= 1e-12 * err
            th, err = cand, cand_err
            if converged:
                break
        if err < best_err:
            best, best_err = th, err
    return best


def _plain_fit(pts):
    return (*_line_fit(pts), 0.0)


def _loo_median(pts, fit):
    """Median |relative error| of each point predicted by fit() on the others (leave-one-out)."""
    errs = []
    for i, p in enumerate(pts):
        coef = fit(pts[:i] + pts[i + 1:])
        errs.append(abs(rel_err(predict_ms(coef, p.B, p.s), p.median_ms)))
    return statistics.median(errs)


# Seconds more for a second probe after an out-of-memory one (one rank only: several cannot recover).
PROBE_RETRY_S = 25.0
# Seconds of the time budget kept for the budget probe (at most a quarter of the budget: shorter budgets still probe).
PROBE_RESERVE_S = 40.0
# The anchor probe: a micro-batch at this fraction of the budget, run before the probe when it is at least
# ANCHOR_MIN_RATIO x the grid's largest (its peak joins the memory fit), and the seconds kept for it.
ANCHOR_FRACTION, ANCHOR_MIN_RATIO, PROBE_ANCHOR_S = 0.5, 1.5, 15.0
# A time this much above the floor is on the line (the floor's own jitter stays below it).
TIME_FLOOR_MARGIN = 1.1
# Sharpness q of the smooth max between the time floor and the line (predict_ms): 2^(1/q) - 1 = 9% above
# both at the knee. Chosen on the leave-one-out error over the fitted points of the five H200 runs in
# bench/results (2026-11-29/30; mean of the runs' medians): q = 4 to 32 give 6.0-6.5%, q = 2 8.9%, the
# former hard max with a measured floor 11.8%.
TIME_FLOOR_Q = 8
# A peak this much above the smallest one is on the rising part of the memory curve.
FLOOR_MARGIN = 1.02


def fit_memory(points):
    """(fixed_bytes, bytes_per_token, floor_bytes, bytes_per_sample) from the ok points' peaks (fit and
    held-out alike): peak = max(floor, fixed + bytes_per_token * B*s + bytes_per_sample * B). Memory is linear
    in tokens with flash attention and per-block checkpointing, but it has a floor that does not grow with
    them (under ZeRO-3 on an H200 the 1.3B model peaks at 28.76 GiB for every micro-batch up to ~25k tokens:
    gathered parameters, optimizer step); a line through the floor points underestimates the slope that large
    micro-batches follow, which put the extrapolated budget at twice what fits. So the line is fitted on the
    points above the floor (the two largest micro-batches when fewer rise above it). Each sample also brings
    its text context (512 x 4096 embeddings and their projections, ~20 MB for the 1.3B model): small alone,
    but a micro-batch of 700 images is 14 GB over a tokens-only line (2026-11-30, sp = 2: the budget probe
    ran out of memory). The per-sample term is fitted when the points above the floor differ in B at 3 or
    more shapes (else it is 0). None when no peak was measured."""
    pts = [p for p in points if p.status == "ok" and p.peak_bytes]
    if len({p.tokens for p in pts}) < 2:
        return None
    floor = min(p.peak_bytes for p in pts)
    use = [p for p in pts if p.peak_bytes > floor * FLOOR_MARGIN]
    if len({p.tokens for p in use}) < 2:
        by_tokens = {}
        for p in sorted(pts, key=lambda p: p.tokens):
            by_tokens[p.tokens] = p
        use = list(by_tokens.values())[-2:]
    y = [p.peak_bytes for p in use]
    if len({p.B for p in use}) >= 2 and len({(p.B, p.s) for p in use}) >= 3:
        fixed, per_token, per_sample = nnls([(1.0, p.tokens, p.B) for p in use], y, [1 / v for v in y])
    else:
        (fixed, per_token), per_sample = nnls([(1.0, p.tokens) for p in use], y, [1 / v for v in y]), 0.0
    return fixed, per_token, float(floor), per_sample


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
    with sp_terms; the fit report is replaced by the conversion's."""
    pt, pt2, a2a = sp_terms(profile.per_token_ms, profile.per_token_sq_ms, cfg, k,
                            profile.meta.get("checkpoint_blocks", True), link_gbs)
    meta = {**profile.meta, "sp": k, "derived_from": source,
            "derivation": f"calibrate.sp_profile: calibrate.sp_terms, k = {k}, link {link_gbs} GB/s"}
    return replace(profile, per_token_ms=pt, per_token_sq_ms=pt2, meta=meta,
                   fit={"sp_from_one_gpu": {"k": k, "all_to_all_ms_per_token": a2a, "link_gbs": link_gbs}})


def train_fixed_bytes(fixed_bytes, params, measured_world, train_world, bytes_per_param=ZERO_BYTES_PER_PARAM):
    """The memory intercept holds the ZeRO-3 shards at the measuring run's world size: rescale them to the
    training run's."""
    return max(fixed_bytes - bytes_per_param * params / measured_world + bytes_per_param * params / train_world, 0.0)


def predict_peak(mem, tokens, B):
    fixed, per_token, floor, per_sample = mem
    return max(floor, fixed + per_token * tokens + per_sample * B)


def sample_tokens(mem):
    """A sample's own memory in tokens' worth (memory.sample_tokens: the planner caps B * (s + it))."""
    return mem[3] / mem[1] if mem[1] > 0 else 0.0


def budget_tokens(capacity_bytes, safety, fixed_bytes, bytes_per_token, oom_tokens=None):
    """M_mem = (capacity * safety - fixed) / bytes per token, and below the smallest micro-batch that ran
    out of memory (an observed bound beats the extrapolation)."""
    b = int((capacity_bytes * safety - fixed_bytes) / bytes_per_token) if bytes_per_token > 0 else 0
    if oom_tokens:
        b = min(b, int(oom_tokens * safety))
    if b < 1:
        raise UserError(f"calibrate: no token budget left: {capacity_bytes * safety / 2**30:.1f} GiB usable, "
                        f"{fixed_bytes / 2**30:.1f} GiB do not scale with tokens")
    return b


def probe_point(small, capacity, safety, mem, oom_tokens=None):
    """The budget probe: micro-batch `small`'s shape with as many samples as the memory fit lets this run
    hold. This run holds the ZeRO-3 shards of its own world size (more than a larger training run's), so the
    probe fills the budget at this run's fixed bytes (mem[0]), not the training run's."""
    here = budget_tokens(capacity, safety, mem[0], mem[1], oom_tokens)
    return Point(max(1, int(here // (small.s + sample_tokens(mem)))), small.shape, small.S, small.s, role="probe")


def budget_probes(small, points, capacity, safety, step_fn, clock, deadline, pred_s, oom_types=(), retry=True,
                  before=None, anchor=ANCHOR_FRACTION):
    """Check the extrapolated memory budget with micro-batches of `small`'s shape, appended to `points` as they
    run (one step each, no warm-up: a first step peaks at least as high as later ones).

    The grid's largest micro-batch holds ~1/7 of the budget's tokens (the 1.3B model on an H200), so the
    memory line is extrapolated 7x. First an anchor at `anchor` x the budget (role anchor): its peak joins
    the memory fit (fit_memory reads every ok point). Then the probe filling the refitted budget
    (probe_point). After an out-of-memory one, with `retry` (one rank: the OOM is recovered), the next
    probe fills 0.9 of what ran out, while the time budget lasts, so that the budget ends where a probe ran.
    A point is skipped when a measured one was as large, or when its predicted time (pred_s(point), seconds)
    does not fit before `deadline`. before(point) runs before each measured one. Returns them in order."""
    largest = max((p.tokens for p in points if p.status == "ok"), default=0)
    bound = min((p.tokens for p in points if p.status == "oom"), default=None)
    probes = []

    def run(p):
        probes.append(p)
        points.append(p)
        if p.tokens <= largest:
            p.status, p.note = "skipped", "not needed: a measured point was as large"
        elif clock() + 1.2 * pred_s(p) > deadline:
            p.status, p.note = "skipped", f"time budget (needs ~{pred_s(p):.0f} s)"
        else:
            mem = fit_memory(points)
            if before:
                before(p)
            _measure_point(p, step_fn, clock, oom_types, repeats=1, big_s=0.0, warmup=0)
            if mem:
                p.note = ((p.note + "; " if p.note else "")
                          + f"predicted peak {predict_peak(mem, p.tokens, p.B) / 2**30:.1f} GiB before it ran")
        return p.status

    # An out-of-memory point adds no peak, so the fit that sized a probe is also the one its bound uses.
    mem = fit_memory(points)
    first = probe_point(small, capacity, safety, mem, bound)
    if anchor and first.tokens * anchor >= ANCHOR_MIN_RATIO * largest:
        a = replace(first, B=max(1, int(first.B * anchor)), role="anchor", ms=[], step_ms=[])
        if run(a) == "oom":
            if not retry:
                return probes
            bound = a.tokens + a.B * sample_tokens(mem)
    last_oom = None
    while True:
        mem = fit_memory(points)  # with the anchor's peak once it ran
        p = probe_point(small, capacity, safety, mem, bound)
        if last_oom and p.B >= last_oom.B:  # nothing smaller to try
            break
        if run(p) != "oom" or not retry:
            break
        last_oom = p
        bound = p.tokens + p.B * sample_tokens(mem)
    return probes


def budget_after_oom(capacity, safety, mem, train_fixed, p):
    """The training run's budget once micro-batch p ran out of memory in this run: `safety` x what p held
    (its tokens plus its samples' own), the size the next probe tries, plus the ZeRO-3 shards this run
    holds beyond the training run's, in tokens' worth (exact bytes: no safety on them). With safety 1: the
    budget up to what a probe that ran held."""
    here = int(safety * (p.tokens + p.B * sample_tokens(mem)))
    return min(budget_tokens(capacity, safety, train_fixed, mem[1]), here + int((mem[0] - train_fixed) / mem[1]))


def rel_err(pred, meas):
    return (pred - meas) / meas


def time_schedule(points, step_fn, budget_s, clock=time.monotonic, oom_types=(), repeats=3, big_s=5.0,
                  on_point=None, deadline=None, first_warmup=2, mem_limit=None):
    """Measure `points` in order with step_fn(point) -> (fwd_bwd_ms, step_ms, peak_bytes or None).

    One warm-up call (`first_warmup` for the first point: the process's first steps are slow) then
    `repeats` timed calls per point (1 when the warm-up alone took over `big_s`:
    such steps are long enough to be stable and would eat the budget). A point whose predicted cost no
    longer fits the remaining budget is skipped, once 3 fitted points (what a fit needs) are measured. An
    exception in `oom_types` marks the point oom (the
    caller's step_fn cleans up), and larger micro-batches of the same per-GPU sequence are then skipped
    as certain to fail. With `mem_limit` (bytes; several ranks, where an OOM cannot be recovered) a point
    whose peak the memory fit of the points so far puts above it is skipped instead of run."""
    deadline = deadline if deadline is not None else clock() + budget_s
    seen = []  # (work proxy, seconds per call) of the points measured so far
    oom_at = {}  # s -> smallest B*s that ran out of memory
    warm = first_warmup
    for p in points:
        if p.s in oom_at and p.tokens >= oom_at[p.s]:
            p.status, p.note = "skipped", f"a micro-batch of {oom_at[p.s]} tokens at this s ran out of memory"
        elif (sum(q.status == "ok" and q.role == "fit" for q in points) >= 3
              and clock() + _point_s(seen, _work(p), repeats, big_s) > deadline):
            p.status, p.note = "skipped", "time budget"
        elif mem_limit and (mem := fit_memory(points)) and (peak := predict_peak(mem, p.tokens, p.B)) > mem_limit:
            p.status = "skipped"
            p.note = (f"predicted peak {peak / 2**30:.1f} GiB over the "
                      f"{mem_limit / 2**30:.1f} GiB limit of a multi-rank run")
        else:
            _measure_point(p, step_fn, clock, oom_types, repeats, big_s, warm)
            warm = 1
            if p.status == "oom":
                oom_at[p.s] = min(oom_at.get(p.s, p.tokens), p.tokens)
            elif p.status == "ok":
                seen.append((_work(p), p.median_ms / 1000))
        if on_point:
            on_point(p)
    return points


def _point_s(seen, work, repeats, big_s, safety=1.2):
    """Seconds a point of `work` will take: its warm-up plus `repeats` timed calls (one when a call takes
    over big_s, as _measure_point does). A call is predicted by a non-negative fit a + b * work over the
    points so far (a large fixed cost, as under ZeRO-3, would make a seconds-per-work ratio of the smallest
    point overestimate every larger one), with a safety margin; the largest ratio while the fit is
    unidentified."""
    if len({w for w, _ in seen}) < 2:
        call = safety * max(t / w for w, t in seen) * work
    else:
        a, b = nnls([[1.0, w] for w, _ in seen], [t for _, t in seen])
        call = safety * (a + b * work)
    return call * (1 + (1 if call > big_s else repeats))


def _work(p):
    """A cost proxy for scheduling before any fit exists: linear work plus attention at ~8k-token scale."""
    return p.B * (p.s + p.s * p.s / 8192) + 2000


def _measure_point(p, step_fn, clock, oom_types, repeats, big_s, warmup=1):
    try:
        peaks = []
        t0 = clock()
        reserved = []
        for _ in range(warmup):  # allocator, kernels' first use, Adam state on the first step
            t0 = clock()
            peaks.append(step_fn(p)[2])
            reserved.append(getattr(step_fn, "reserved", None))
        n = 1 if warmup and clock() - t0 > big_s else repeats
        for _ in range(n):
            fb, st, peak = step_fn(p)
            p.ms.append(fb)
            p.step_ms.append(st)
            peaks.append(peak)
            reserved.append(getattr(step_fn, "reserved", None))
        peaks, reserved = [v for v in peaks if v], [v for v in reserved if v]
        p.peak_bytes = max(peaks) if peaks else None
        p.reserved_bytes = max(reserved) if reserved else None
        p.status = "ok"
    except oom_types as e:
        # The allocator's message says how much was allocated and how much reserved but free (fragmentation).
        p.status, p.note = "oom", str(e).splitlines()[0][:600] if str(e) else "out of memory"
        p.ms, p.step_ms = [], []


def report(points, coef, mem, capacity=None):
    """Per-point rows: measured, predicted and relative error of time (and memory when measured)."""
    rows = []
    for p in points:
        r = {"role": p.role, "status": p.status, "B": p.B, "shape": "x".join(map(str, p.shape)), "S": p.S,
             "s": p.s}
        if p.status == "ok":
            pred = predict_ms(coef, p.B, p.s)
            r.update(ms=round(p.median_ms, 3), pred_ms=round(pred, 3), err=round(rel_err(pred, p.median_ms), 4),
                     step_ms=round(statistics.median(p.step_ms), 3), n=len(p.ms))
            if p.peak_bytes:
                r["peak_gib"] = round(p.peak_bytes / 2**30, 3)
                if p.reserved_bytes:
                    r["reserved_gib"] = round(p.reserved_bytes / 2**30, 3)
                if capacity:
                    r["peak_frac"] = round(p.peak_bytes / capacity, 4)
                if mem:
                    pm = predict_peak(mem, p.tokens, p.B)
                    r.update(pred_gib=round(pm / 2**30, 3), mem_err=round(rel_err(pm, p.peak_bytes), 4))
        if p.note:
            r["note"] = p.note
        rows.append(r)
    return rows


def err_summary(rows, role, key="err"):
    errs = [abs(r[key]) for r in rows if r["role"] == role and key in r]
    if not errs:
        return None
    return {"n": len(errs), "median_abs_rel_err": round(statistics.median(errs), 4),
            "worst_abs_rel_err": round(max(errs), 4)}


def dual_report(profile, dual, sizes):
    """How well the paper's B * s^p <= M_comp tracks the time model's equal-compute batch
    B_time(s) = T / sample_ms(s), T as in profile.derive_dual, at the measured sizes."""
    p, m_comp = dual
    s_hi = max(sizes)
    target = max(profile.sample_ms(s_hi), profile.per_token_ms * profile.budget_tokens)
    out = []
    for s in sorted(set(sizes)):
        b_time = target / profile.sample_ms(s)
        b_dual = m_comp / s ** p
        out.append({"s": s, "B_time": round(b_time, 3), "B_dual": round(b_dual, 3),
                    "err": round(rel_err(b_dual, b_time), 4)})
    return out


# ----------------------------------------------------------------------------------------------------
# Profile documents


def profile_doc(geometry, coef, step_fixed, mem, capacity, safety, budget, meta, fit, dual_range=None,
                dual_sizes=None, pin_dual=False):
    from ds_adaptiveload.schedule.profile import CostProfile, derive_dual

    doc = {
        "geometry": {"vae_stride": list(geometry.vae_stride), "patch_size": list(geometry.patch_size)},
        "time_ms": {"fixed": _r(coef[0]), "per_token": _r(coef[1]), "per_token_sq": _r(coef[2]),
                    "step_fixed": _r(step_fixed),
                    **({"floor": _r(coef[3]), "floor_q": TIME_FLOOR_Q} if len(coef) > 3 and coef[3] else {})},
        "memory": {"budget_tokens": int(budget), "safety": safety},
    }
    if mem:
        doc["memory"].update(fixed_bytes=int(mem[0]), bytes_per_token=_r(mem[1]))
        if len(mem) > 2 and mem[2]:
            doc["memory"].update(bytes_per_sample=_r(mem[2]), sample_tokens=_r(mem[2] / mem[1]))
    if capacity:
        doc["memory"]["capacity_bytes"] = int(capacity)
    prof = CostProfile.from_dict(doc)  # validates
    if dual_range:
        # The paper's B * s^p <= M_comp over the calibrated range (profile.derive_dual's convention). Pinned
        # in `dual:` only on request: without it the planner derives it for each dataset's own range.
        p, m_comp = derive_dual(prof, *dual_range)
        fit = {**fit, "dual": {"p": _r(p), "m_comp": _r(m_comp), "s_range": list(dual_range),
                               "vs_time_model": dual_report(prof, (p, m_comp), dual_sizes or dual_range)}}
        if pin_dual:
            doc["dual"] = {"p": _r(p), "m_comp": _r(m_comp)}
            prof = CostProfile.from_dict(doc)
    doc["meta"] = meta
    doc["fit"] = fit
    return doc, prof


def _r(v, digits=5):
    """Round to `digits` significant digits (keeps the YAML readable)."""
    return float(f"{v:.{digits}g}") if v else 0.0


def write_profile(doc, path):
    """The profile YAML, under a comment header that says how it was made and how to read it."""
    import yaml

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(_header(doc))
        yaml.safe_dump(doc, f, sort_keys=False, default_flow_style=None, width=120)


def _header(doc):
    m = doc.get("meta", {})
    how = ("ESTIMATED from model FLOPs and memory arithmetic (no measurement)" if m.get("estimated")
           else f"measured on {m.get('device', '?')}")
    return (f"# Cost profile written by `python -m ds_adaptiveload calibrate` ({m.get('date', '')}), {how}.\n"
            f"# Model {m.get('model_config', '?')}, DeepSpeed config {m.get('deepspeed_config', '?')}.\n"
            "# time_ms: forward+backward of one micro-batch of B samples of s per-GPU tokens\n"
            "#   = (floor^q + line^q)^(1/q), line = fixed + per_token * B*s + per_token_sq * B*s^2,\n"
            "#   q = floor_q (none: the hard max);\n"
            "#   step_fixed once per optimizer step.\n"
            "# memory.budget_tokens = (capacity_bytes * safety - fixed_bytes) / bytes_per_token; a micro-batch holds\n"
            "#   B * (s + sample_tokens) <= budget_tokens (sample_tokens = bytes_per_sample / bytes_per_token).\n"
            "# dual: B * s^p <= m_comp, derived from the time model (profile.derive_dual). fit: per-point errors.\n")


def _meta_common(cfg, ds, args, sp, world):
    import importlib.metadata as md

    def ver(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    zero = ds.get("zero_optimization", {}).get("stage", 0)
    dtype = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"
    return {"model_config": args.model_config, "model": {"dim": cfg.dim, "ffn_dim": cfg.ffn_dim,
            "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "params": cfg.num_params()},
            "deepspeed_config": args.deepspeed_config, "zero_stage": zero, "dtype": dtype, "sp": sp,
            "world_size": world, "checkpoint_blocks": bool(args.checkpoint_blocks),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": ver("torch"), "deepspeed": ver("deepspeed"), "python": sys.version.split()[0],
            "ln_modulate": os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE", "auto")}


# ----------------------------------------------------------------------------------------------------
# --estimate


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
    from ds_adaptiveload.schedule.geometry import Geometry

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
    meta = {**_meta_common(cfg, ds, args, sp, world), "estimated": True, "device": "estimate",
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
    doc, _ = profile_doc(geo, (fixed, per_token, per_token_sq), step_fixed, (fixed_bytes, bpt), capacity,
                         args.safety, budget, meta, fit, dual_range=(min(sizes), max(sizes)), dual_sizes=sizes,
                         pin_dual=args.pin_dual)
    return doc


# ----------------------------------------------------------------------------------------------------
# Measured mode (torch + DeepSpeed)


def measure_profile(cfg, ds, args, shapes, heldout):
    t_start = time.monotonic()
    import torch

    from ds_adaptiveload.schedule.geometry import Geometry

    engine, dims, seq_shard, device, dtype = _init_engine(cfg, ds, args)
    init_s = time.monotonic() - t_start
    multi = dims.world > 1
    clock = _Clock(t_start, device if multi else None)
    deadline = args.time_budget  # on clock(): seconds since start, the same on every rank
    geometry = Geometry(patch_size=cfg.patch_size)
    ds_sp = int(ds.get("sequence_parallel_size", 1))
    # One GPU for a config with k > 1: measure full sequences, convert to per-GPU terms (see below).
    emulate_sp = ds_sp if dims.sp == 1 and ds_sp > 1 else 1
    try:
        for sh in list(shapes) + list(heldout):
            geometry.check(*sh)
    except ValueError as e:
        raise UserError(f"--shapes/--heldout: {e}") from None
    points = grid_points(shapes, heldout, geometry, sp=dims.sp,
                         batches=_batches(args.batches), probe_tokens=args.probe_tokens)
    oom_types = (torch.cuda.OutOfMemoryError,) if device.type == "cuda" else ()
    # Several ranks: every step's times and peak are the maximum over ranks (the collectives make the
    # slowest rank the step's time), so that every rank holds the same points, fits and decisions.
    step_fn = _StepFn(engine, cfg, geometry, seq_shard, device, dtype, args.seed, dims)
    is_main = dims.rank == 0
    capacity = _capacity(device)
    from tqdm import tqdm

    bar = tqdm(total=len(points), desc="calibrate", disable=not is_main, dynamic_ncols=True)

    def on_point(p):
        bar.update(1)
        bar.set_postfix_str(f"B={p.B} S={p.S}: {p.status}"
                            + (f" {p.median_ms:.0f} ms" if p.status == "ok" else ""))

    # An OOM on one of several ranks leaves its peers inside a collective (_StepFn stops the job then): with
    # several ranks, points the memory fit puts over the budget's memory are skipped instead of tried.
    # The budget probe is one step of a micro-batch filling the memory budget (~20-25 s for the 1.3B model on
    # H200s): the grid leaves it that much time, or the probe would never run within the default budget.
    reserve = (min(PROBE_RESERVE_S + PROBE_ANCHOR_S + (0 if multi else PROBE_RETRY_S), 0.25 * deadline)
               if args.probe_budget and capacity else 0.0)
    time_schedule(points, step_fn, None, clock=clock, oom_types=oom_types, repeats=args.repeats,
                  on_point=on_point, deadline=deadline - reserve,
                  mem_limit=capacity * args.safety if multi and capacity else None)
    bar.close()
    fixed, a, b, floor = fit_time(points)
    if a <= 0 and b <= 0:
        raise UserError("calibrate: the measured times do not grow with tokens (timing noise dominates the "
                        "work): give larger --shapes or --batches")
    step_fixed = statistics.median([v for p in points if p.status == "ok" for v in p.step_ms])
    mem = fit_memory(points)
    oom_tokens = min((p.tokens for p in points if p.status == "oom"), default=None)

    # Per-GPU terms for the training run (a one-GPU measurement of a k-way SP config is converted).
    per_token, per_token_sq, a2a = sp_terms(a, b, cfg, emulate_sp, args.checkpoint_blocks, args.link_gbs)
    sp_eff = dims.sp * emulate_sp
    train_world = args.train_world_size or max(dims.world, sp_eff)
    mem_doc = None

    def memory_budget():  # from the memory fit as it stands (the probes' peaks join it)
        nonlocal mem, mem_doc, mem_note
        mem = fit_memory(points)
        fixed_bytes = train_fixed_bytes(mem[0], cfg.num_params(), dims.world, train_world)
        mem_doc = (fixed_bytes, mem[1], mem[3])
        mem_note = {"fixed_bytes_measured": int(mem[0]), "floor_bytes_measured": int(mem[2]),
                    "model": "peak = max(floor, fixed + bytes_per_token * tokens + bytes_per_sample * B)",
                    "measured_world_size": dims.world,
                    "train_world_size": train_world, "zero_bytes_per_param": ZERO_BYTES_PER_PARAM,
                    "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}
        return budget_tokens(capacity, args.safety, fixed_bytes, mem[1], oom_tokens)

    if mem and capacity:
        budget = memory_budget()
    else:
        # CPU (no peak memory): the largest micro-batch that ran is the only evidence.
        budget = max(p.tokens for p in points if p.status == "ok")
        mem_note = {"note": "no device memory statistics (CPU): budget = largest micro-batch measured"}
    meta = {**_meta_common(cfg, ds, args, sp_eff, dims.world), "estimated": False,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "train_world_size": train_world, "time_budget_s": args.time_budget,
            "ln_modulate_op": _op_state(device)}
    sizes = [-(-p.S // sp_eff) for p in points if p.status == "ok" and p.role == "fit"]  # training run's s

    def make_doc(budget):
        rows = report(points, (fixed, a, b, floor), mem, capacity)
        fit = {
            "method": "NNLS, relative weighting; medians of timed steps after one warm-up"
                      + ("; times and peaks are the maximum over ranks" if multi else ""),
            "time_coef_measured": {"fixed": fixed, "per_token": a, "per_token_sq": b, "floor": floor},
            "time_fit": err_summary(rows, "fit"),
            "time_heldout": err_summary(rows, "heldout"),
            "memory_fit": err_summary(rows, "fit", "mem_err"),
            "memory_heldout": err_summary(rows, "heldout", "mem_err"),
            "memory": mem_note,
            "oom_bound_tokens": min((p.tokens for p in points if p.status == "oom"), default=None),
            "budget_probe": "; ".join(f"{p.role} B={p.B} x s={p.s} ({p.tokens} tokens): {p.status}"
                                      for p in points if p.role in ("anchor", "probe")) or "not run",
            "points": rows,
            "init_s": round(init_s, 1),
            "elapsed_s": round(time.monotonic() - t_start, 1),
        }
        if emulate_sp > 1:
            fit["sp_from_one_gpu"] = {"k": emulate_sp, "all_to_all_ms_per_token": a2a, "link_gbs": args.link_gbs,
                                      "note": "per_token_sq x k, all-to-all added analytically (not measured)"}
        doc, prof = profile_doc(geometry, (fixed, per_token, per_token_sq, floor), step_fixed, mem_doc, capacity,
                                args.safety, budget, meta, fit, dual_range=(min(sizes), max(sizes)),
                                dual_sizes=sizes, pin_dual=args.pin_dual)
        return rows, doc, prof

    def budget_below(p, safety=args.safety):
        return budget_after_oom(capacity, safety, mem, mem_doc[0], p)

    def write_json():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "points": [asdict(p) for p in points], "fit": doc["fit"]}, f, indent=1)

    if mem and capacity and args.probe_budget:
        # Check the extrapolated budget where it matters: micro-batches of the smallest shape filling it.
        small = min((p for p in points if p.status == "ok"), key=lambda p: p.s)

        def before(probe):  # several ranks: an OOM in the probe stops the run (_StepFn), so the profile goes first
            _, doc0, _ = make_doc(budget)
            doc0["fit"]["budget_probe"] = (f"not run yet: {probe.role} B={probe.B} x s={probe.s} ({probe.tokens} "
                                           "tokens) is next; an out-of-memory there stops a multi-rank run")
            write_profile(doc0, args.out)
            print(f"wrote {args.out} before the budget probe", flush=True)

            def lower_budget(p):  # rank 0 ran out of memory in the probe: the bound goes in before the exit
                nonlocal doc
                p.status, p.note = "oom", "out of memory on rank 0; the run stopped here"
                _, doc, _ = make_doc(min(budget, budget_below(p)))
                write_profile(doc, args.out)
                write_json()
                print(f"wrote {args.out} with the budget below the probe's {p.tokens} tokens", flush=True)

            step_fn.before_exit = lower_budget

        probes = budget_probes(small, points, capacity, args.safety, step_fn, clock, deadline,
                               lambda p: (fixed + a * p.tokens + b * p.tokens * p.s + step_fixed) / 1000,
                               oom_types, retry=not multi, before=before if multi and is_main else None)
        step_fn.before_exit = None
        budget = memory_budget()  # refitted with the probes' peaks
        for p in probes:
            if p.status == "oom":
                budget = min(budget, budget_below(p))
        ran = [p for p in probes if p.role == "probe" and p.status == "ok"]
        if ran:  # no larger than what a probe ran: the rest of the budget would be extrapolated
            budget = min(budget, budget_below(ran[-1], safety=1.0))
    rows, doc, prof = make_doc(budget)
    if not is_main:
        return None
    print_report(rows, doc["fit"], prof)
    write_json()
    return doc


def _capacity(device):
    """Device memory in bytes; None on CPU (no peak memory statistics there)."""
    import torch

    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _op_state(device):
    """Which LN-modulate the measured steps ran: the fused CUDA op, or PyTorch and why."""
    if device.type != "cuda":
        return "torch (CPU)"
    if os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE") == "torch":
        return "torch (DS_ADAPTIVELOAD_LN_MODULATE=torch)"
    from ds_adaptiveload.ops import layernorm_modulate as lm

    return "cuda" if lm.load_op() is not None else f"torch (op unavailable: {lm.op_error()})"


class _Clock:
    """Seconds since start. With several ranks, the maximum over ranks: every rank then takes the same
    measure/skip decisions in the same order (a rank that skipped a point alone would hang the others
    in the next collective)."""

    def __init__(self, t_start, device=None):
        self.t_start, self.device = t_start, device

    def __call__(self):
        t = time.monotonic() - self.t_start
        if self.device is None:
            return t
        import torch
        import torch.distributed as dist

        v = torch.tensor([t], dtype=torch.float64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v)


def _batches(text):
    if not text:
        return BATCHES
    try:
        out = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--batches: {text!r} is not a comma-separated list of integers") from None
    if not out or out[0] < 1:
        raise UserError(f"--batches: sizes must be >= 1, got {text!r}")
    return out


def _init_engine(cfg, ds, args):
    """deepspeed.initialize exactly as launch/train_wan.py does; a single process needs no launcher."""
    import torch
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from ds_adaptiveload.model import WanModel
    from ds_adaptiveload.train import config as tconfig, sp as tsp

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(29600 + os.getpid() % 300))):
        os.environ.setdefault(k, v)
    accel = get_accelerator()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if accel.device_name() == "cpu":
        device = torch.device("cpu")
        # Ranks share the host's cores (as launch/train_wan.py): not one thread per core each.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    else:
        accel.set_device(local_rank)
        device = torch.device(accel.device_name(local_rank))
    ds = json.loads(json.dumps(ds))
    ds.pop("adaptive_load", None)
    # Calibrate on the JSON's sequence_parallel_size only when launched on enough ranks for it.
    k = int(ds.get("sequence_parallel_size", 1))
    if world % k:
        k = 1
    if k == 1:
        ds.pop("sequence_parallel_size", None)
    dims = tsp.ParallelDims(world=world, sp=k, rank=rank)
    mpu = tsp.init_sequence_parallel(dims)
    # Every micro-batch is one optimizer step here, so fwd+bwd and the step are timed apart.
    ds["gradient_accumulation_steps"] = 1
    tconfig.ds_batch_keys(ds, dims.dp)
    ds.pop("tensorboard", None), ds.pop("csv_monitor", None), ds.pop("wandb", None)
    ds["steps_per_print"] = 10**9
    torch.manual_seed(args.seed)
    model = WanModel(cfg, checkpoint_blocks=args.checkpoint_blocks)
    with torch.no_grad():  # the zero-initialised head would make every other gradient zero
        model.head.head.weight.normal_(std=0.02)
    seq_shard = tsp.apply_ulysses(model, mpu, cfg.num_heads)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds,
                                           mpu=mpu)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    return engine, dims, seq_shard, device, dtype


class _StepFn:
    """One training step on random inputs of a point's shape: flow-matching loss (train/flow.py),
    engine.backward, engine.step. Returns (fwd+bwd ms, step ms, peak bytes).

    Several ranks (`dims.world` > 1): every rank draws the same inputs (SP peers must hold the same
    samples), and the returned times and peak are the maximum over ranks, so that every rank schedules and
    fits on the same numbers. An out-of-memory error there is not recoverable (the peers wait inside a
    collective the failed rank will not join): the rank says so and exits, and the launcher stops the
    others, instead of the job hanging until its timeout."""

    def __init__(self, engine, cfg, geometry, seq_shard, device, dtype, seed, dims=None):
        from deepspeed.accelerator import get_accelerator

        self.engine, self.cfg, self.geo, self.seq_shard = engine, cfg, geometry, seq_shard
        self.device, self.dtype, self.seed = device, dtype, seed
        self.world = dims.world if dims is not None else 1
        self.rank = dims.rank if dims is not None else 0
        self.accel = get_accelerator()
        self.calls = 0
        self.reserved = None  # max_memory_reserved of the last step (max over ranks), read by _measure_point
        self.before_exit = None  # several ranks: called with the point before an out-of-memory exit

    def __call__(self, p):
        import torch

        from ds_adaptiveload.train import flow

        cuda = self.device.type == "cuda"
        try:
            lat = self.geo.latent_shape(*p.shape)
            g = torch.Generator(device=self.device).manual_seed(self.seed + self.calls)
            x0 = torch.randn(p.B, 16, *lat, generator=g, device=self.device).to(self.dtype)
            text = torch.randn(p.B, self.cfg.text_len, self.cfg.text_dim, generator=g, device=self.device)
            text = text.to(self.dtype)
            eps, t = flow.draw_noise(x0, list(range(p.B)), self.seed, self.calls, 5.0)
            self.calls += 1
            if cuda:
                if p.role in ("anchor", "probe"):  # the budget checks start from an empty cache, not the grid's
                    torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            self.accel.synchronize()
            t0 = time.perf_counter()
            loss = flow.flow_matching_loss(self.engine, x0, text, eps, t, seq_shard=self.seq_shard).mean()
            self.engine.backward(loss)
            self.accel.synchronize()
            t1 = time.perf_counter()
            self.engine.step()
            self.accel.synchronize()
            t2 = time.perf_counter()
            peak = self._peak(p)
            self.reserved = torch.cuda.max_memory_reserved(self.device) if cuda else None
        except torch.cuda.OutOfMemoryError as e:
            if self.world > 1:
                print(f"calibrate: rank {self.rank} ran out of memory at B={p.B} x s={p.s} ({p.tokens} tokens per "
                      f"GPU, role {p.role}): not recoverable with {self.world} ranks, stopping. Lower "
                      f"--probe-tokens/--batches, or --no-probe-budget. ({str(e).splitlines()[0][:200]})",
                      file=sys.stderr, flush=True)
                if self.before_exit:
                    self.before_exit(p)
                sys.stdout.flush()
                os._exit(3)
            self._recover()
            raise
        ms = ((t1 - t0) * 1000, (t2 - t1) * 1000, peak)
        if self.world > 1:
            import torch.distributed as dist

            v = torch.tensor([ms[0], ms[1], float(peak or 0), float(self.reserved or 0)], dtype=torch.float64,
                             device=self.device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            ms = (float(v[0]), float(v[1]), int(v[2]) if peak is not None else None)
            self.reserved = int(v[3]) if self.reserved is not None else None
        return ms

    def _peak(self, p):
        """This rank's peak allocated bytes over the step just run (None on CPU)."""
        import torch

        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def _recover(self):
        """After an OOM mid-step: drop gradients and cached blocks so the next point starts clean."""
        import gc

        import torch

        try:
            self.engine.zero_grad()
        except Exception:  # noqa: BLE001 - best effort; the point is already recorded as oom
            pass
        try:  # ZeRO-3: forget the half-finished step's parameter-fetch trace
            coord = self.engine.optimizer.parameter_offload.get_param_coordinator()
            coord.reset_step()
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        torch.cuda.empty_cache()


def print_report(rows, fit, prof):
    cols = ("role", "status", "B", "shape", "S", "s", "ms", "pred_ms", "err", "step_ms", "peak_gib", "pred_gib",
            "mem_err")
    have = [c for c in cols if any(c in r for r in rows)]
    table = [[str(r.get(c, "")) for c in have] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(have)]
    print("  ".join(c.rjust(w) for c, w in zip(have, widths)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))
    for key in ("time_fit", "time_heldout", "memory_fit", "memory_heldout"):
        v = fit.get(key)
        if v:
            print(f"{key}: median |err| {v['median_abs_rel_err']:.1%}, worst {v['worst_abs_rel_err']:.1%} "
                  f"over {v['n']} point(s)")
    if fit.get("oom_bound_tokens"):
        print(f"out of memory at {fit['oom_bound_tokens']} tokens per micro-batch (bound)")
    print(f"budget_tokens {prof.budget_tokens}; start-up {fit['init_s']} s, elapsed {fit['elapsed_s']} s")
