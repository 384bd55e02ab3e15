"""The balanced policy: one-shape micro-batches under both caps, every step balanced over the ranks.

Three ways, chosen by the config (balanced_steps): with G >= 2, each step draws a stratified slice of the epoch
(every shape in proportion) and packs it onto ranks by LPT, with images and short clips as the filler that evens
the totals (_balanced_mixed); under lockstep with G >= 2, rounds of equal-cost micro-batches interleaved by class
(_balanced_rounds); with G = 1 or a window, micro-batches sorted by cost within a window of steps
(_balanced_sorted). The helpers it shares with the other policies are in common.py.
Pure Python, no torch.
"""
import math
from array import array

from ds_adaptiveload.schedule.policies.common import (fill_slots, lpt_micro_batches, micro_batches, shuffled_buckets,
                                                      token_class)

# Same-shape run length (in micro-batches) of the stratified stream; measured best of 1/2/4/8 on the
# video-heavy mix at 8-1024 ranks (docs/scheduler.md).
RUN_SLOTS = 1


def balanced_steps(keep, ctx, rng):
    """The epoch's steps for the balanced policy (before the planner's epoch tail)."""
    cfg = ctx.cfg
    if cfg.lockstep and cfg.grad_accum > 1:
        return _balanced_rounds(keep, ctx, rng)
    if cfg.grad_accum == 1 or cfg.window:
        return _balanced_sorted(keep, ctx, rng)
    return _balanced_mixed(keep, ctx, rng)


# ----------------------------------------------------------------------------------------------------
# balanced, G >= 2: stratified steps packed by LPT


def _stratified_stream(indices, ctx, rng, run_slots=0):
    """Seeded epoch order in which any prefix holds every token class at close to its epoch share.

    Within a class, samples come in runs of one shape, `run_slots` micro-batches long (0: single samples),
    in shuffled order: a step then holds few distinct shapes, each with enough samples to spread over
    ranks, which is what lets the packer fill slots. Classes are interleaved by key (j + u) / n for the
    j-th sample of a class of n (u uniform): proportional, with jitter."""
    classes = {}
    # With G <= 2 a rank has too few slots to offset a sample that fills a micro-batch alone (a 720p clip)
    # with filler, so such samples come in runs of R: a step that holds one then holds about one per rank.
    heavy_run = ctx.cfg.dp_size if ctx.cfg.grad_accum <= 2 else 0
    for key, b in shuffled_buckets(indices, ctx.shape, rng):
        size = heavy_run if (heavy_run and ctx.cap[key] == 1) else max(1, run_slots * ctx.cap[key])
        runs = [b[j:j + size] for j in range(0, len(b), size)]
        classes.setdefault(token_class(ctx.full[b[0]]), []).extend(runs)
    order, keys = [], array("d")
    for c in sorted(classes):
        runs = classes[c]
        rng.shuffle(runs)
        n = sum(len(run) for run in runs)
        j = 0
        for run in runs:
            for i in run:
                order.append(i)
                keys.append((j + rng.random()) / n)
                j += 1
    # sort positions by key without building (key, index) tuples: 10M-sample epochs stay small
    return [order[p] for p in sorted(range(len(order)), key=keys.__getitem__)]


# Fill targets tried when PlanConfig.fill is None. Lower fill leaves free slots for rebalancing (less idle);
# fill 1.0 makes fewer, fuller micro-batches, which wins when the per-micro-batch fixed cost is large
# (measured under ZeRO-3: about 1.3 s per micro-batch for the 1.3B model on an H200).
FILL_CHOICES = (0.85, 1.0)
AUTO_PREFIX_STEPS = 24
AUTO_MARGIN = 0.97


def _balanced_mixed(keep, ctx, rng):
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    stream = _stratified_stream(keep, ctx, rng, run_slots=RUN_SLOTS)
    demand = _slot_demand(stream, ctx)
    fill = ctx.cfg.fill
    if fill is None:
        # Fewer, fuller steps (fill 1.0) only when they predict clearly less wall time than the default on
        # a prefix of the epoch (same samples for both): the prefix estimate is noisy within a few %.
        n = min(len(stream), math.ceil(len(stream) * AUTO_PREFIX_STEPS * r * g / max(demand, 1)))
        prefix = stream[:n]
        pd = _slot_demand(prefix, ctx)
        wall = {f: sum(ctx.step_ms(step) for step in _draw_steps(prefix, pd, f, ctx))
                for f in FILL_CHOICES}
        lo, hi = FILL_CHOICES
        fill = hi if wall[hi] < AUTO_MARGIN * wall[lo] else lo
    return _draw_steps(stream, demand, fill, ctx)


