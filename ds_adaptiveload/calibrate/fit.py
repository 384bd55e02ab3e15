"""Calibration fits (pure, no torch): the time model and its fit with leave-one-out selection of the floor,
the memory model, and the token budget they give."""
import itertools
import math
import statistics

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.profile import smooth_max
from ds_adaptiveload.schedule.zero import STATE_BYTES_PER_PARAM, ZERO_SHARDED_BYTES  # noqa: F401 (re-exported)

# ZeRO-3, bf16 + Adam: bf16 param + fp32 master + Adam m, v (+ grad) per shard; what each stage shards: schedule/zero.py
ZERO_BYTES_PER_PARAM = STATE_BYTES_PER_PARAM

# A time this much above the floor is on the line (the floor's own jitter stays below it).
TIME_FLOOR_MARGIN = 1.1

# Sharpness q of the smooth max between the time floor and the line (predict_ms): 2^(1/q) - 1 = 9% above
# both at the knee. Chosen on the leave-one-out error over the fitted points of the five H200 runs in
# bench/results (2026-11-29/30; mean of the runs' medians): q = 4 to 32 give 6.0-6.5%, q = 2 8.9%, the
# former hard max with a measured floor 11.8%.
TIME_FLOOR_Q = 8

# A peak this much above the smallest one is on the rising part of the memory curve.
FLOOR_MARGIN = 1.02


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


def rel_err(pred, meas):
    return (pred - meas) / meas


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


def predict_peak(mem, tokens, B):
    fixed, per_token, floor, per_sample = mem
    return max(floor, fixed + per_token * tokens + per_sample * B)


def sample_tokens(mem):
    """A sample's own memory in tokens' worth (memory.sample_tokens: the planner caps B * (s + it))."""
    return mem[3] / mem[1] if mem[1] > 0 else 0.0


def train_fixed_bytes(fixed_bytes, params, measured_world, train_world, bytes_per_param=ZERO_BYTES_PER_PARAM):
    """The memory intercept holds the ZeRO shards at the measuring run's world size: rescale them to the training
    run's. bytes_per_param: what is sharded (ZERO_SHARDED_BYTES of the stage; ZeRO-3's 16 by default)."""
    return max(fixed_bytes - bytes_per_param * params / measured_world + bytes_per_param * params / train_world, 0.0)


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

