"""The packed policy's step: its samples packed by LPT into R*G slots, the slots cut into rounds of R and each
round evened out (trades between slots, samples given back to the next step, gaps filled with sand). Pure Python,
no torch."""
import bisect
import heapq
import math

# Slots the LPT tries (cheapest first) before it defers a sample that fits none of them to the next step.
TRIES = 8
# A slot this close (relative) to its round's mean (evening) or costliest slot (gap filling) is left alone.
EVEN_TOL = 1e-3
# A light slot below this fraction of its round's costliest is filled anew (_densify). With runs by
# token count, at one clip per micro-batch 0.5 left 0.0060% idle (video-heavy, 8 ranks, G = 1), 0.7 0.0043%.
DENSE_BELOW = 0.7


def sample_cols(ctx):
    """(cost, memory, compute) per sample: the columns a step sums; without a compute cap memory stands in for it."""
    return [ctx.cost, ctx.mem, ctx.comp if ctx.dual else ctx.mem]


class Slots:
    """One step's R*G slots: samples, summed line cost, memory and compute (the compute column repeats memory
    without a cap, so one check serves both)."""

    def __init__(self, ctx, n):
        self.cost, self.mem, self.comp = sample_cols(ctx)
        self.ctx = ctx
        self.limit = ctx.budget
        self.limit_c = ctx.dual[1] * (1 + 1e-9) if ctx.dual else self.limit
        self.samples = [[] for _ in range(n)]
        self.load, self.used, self.used_c = [0.0] * n, [0.0] * n, [0.0] * n

    def room(self, k, i):
        return (not self.samples[k] or self.used[k] + self.mem[i] <= self.limit
                and self.used_c[k] + self.comp[i] <= self.limit_c)

    def add(self, k, i, sign=1):
        (self.samples[k].append if sign > 0 else self.samples[k].remove)(i)
        self.load[k] += sign * self.cost[i]
        self.used[k] += sign * self.mem[i]
        self.used_c[k] += sign * self.comp[i]


def pack_step(cand, ctx, slots):
    """LPT: costliest sample first into the cheapest slot that has room (memory, compute cap). Returns the
    slots and the samples none of the TRIES cheapest slots had room for."""
    sl = Slots(ctx, slots)
    heap = [(0.0, k) for k in range(slots)]
    deferred = []
    cost, mem, comp, samples, used, used_c = sl.cost, sl.mem, sl.comp, sl.samples, sl.used, sl.used_c
    limit, limit_c = sl.limit, sl.limit_c
    replace = heapq.heapreplace
    fail_m = fail_c = math.inf  # memory and compute of the last sample that fit none of the TRIES cheapest slots
    for i in sorted(cand, key=cost.__getitem__, reverse=True):
        m, c = mem[i], comp[i]  # read once: the columns are a million long, read at random places
        if m >= fail_m and c >= fail_c:
            # Nothing was placed since that sample failed, so the same slots are the cheapest and have no more
            # room: this one fails them too (at one clip per micro-batch, most of the packing time went here).
            deferred.append(i)
            continue
        load, k = heap[0]
        # the common case, inline (the hot loop): the cheapest slot has room
        if not samples[k] or used[k] + m <= limit and used_c[k] + c <= limit_c:
            replace(heap, (load + cost[i], k))
            samples[k].append(i)
            used[k] += m
            used_c[k] += c
            fail_m = fail_c = math.inf
            continue
        tried, k = [], None
        while heap and len(tried) < TRIES:
            load, j = heapq.heappop(heap)
            if sl.room(j, i):
                k, load = j, load + cost[i]
            tried.append((load, j))
            if k is not None:
                break
        for item in tried:
            heapq.heappush(heap, item)
        if k is None:
            deferred.append(i)
            fail_m, fail_c = m, c
            continue
        sl.add(k, i)
        fail_m = fail_c = math.inf
    sl.load = [0.0] * slots  # the heap held the loads
    for load, k in heap:
        sl.load[k] = load
    return sl, deferred


def step_rounds(sl, ctx, r, draw, carry, replicate=False):
    """Slots sorted by cost, cut into rounds of R (the slots of one cost level), each round evened out
    (even_round, _shed into `carry` while the stream lasts, _fill_gaps); a round's costliest slot goes to the
    least-loaded rank so far (even rank totals too). With `replicate` nothing is shed: a sample given back
    lands alone in the next step, whose rounds its runs would otherwise make exact."""
    order = sorted((k for k in range(len(sl.samples)) if sl.samples[k]), key=sl.load.__getitem__, reverse=True)
    step = [[] for _ in range(r)]
    total = [0.0] * r
    shape = ctx.shape
    for j in range(0, len(order), r):
        rd = order[j:j + r]
        even_round(rd, sl, ctx)
        if not draw.done():  # a sample given back must have a next step to go to
            if not replicate:
                _shed(rd, sl, ctx.shape, carry)
            # heavy_mix: a heavy round's light slots are there to hold the data's other samples; filling them anew
            # with the costliest light samples ahead would take back the composition the user chose idle for
            if not (ctx.cfg.heavy_mix and _holds_heavy(rd, sl, draw.heavy)):
                _densify(rd, sl, draw.heavy, carry)
        _fill_gaps(rd, sl, draw)
        ranks = sorted(range(r), key=total.__getitem__)
        for rank, k in zip(ranks, sorted(rd, key=sl.load.__getitem__, reverse=True)):
            mb = sl.samples[k]
            if len(mb) > 1:  # (most micro-batches hold one sample where memory holds one clip)
                mb.sort(key=shape.__getitem__)  # stable: samples of one shape contiguous, in placement order
            step[rank].append(mb)
            total[rank] += sl.load[k]
    return step