def _draw_steps(stream, demand, fill, ctx):
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    # Slot demand of the whole stream at the fill target gives the step count; spreading it evenly keeps
    # the last step from being a small remainder (which would need padding).
    n_steps = max(1, math.ceil(demand / (r * g * fill)))
    budget = min(r * g, demand / n_steps)
    steps, pos = [], 0
    while pos < len(stream):
        # Draw until the step's shapes need `budget` of its R*G slots at full micro-batches; every sample
        # drawn is placed in this step (no deferral, so steps keep the stream's composition).
        counts, used, start = {}, 0, pos
        while pos < len(stream) and (used < budget or pos - start < r * g):
            key = ctx.shape[stream[pos]]
            n = counts.get(key, 0)
            if n % ctx.cap[key] == 0:
                if used + 1 > r * g:
                    break
                used += 1
            counts[key] = n + 1
            pos += 1
        steps.append(_pack_step(stream[start:pos], ctx))
    return steps


def _slot_demand(stream, ctx):
    """Micro-batches needed if the stream were cut into steps of one shape-run each: a lower bound on slots."""
    demand, prev, n = 0, None, 0
    for i in stream:
        key = ctx.shape[i]
        if key != prev or n % ctx.cap[key] == 0:
            demand += 1
            n = 0
        prev = key
        n += 1
    return demand


def _pack_step(cand, ctx):
    """Place one step's samples on R ranks x G slots with equal loads.

    1. Full micro-batches per shape, dealt largest first to the least-loaded rank with a free slot (LPT).
    2. Rebalance: the most loaded rank hands work to a lighter one, by moving samples into a micro-batch
       of the same shape there (or into a free slot), or by swapping two micro-batches; the move chosen is
       the one that best halves the gap. Stops when the most loaded rank cannot be relieved.
    3. Split micro-batches so every rank runs exactly G (see fill_slots)."""
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    buckets = {}
    for i in cand:
        buckets.setdefault(ctx.shape[i], []).append(i)
    mbs = micro_batches(sorted(buckets.items()), ctx.cap)
    cost = ctx.cost
    mbs.sort(key=lambda mb: -len(mb) * cost[mb[0]])
    step = lpt_micro_batches(mbs, r, g, ctx, load_fn=lambda mb: len(mb) * cost[mb[0]])
    _rebalance(step, ctx, g)
    fill_slots(step, g)
    return step


def _rebalance(step, ctx, g, passes=10, scan=4, tol=2e-3):
    """Pairwise rebalancing: in each pass every rank above the mean (heaviest first) trades with the
    lightest ranks below it, taking the move or swap that best halves their gap. Idle depends only on the
    heaviest rank, so ranks within `tol` of the mean are left alone. A pass is O(R * G^2)."""
    cost = ctx.cost
    load = [sum(cost[mb[0]] * len(mb) for mb in mbs) for mbs in step]
    r = len(step)
    mean = sum(load) / r
    for _ in range(passes):
        heavy = sorted((k for k in range(r) if load[k] > mean * (1 + tol)), key=load.__getitem__, reverse=True)
        if not heavy:
            return
        light = sorted((k for k in range(r) if load[k] < mean), key=load.__getitem__)
        used = [False] * r
        improved = False
        j0 = 0
        for a in heavy:
            tried = 0
            for j in range(j0, len(light)):
                b = light[j]
                if used[b]:
                    if j == j0:
                        j0 += 1
                    continue
                if tried >= scan:
                    break
                tried += 1
                act = _best_action(step, a, b, load, ctx, g)
                if act is not None:
                    _apply(step, a, b, act, load, cost)
                    used[b] = True
                    improved = True
                    break
        if not improved:
            return


def _best_action(step, a, b, load, ctx, g):
    """The move of samples from a to b, or swap of two micro-batches, that minimises the pair's max load."""
    cost, cap, shape = ctx.cost, ctx.cap, ctx.shape
    gap = load[a] - load[b]
    best, best_new = None, load[a] - 1e-9
    on_b = {}
    for y, my in enumerate(step[b]):
        on_b.setdefault(shape[my[0]], []).append(y)
    free_b = len(step[b]) < g
    for x, mx in enumerate(step[a]):
        cx = cost[mx[0]]
        kx = shape[mx[0]]
        want = max(1, round(gap / (2 * cx)))
        # move samples of mx into a same-shape micro-batch on b (leave mx non-empty) ...
        for y in on_b.get(kx, ()):
            t = min(cap[kx] - len(step[b][y]), len(mx) - 1, want)
            if t >= 1:
                new = max(load[a] - t * cx, load[b] + t * cx)
                if new < best_new:
                    best, best_new = ("move", x, y, t), new
        # ... or into a free slot on b (mx may move whole; a then has a free slot)
        if free_b:
            t = min(cap[kx], len(mx), want)
            new = max(load[a] - t * cx, load[b] + t * cx)
            if new < best_new:
                best, best_new = ("move", x, None, t), new
        wx = cx * len(mx)
        for y, my in enumerate(step[b]):
            d = wx - cost[my[0]] * len(my)
            if 0 < d < gap:
                new = max(load[a] - d, load[b] + d)
                if new < best_new:
                    best, best_new = ("swap", x, y, d), new
    return best


