"""Public batching heuristics the packed policy is measured against, planned by planner.baseline_plan through
planner.plan_with (the same tail, costing and lower bound as the policies) and checked by bound.check_plan.

- lpt: runtime balance over the calibrated time model, as Seaweed-7B, slime (--balance-by-flops) and verl
  balance by predicted runtime: each step draws samples worth its R*G micro-batches' memory, in shuffled order
  (a global batch balanced as it comes) or the whole epoch sorted by cost (the plainest LPT, steps of like
  samples), and longest-processing-time first puts each into the cheapest micro-batch with room; micro-batches
  sorted by cost make the rounds. Tuned over both orders and two fills.
- trl: TRL's dynamic batching, sum of L^2 balanced across ranks under a per-rank token cap (G micro-batches
  of budget tokens): largest L^2 first to the rank with the least sum of L^2 and room, each rank's samples
  then split into G micro-batches the same way.
- buckets: an Open-Sora-style table of batch sizes per (resolution, frames): every shape gets the largest B
  whose predicted micro-batch time is at most T (at least 1, within memory), one-shape micro-batches dealt
  round-robin in shuffled order. Tuned per epoch: T is the best by predicted wall time of TABLE_TARGETS.
Every baseline draws steps at the memory fill of FILLS that predicts the least wall time (tuned the same way).
Pure Python, no torch. Not policies: bench/plan/plan_bench.py runs them beside the policies.
"""
import heapq
import math

# Fractions of a step's R*G micro-batches' memory a step draws (the rest is room for the greedy to even out).
FILLS = (0.8, 0.9, 0.97)
# The bucket table's target time T, as quantiles of the shapes' full-memory micro-batch times.
TABLE_TARGETS = (0.0, 0.25, 0.5, 0.75, 1.0)
# lpt's knobs: (epoch sorted by cost, fill).
LPT_KNOBS = ((False, 0.9), (False, 0.97), (True, 0.9), (True, 0.97))


def _draws(keep, ctx, rng, fill, by_cost=False):
    """Shuffled samples (or all by cost, costliest first) cut into steps worth `fill` of R*G micro-batches'
    memory (at least R*G samples)."""
    order = list(keep)
    rng.shuffle(order)
    if by_cost:
        order.sort(key=ctx.cost.__getitem__, reverse=True)
    slots = ctx.cfg.dp_size * ctx.cfg.grad_accum
    room = fill * slots * ctx.budget
    step, used = [], 0.0
    for i in order:
        step.append(i)
        used += ctx.mem[i]
        if used >= room and len(step) >= slots:
            yield step
            step, used = [], 0.0
    if step:
        yield step


def _greedy(items, weight, n, mem, limit):
    """Heaviest first into the lightest of n bins with memory room (else the next lightest); returns the bins
    and the items none of the 8 lightest had room for."""
    bins, used, heap, left = [[] for _ in range(n)], [0.0] * n, [(0.0, k) for k in range(n)], []
    fail = math.inf  # memory of the last item that fit none: nothing placed since, a larger one fails too
    for i in sorted(items, key=weight.__getitem__, reverse=True):
        if mem[i] >= fail:
            left.append(i)
            continue
        tried, k = [], None
        while heap and len(tried) < 8:
            load, j = heapq.heappop(heap)
            tried.append((load, j))
            if not bins[j] or used[j] + mem[i] <= limit:
                k = j
                tried[-1] = (load + weight[i], j)
                break
        for t in tried:
            heapq.heappush(heap, t)
        if k is None:
            left.append(i)
            fail = mem[i]
            continue
        bins[k].append(i)
        used[k] += mem[i]
        fail = math.inf
    return bins, left


def _split_to(mbs, n):
    """At least n non-empty micro-batches where the samples allow: the fullest gives its last sample a new one."""
    mbs = [mb for mb in mbs if mb]
    while len(mbs) < n and any(len(mb) > 1 for mb in mbs):
        mbs.append([max(mbs, key=len).pop()])
    return mbs


def _to_rounds(mbs, ctx, key):
    """A step's micro-batches, R*G where the samples allow: sorted by `key`, the g-th R of them the g-th round,
    one to each rank."""
    r = ctx.cfg.dp_size
    mbs = sorted(_split_to(mbs, r * ctx.cfg.grad_accum), key=key, reverse=True)
    step = [[] for _ in range(r)]
    for j, mb in enumerate(mbs):
        step[j % r].append(mb)
    return step


def lpt_steps(keep, ctx, rng, knob):
    by_cost, fill = knob
    steps, carry = [], []
    slots = ctx.cfg.dp_size * ctx.cfg.grad_accum
    for draw in _draws(keep, ctx, rng, fill, by_cost):
        mbs, carry = _greedy(carry + draw, ctx.cost, slots, ctx.mem, ctx.budget)
        steps.append(_to_rounds(mbs, ctx, ctx.mb_ms))
    while carry:  # what the last steps had no room for
        mbs, carry = _greedy(carry, ctx.cost, slots, ctx.mem, ctx.budget)
        steps.append(_to_rounds(mbs, ctx, ctx.mb_ms))
    return steps


def trl_steps(keep, ctx, rng, fill):
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    sq = [t * t for t in ctx.gpu]

    def l2(mb):
        return sum(sq[i] for i in mb)

    def one(items):
        ranks, left = _greedy(items, sq, r, ctx.mem, g * ctx.budget)
        rows = []
        for rk in ranks:
            part, over = _greedy(rk, sq, g, ctx.mem, ctx.budget)
            left += over
            rows.append(sorted(_split_to(part, g), key=l2, reverse=True))
        if any(len(row) != g for row in rows):  # a rank short of G samples: deal the step's micro-batches anew
            return _to_rounds([mb for row in rows for mb in row], ctx, l2), left
        return rows, left

    steps, carry = [], []
    for draw in _draws(keep, ctx, rng, fill):
        step, carry = one(carry + draw)
        steps.append(step)
    while carry:
        step, carry = one(carry)
        steps.append(step)
    return steps


def table_steps(keep, ctx, rng, q):
    """One-shape micro-batches of the table's B per shape, shuffled, R*G a step."""
    prof, by_shape = ctx.profile, {}
    for i in keep:
        by_shape.setdefault(ctx.shape[i], []).append(i)
    full = sorted(prof.micro_ms(max(1, prof.mem_batch(ctx.gpu[b[0]])), ctx.gpu[b[0]]) for b in by_shape.values())
    target = full[min(len(full) - 1, int(q * (len(full) - 1) + 0.5))]
    mbs = []
    for key in sorted(by_shape):
        b = by_shape[key]
        rng.shuffle(b)
        s, cap = ctx.gpu[b[0]], max(1, prof.mem_batch(ctx.gpu[b[0]]))
        size = max([k for k in range(1, cap + 1) if prof.micro_ms(k, s) <= target] or [1])
        mbs += [b[j:j + size] for j in range(0, len(b), size)]
    rng.shuffle(mbs)
    per = ctx.cfg.dp_size * ctx.cfg.grad_accum
    return [_to_rounds(mbs[j:j + per], ctx, lambda mb: 0) for j in range(0, len(mbs), per)]


# name -> (steps(keep, ctx, rng, knob), the knobs it is tuned over); planned with packed.PackedCtx (per-sample memory).
BASELINES = {"lpt": (lpt_steps, LPT_KNOBS), "trl": (trl_steps, FILLS), "buckets": (table_steps, TABLE_TARGETS)}