def even_round(rd, sl, ctx, passes=8, scan=4, tol=None):
    """Local improvement of one round: in each pass every slot above the mean, costliest first, trades with
    one of the `scan` cheapest slots not yet traded with, taking the move of one sample or the swap of two
    that best halves their gap within memory and the compute cap. A round costs its costliest slot; slots
    within `tol` of the mean are left alone. Few samples per slot (small budgets) are where LPT leaves gaps."""
    load, tol = sl.load, EVEN_TOL if tol is None else tol
    memo = _TradeMemo()
    for _ in range(passes):
        mean = sum(map(load.__getitem__, rd)) / len(rd)
        light = sorted(rd, key=load.__getitem__)
        heavy = [k for k in reversed(light) if load[k] > mean * (1 + tol)]
        light = [k for k in light if load[k] < mean]
        improved = False
        for a in heavy:
            act = _first_trade(sl, a, light[:scan], ctx.shape, memo)
            if act is not None:
                b, x, y = act
                sl.add(a, x, -1)
                sl.add(b, x)
                if y is not None:
                    sl.add(b, y, -1)
                    sl.add(a, y)
                memo.changed(a, b)
                light.remove(b)
                improved = True
        if not improved:
            return


class _TradeMemo:
    """What _first_trade knows from earlier passes of one round: each slot's samples to try and by cost (_trade_xs,
    _sorted_reps) and the pairs of slots found to have no trade, both as of a version of the slots that a trade moves
    on. A search depends only on the two slots, so while neither has traded its answer stands (most searches of the
    later passes are such repeats)."""

    def __init__(self):
        self.version, self.views, self.none = {}, {}, {}

    def changed(self, *slots):
        for k in slots:
            self.version[k] = self.version.get(k, 0) + 1

    def view(self, build, sl, k, shape, v):
        """build(sl, k, shape) (_trade_xs or _sorted_reps) of slot k at version v, kept until slot k trades."""
        hit = self.views.get((build, k))
        if hit is None or hit[0] != v:
            hit = self.views[build, k] = (v, build(sl, k, shape))
        return hit[1]


def _shed(rd, sl, shape, out, tol=None):
    """Slots of a round above its mean (by more than `tol`) give samples back (to `out`, the next step) until
    they are not: each time the cheapest sample that covers the excess, else the costliest. A cost-dense
    slot (a long clip with its company) then no longer sets the round's pace; moving the sample within the
    step is what even_round tried, and memory is what stopped it."""
    load, cost, tol = sl.load, sl.cost, EVEN_TOL if tol is None else tol
    level = sum(load[k] for k in rd) / len(rd) * (1 + tol)
    for k in rd:
        while load[k] > level and len(sl.samples[k]) > 1:
            excess = load[k] - level
            xs = {shape[i]: i for i in sl.samples[k]}.values()
            cover = [i for i in xs if cost[i] >= excess]
            x = min(cover, key=cost.__getitem__) if cover else max(xs, key=cost.__getitem__)
            sl.add(k, x, -1)
            out.append(x)


def _holds_heavy(rd, sl, heavy):
    return any(heavy[i] for k in rd for i in sl.samples[k])


def _densify(rd, sl, heavy, out):
    """Slots of a round below DENSE_BELOW of its costliest, holding two or more samples and none heavy, give
    all but their costliest sample back (to `out`, the next step), so that _fill_gaps fills them anew from the
    stream ahead, costliest first. Memory full of small samples caps a slot's cost well below one of few large
    ones: beside a round of 720p clips, seven small samples made 4.3 s where two or three larger ones make 6-7 s."""
    top, cost = max(sl.load[k] for k in rd), sl.cost
    for k in rd:
        mb = sl.samples[k]
        if sl.load[k] < DENSE_BELOW * top and len(mb) > 1 and not any(heavy[i] for i in mb):
            keep = max(mb, key=cost.__getitem__)
            for i in [i for i in mb if i != keep]:
                sl.add(k, i, -1)
                out.append(i)


def _fill_gaps(rd, sl, draw, tol=None):
    """Slots of a round more than `tol` below its costliest take light samples from just ahead in the
    stream (draw.sand), costliest that fits first, until their gap is below tol or nothing fits."""
    top, tol = max(sl.load[k] for k in rd), EVEN_TOL if tol is None else tol
    for k in rd:
        while top - sl.load[k] > tol * top:
            i = draw.sand(top - sl.load[k], sl, k)
            if i is None:
                break
            sl.add(k, i)