def _apply(step, a, b, act, load, cost):
    kind, x, y, t = act
    if kind == "swap":
        step[a][x], step[b][y] = step[b][y], step[a][x]
        load[a] -= t
        load[b] += t
        return
    mx = step[a][x]
    moved = mx[len(mx) - t:]
    del mx[len(mx) - t:]
    if y is None:
        step[b].append(moved)
    else:
        step[b][y].extend(moved)
    if not mx:
        del step[a][x]
    w = t * cost[moved[0]]
    load[a] -= w
    load[b] += w


# ----------------------------------------------------------------------------------------------------
# balanced, G >= 2 under lockstep: rounds of equal-cost micro-batches, interleaved by class


def _balanced_rounds(keep, ctx, rng):
    """Under lockstep a step's wall time is the sum over its G rounds (the k-th micro-batch of every rank)
    of the round's slowest micro-batch: rank totals do not matter, rounds do. Within a window of the
    stratified stream (default: the epoch), full micro-batches per shape (the fewest: each pays the fixed
    per-micro-batch cost) are sorted by cost and cut into rounds of R; for a fixed set of micro-batches
    that minimises the sum of round maxima, and rounds of one shape cost exactly the same. The W*G rounds
    of a window are striped over its W steps (step j takes rounds j, j + W, j + 2W, ...: one per cost
    quantile), so every step holds expensive and cheap rounds. A smaller window keeps steps closer to the
    data's composition at the price of less even rounds."""
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    steps = []
    for mbs, rest in _sorted_windows(keep, ctx, rng):
        n = len(mbs) // (r * g)
        rounds = [mbs[j:j + r] for j in range(0, len(mbs), r)]
        order = []
        for j in rng.sample(range(n), n):  # shuffled step order: no epoch sorted by cost
            order += [rounds[j + q * n] for q in range(g)]
        order += [rest[j:j + r] for j in range(0, len(rest), r)]  # fewer than G rounds: the last step
        for s in range(0, len(order), g):
            steps.append(_deal_rounds(order[s:s + g], r, ctx))
    return steps


def _deal_rounds(rounds, r, ctx):
    """One step from its rounds: a round's heaviest micro-batch goes to the least-loaded rank so far, which
    keeps rank totals even as well (what matters when ranks do not run in lockstep)."""
    step = [[] for _ in range(r)]
    load = [0.0] * r
    for rd in rounds:
        ranks = sorted(range(r), key=load.__getitem__)
        for k, mb in zip(ranks, sorted(rd, key=ctx.mb_ms, reverse=True)):
            step[k].append(mb)
            load[k] += ctx.mb_ms(mb)
    return step


def _windows(stream, ctx):
    """Cut the stream into windows of about `window` steps of micro-batches (slot units: a sample fills
    1/cap of a micro-batch); window 0 or None: the whole stream."""
    window = ctx.cfg.window or 0
    if not window:
        return [stream]
    per_window = window * ctx.cfg.dp_size * ctx.cfg.grad_accum
    chunks, cur, used = [], [], 0.0
    for i in stream:
        cur.append(i)
        used += 1 / ctx.cap[ctx.shape[i]]
        if used >= per_window:
            chunks.append(cur)
            cur, used = [], 0.0
    if cur:
        chunks.append(cur)
    return chunks


def _sorted_windows(keep, ctx, rng):
    """Per window of the stratified stream: (its micro-batches sorted by cost, descending and in random
    order among equal costs, cut at whole steps of R*G; rest). A window's remainder (its cheapest
    micro-batches) moves on to the next window; only the epoch's last remainder comes back, as `rest`, for
    the epoch's last step (the planner's epoch tail)."""
    per_step = ctx.cfg.dp_size * ctx.cfg.grad_accum
    chunks = _windows(_stratified_stream(keep, ctx, rng), ctx)
    carry = []
    for w, chunk in enumerate(chunks):
        mbs = micro_batches(shuffled_buckets(carry + chunk, ctx.shape, rng), ctx.cap)
        rng.shuffle(mbs)
        mbs.sort(key=ctx.mb_ms, reverse=True)
        full = len(mbs) - len(mbs) % per_step
        if w == len(chunks) - 1:
            yield mbs[:full], mbs[full:]
        else:
            carry = [i for mb in mbs[full:] for i in mb]
            yield mbs[:full], []


# ----------------------------------------------------------------------------------------------------
# balanced, G == 1 (or an explicit window): steps of similar micro-batches


def _balanced_sorted(keep, ctx, rng):
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    per_step = r * g
    steps = []
    for mbs, rest in _sorted_windows(keep, ctx, rng):
        window_steps = [lpt_micro_batches(mbs[s:s + per_step], r, g, ctx) for s in range(0, len(mbs), per_step)]
        rng.shuffle(window_steps)  # no epoch sorted by length
        steps += window_steps
        if rest:
            steps.append(lpt_micro_batches(rest, r, g, ctx))
    return steps
