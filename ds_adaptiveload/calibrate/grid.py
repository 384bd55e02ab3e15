"""The measurement grid (pure, no torch): its points in measuring priority, and measuring them in that
order within the time budget, an out-of-memory point becoming a bound."""
import statistics
import time
from dataclasses import dataclass, field

from ds_adaptiveload.calibrate.fit import fit_memory, nnls, predict_peak
from ds_adaptiveload.errors import UserError

# Fitted grid: an image, then 480p clips of growing length, then 720p clips up to the longest (81 frames).
GRID_SHAPES = [(1, 480, 832), (9, 480, 832), (21, 480, 832), (45, 480, 832), (81, 480, 832),
               (49, 720, 1280), (81, 720, 1280)]
# Held out (never fitted): other shapes of the video-heavy mix (mixes.py), between and beside the grid's.
HELDOUT_SHAPES = [(1, 1024, 1024), (33, 480, 832), (17, 720, 1280), (241, 240, 416), (161, 320, 576)]
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def parse_shapes(text, what):
    out = []
    for tok in filter(None, (t.strip() for t in text.split(","))):
        try:
            f, h, w = (int(v) for v in tok.lower().split("x"))
        except ValueError:
            raise UserError(f"{what}: {tok!r} is not FRAMESxHEIGHTxWIDTH") from None
        out.append((f, h, w))
    return out


def parse_batches(text):
    if not text:
        return BATCHES
    try:
        out = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--batches: {text!r} is not a comma-separated list of integers") from None
    if not out or out[0] < 1:
        raise UserError(f"--batches: sizes must be >= 1, got {text!r}")
    return out


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
    fwd_bwd_peak_bytes: int = None
    """The peak of forward and backward alone, before the optimizer step (whose own peak is the floor of
    peak_bytes for small micro-batches): what open blocks and kept attention outputs add to (blocks.py)."""
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
            measure_point(p, step_fn, clock, oom_types, repeats, big_s, warm)
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
    over big_s, as measure_point does). A call is predicted by a non-negative fit a + b * work over the
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


def measure_point(p, step_fn, clock, oom_types, repeats, big_s, warmup=1):
    """`warmup` untimed steps, then `repeats` timed ones (one when a warm-up took over big_s): p's times,
    peak and reserved bytes, status ok; an exception in `oom_types` makes it oom (step_fn cleaned up)."""
    try:
        peaks, reserved, fwd_bwd = [], [], []
        t0 = clock()
        for _ in range(warmup):  # allocator, kernels' first use, Adam state on the first step
            t0 = clock()
            peaks.append(step_fn(p)[2])
            reserved.append(getattr(step_fn, "reserved", None))
            fwd_bwd.append(getattr(step_fn, "fwd_bwd_peak", None))
        n = 1 if warmup and clock() - t0 > big_s else repeats
        for _ in range(n):
            fb, st, peak = step_fn(p)
            p.ms.append(fb)
            p.step_ms.append(st)
            peaks.append(peak)
            reserved.append(getattr(step_fn, "reserved", None))
            fwd_bwd.append(getattr(step_fn, "fwd_bwd_peak", None))
        peaks, reserved, fwd_bwd = ([v for v in vs if v] for vs in (peaks, reserved, fwd_bwd))
        p.peak_bytes = max(peaks) if peaks else None
        p.reserved_bytes = max(reserved) if reserved else None
        p.fwd_bwd_peak_bytes = max(fwd_bwd) if fwd_bwd else None
        p.status = "ok"
    except oom_types as e:
        # The allocator's message says how much was allocated and how much reserved but free (fragmentation).
        p.status, p.note = "oom", str(e).splitlines()[0][:600] if str(e) else "out of memory"
        p.ms, p.step_ms = [], []