def _first_trade(sl, a, bs, shape, memo):
    """(b, x, y): the first slot b of `bs` that has a trade with a: the move of x from a to b (y None), or the swap
    of x for y from b, that brings the pair's costs closest, if it lowers the costlier; or None. One sample per
    distinct shape is tried (samples of one shape are interchangeable). `memo`: a _TradeMemo of the round."""
    xs = None
    version, none = memo.version, memo.none  # memo.none: (a, b) -> the versions at which they had no trade
    va = version.get(a, 0)
    for b in bs:
        vs = (va, version.get(b, 0))
        if none.get((a, b)) == vs:
            continue
        if xs is None:
            xs = memo.view(_trade_xs, sl, a, shape, va)
        act = _best_trade(sl, a, b, xs, memo.view(_sorted_reps, sl, b, shape, vs[1]), sl.load[a] - sl.load[b])
        if act is not None:
            return (b, *act)
        none[a, b] = vs
    return None


def _reps(sl, k, shape):
    """Slot k's samples, one per distinct shape (its last), in the order the shapes are first seen."""
    return list({shape[i]: i for i in sl.samples[k]}.values())


def _trade_xs(sl, a, shape):
    """(sample, cost, memory, compute) of slot a's _reps, in order: what _best_trade reads per sample it tries."""
    cost, mem, comp = sl.cost, sl.mem, sl.comp
    return [(x, cost[x], mem[x], comp[x]) for x in _reps(sl, a, shape)]


def _sorted_reps(sl, b, shape):
    """(costs, samples, ranks) of slot b's _reps by (cost, rank), where rank is the sample's place among them in
    first-seen order (the order of the pair-by-pair search, which ties go by)."""
    ys = _reps(sl, b, shape)
    cost = sl.cost
    cy = [cost[y] for y in ys]
    order = sorted(range(len(ys)), key=cy.__getitem__)  # stable: equal costs keep their rank order
    return [cy[r] for r in order], [ys[r] for r in order], order


def _best_trade(sl, a, b, xs, reps, gap):
    """(x, y) of the best trade between a and b (_first_trade), or None: the pick of the search over every pair
    (x outer in order; y inner: none, then b's samples in order) of the first least new difference |gap - 2 d|,
    d the cost moved, with 0 < d < gap and memory (and compute) kept, if below gap. For one x the new difference
    falls, then rises, as y's cost rises, so the search walks b's samples by cost from where it turns, each way
    to the first that fits (then on past those as close, for the tie-break): about log n steps a sample of a
    where every pair took n."""
    mem, comp, used, used_c = sl.mem, sl.comp, sl.used, sl.used_c
    limit, limit_c = sl.limit, sl.limit_c
    ycost, ys, rank = reps
    n = len(ys)
    move = len(sl.samples[a]) > 1  # a slot keeps at least one sample
    ua, ub, uca, ucb = used[a], used[b], used_c[a], used_c[b]

    def fits(dm, dc):
        return ub + dm <= limit and ua - dm <= limit and ucb + dc <= limit_c and uca - dc <= limit_c

    best, best_left = None, gap - 1e-9
    lowest = ycost[0] if n else math.inf
    for x, cx, mx, kx in xs:
        # no y costs within (cx - gap, cx) (with a margin above rounding): no swap, only the move (most x; skip the
        # walk). An x no costlier than b's cheapest has none, without the bisection.
        if cx <= lowest or (k := bisect.bisect_right(ycost, cx - gap - 1e-12 * cx)) == n or ycost[k] >= cx:
            if move and 0 < cx < gap and (left := abs(gap - 2 * cx)) < best_left and fits(mx, kx):
                best, best_left = (x, None), left
            continue
        left, r_best, y_best = math.inf, n, None  # this x's least (new difference, rank); the move is rank -1
        if move and 0 < cx < gap and fits(mx, kx):
            left, r_best = abs(gap - 2 * cx), -1
        # j: the first y with gap - 2 d >= 0, where the new difference turns (near cost cx - gap / 2; exact below)
        j = bisect.bisect_left(ycost, cx - 0.5 * gap)
        while j > 0 and gap - 2 * (cx - ycost[j - 1]) >= 0:
            j -= 1
        while j < n and gap - 2 * (cx - ycost[j]) < 0:
            j += 1
        for side in (range(j - 1, -1, -1), range(j, n)):
            found = math.inf
            for idx in side:
                d = cx - ycost[idx]
                if not 0 < d < gap:
                    break  # and so is every one further on
                new = abs(gap - 2 * d)
                if new > found or new > left:
                    break
                y = ys[idx]
                if fits(mx - mem[y], kx - comp[y]):
                    found = new
                    if new < left or rank[idx] < r_best:
                        left, r_best, y_best = new, rank[idx], y
        if left < best_left:
            best, best_left = (x, y_best), left
    return best
