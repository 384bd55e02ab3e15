"""Budget probes (pure, no torch): micro-batches at the extrapolated memory budget, one step each, that
check the budget where it matters, and the training budget an out-of-memory probe leaves."""
from dataclasses import replace

from ds_adaptiveload.calibrate.fit import budget_tokens, fit_memory, predict_peak, sample_tokens
from ds_adaptiveload.calibrate.grid import Point, measure_point

# Seconds more for a second probe after an out-of-memory one (one rank only: several cannot recover).
PROBE_RETRY_S = 25.0
# Seconds of the time budget kept for the budget probe (at most a quarter of the budget: shorter budgets still probe).
PROBE_RESERVE_S = 40.0
# The anchor probe: a micro-batch at this fraction of the budget, run before the probe when it is at least
# ANCHOR_MIN_RATIO x the grid's largest (its peak joins the memory fit), and the seconds kept for it.
ANCHOR_FRACTION, ANCHOR_MIN_RATIO, PROBE_ANCHOR_S = 0.5, 1.5, 15.0


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
            measure_point(p, step_fn, clock, oom_types, repeats=1, big_s=0.0, warmup=0)
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

