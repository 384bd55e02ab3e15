"""The packed policy: micro-batches that mix shapes, so that every micro-batch of a step costs about the same.

Needs the packed model (WanModel.forward on a list of latents of any shapes). A step has R*G slots (R
data-parallel ranks x G micro-batches). The epoch is a stratified stream (any stretch of it holds every token
class at its epoch share, as balanced's); a step draws the next samples worth its slots at a common target
cost T per slot, and packs them by LPT on predicted cost: costliest first, each into the cheapest slot that
still has room in memory (and under the compute cap, when the profile has one). Images and short clips come
last and even the slots out, like sand. The slots sorted by cost make the rounds (the g-th micro-batch of
every rank), so a round costs the same on every rank, which is what lockstep (ZeRO-2/3) needs; rank totals
come out even as well. Within a round, slots trade samples, the costliest gives one back to the next step,
and the cheaper ones take light samples from just ahead in the stream. A sample that costs most of a slot's
target on its own (a 720p clip when memory holds about one) is heavy: heavy samples come in runs of R of one
shape, which fill whole rounds.

When a slot holds only a few samples (memory for about one long clip), no sand is fine enough to even the
slots out. Light samples then come in runs of R of one token count too (`replicate`): LPT deals the R samples
of a run one to each slot of a round, so the slots of a round hold copies of one mix of token counts and cost
exactly the same. A slot that memory fills with small samples far below its round's cost gives all but its
costliest back and is filled anew with larger ones (_densify).

Pure Python, no torch: a function of (samples, profile, config, epoch), like the other policies.
"""
import bisect
import heapq
import math
import random
from array import array
from collections import deque
from itertools import accumulate
from dataclasses import dataclass

import numpy as np

from ds_adaptiveload.schedule.policies.common import Ctx, token_class

# Average fill of a slot's memory that sets the target cost T; the rest is room for the packing to even out
# costs (0.86 and 0.97 predicted more wall time on video-heavy with memory for one 720p clip).
PACK_FILL = 0.92
# A sample costing more than this fraction of T on its own is heavy (it cannot be evened out with sand).
HEAVY_FRAC = 0.75
# Slots the LPT tries (cheapest first) before it defers a sample that fits none of them to the next step.
TRIES = 8
# How far ahead in the stream (at least) a round's cheaper slots look for light samples to
# fill their gap (few samples per slot, i.e. small budgets, leave gaps that moves and swaps cannot close).
SAND_WINDOW = 256
# ... and at least this many steps' slots: with one clip per micro-batch a slot beside a long clip needs many
# light samples, and 2 R*G ran dry (video-heavy, 1024 ranks, G = 1: idle 0.315% -> 0.22% at 32).
SAND_SLOTS = 32
# A heavy shape's last, shorter run is placed in the stream no later than this fraction of the epoch: in the last
# steps few light samples are left to fill the slots beside it (the same case: 0.22% -> 0.15%).
REMAINDER_BEFORE = 0.9
# A slot this close (relative) to its round's mean (evening) or costliest slot (gap filling) is left alone.
EVEN_TOL = 1e-3
# A light slot below this fraction of its round's costliest is filled anew (_densify). With runs by
# token count, at one clip per micro-batch 0.5 left 0.0060% idle (video-heavy, 8 ranks, G = 1), 0.7 0.0043%.
DENSE_BELOW = 0.7
# replicate=None: light samples come in runs of R when a slot holds fewer than this many on average. At
# memory for one 720p clip (4.7 video-heavy samples a slot, 9.2 image-heavy) runs cut the predicted idle
# 0.17-0.38% -> 0.00-0.17% at 8 and 64 ranks, and the wall time with it; with 20 or more a slot the sand
# evens slots out already and runs only coarsen the steps' mix (docs/history/benchmarks.md, eighth session).
REPLICA_BELOW = 10
# _best_trade scores the pairs of a round's two slots with numpy from this many (x, y) pairs on: with memory for
# six 720p clips a slot holds ~30 shapes (900 pairs, most of the planning time in pure Python); with one clip a
# few, where numpy's per-call overhead is the larger cost.
NUMPY_PAIRS = 64
# pack_tokens "auto": the caps tried, as fractions of the memory budget, and the samples (a seeded subset) they
# are costed on. Under --checkpoint-blocks auto a full micro-batch checkpoints every block and pays its
# recompute; a smaller one leaves blocks open (docs/scheduler.md, "Micro-batch cap").
CAP_FRACS = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.13)
CAP_SAMPLES = 4096
# ... and the largest cap predicted within this fraction of the fastest is taken: fuller micro-batches mix more
# shapes, and the time model is not finer than that.
CAP_TOL = 0.01


@dataclass
class PackedCtx(Ctx):
    """Ctx for micro-batches of mixed shapes: memory and compute per sample, cost by profile.packed_ms."""

    def __post_init__(self):
        super().__post_init__()
        prof = self.profile
        mem = {g: prof.mem_tokens(g) for g in set(self.gpu)}  # per distinct length: samples are many, lengths few
        self.mem = array("d", map(mem.__getitem__, self.gpu))
        # The compute cap sum(S_i^p) <= M_comp applies only when the profile states one.
        self.dual = (prof.dual_p, prof.dual_m_comp) if prof.dual_p is not None else None
        p = self.dual[0] if self.dual else 1.0
        self.comp = array("d", map({g: g ** p for g in mem}.__getitem__, self.gpu)) if self.dual else None
        self.budget = self.profile.budget_tokens  # a micro-batch's memory, in tokens: pack_cap may lower it
        # Micro-batches repeat (a round's slots are copies under replicate, shapes are few): cost each sequence of
        # per-GPU tokens once. Keyed by the sequence, not its multiset, so the float sum is the uncached one.
        self._packed_ms = {}
        self._np_cols = None

    def np_cols(self):
        """(cost, memory, compute) of every sample as rows of one float64 array, built once, plus a row of zeros
        at index len(samples) (_best_trade_np: "nothing back" as a sample that costs nothing)."""
        if self._np_cols is None:
            self._np_cols = np.zeros((len(self.cost) + 1, 3))
            for j, col in enumerate(_cols(self)):
                self._np_cols[:-1, j] = col
        return self._np_cols

    def base_ms(self, mb):
        key = tuple(map(self.gpu.__getitem__, mb))
        t = self._packed_ms.get(key)
        if t is None:
            t = self._packed_ms[key] = self.profile.packed_ms(key)
        return t


def pack_cap(keep, ctx: PackedCtx, seed) -> int:
    """The memory a micro-batch may fill, in tokens (PlanConfig.pack_tokens): the profile's budget, the given cap
    (at most the budget), or for "auto" the cap of CAP_FRACS with the least predicted time per token (_cap_ms).
    A sample over the cap still runs, alone. A function of the samples, profile and config, not the epoch, so
    every epoch and every resume packs to the same cap."""
    budget, want = ctx.profile.budget_tokens, ctx.cfg.pack_tokens
    if want is None or (want == "auto" and not keep):
        return budget
    if want != "auto":
        return min(want, budget)
    rng = random.Random(f"{seed}/pack_tokens")
    order = rng.sample(keep, min(len(keep), CAP_SAMPLES))
    fill = ctx.cfg.fill or PACK_FILL
    caps = sorted({int(f * budget) for f in CAP_FRACS}, reverse=True)
    per_token = [_cap_ms(order, ctx, fill * c) for c in caps]
    best = min(per_token)
    return next(c for c, t in zip(caps, per_token) if t <= best * (1 + CAP_TOL))


def _cap_ms(order, ctx, limit):
    """Predicted ms per token of `order`'s samples packed in turn into micro-batches of at most `limit` memory
    tokens (a sample over it alone), each costed as the planner costs it (profile time less the recompute its
    checkpointing skips), plus a step's fixed cost per G micro-batches."""
    total, mb, used = 0.0, [], 0.0
    n_mb = 0
    for i in order:
        if mb and used + ctx.mem[i] > limit:
            total += ctx.mb_ms(mb)
            n_mb += 1
            mb, used = [], 0.0
        mb.append(i)
        used += ctx.mem[i]
    total += ctx.mb_ms(mb)
    total += ctx.profile.step_fixed_ms * (n_mb + 1) / ctx.cfg.grad_accum
    return total / max(1, sum(map(ctx.gpu.__getitem__, order)))


def packed_steps(keep, ctx: PackedCtx, rng):
    """The epoch's steps, each R rows of G micro-batches (the last step may be short: the planner's epoch tail pads)."""
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    slots = r * g
    fill = ctx.cfg.fill or PACK_FILL
    target, heavy = _target(keep, ctx, fill)
    scale = _scales(ctx, target, fill)
    light_units = _units(_sums(keep, ctx, heavy), scale)
    n_heavy = sum(1 for i in keep if heavy[i])
    replicate = ctx.cfg.replicate
    if replicate is None:
        replicate = r > 1 and len(keep) - n_heavy < REPLICA_BELOW * light_units
    stream, runs, cont = _stream(keep, ctx, rng, heavy, r, replicate)
    draw = _Drawer(stream, runs, cont, ctx, heavy, scale, slots)
    units = n_heavy + light_units
    per_step = units / max(1, math.ceil(units / slots))
    steps, carry = [], []
    while not draw.done() or carry:
        # Step s ends where the stream's cumulative slots reach (s + 1) * per_step: a step's overshoot (its
        # last sample) is taken from the next one, so the epoch does not end on a small remainder.
        cand = draw.step(carry, (len(steps) + 1) * per_step)
        sl, carry = _pack(cand, ctx, slots)
        steps.append(_rounds(sl, ctx, r, draw, carry, replicate))
    return steps


def _target(keep, ctx, fill):
    """Target cost T of a slot: the cost of `fill` of a slot's memory (and compute cap) at the data's average
    cost per token of memory, over the samples that are not heavy; and which samples are heavy at that T."""
    cost, mem = ctx.cost, ctx.mem
    heavy = bytearray(len(cost))
    t = None
    for _ in range(2):  # T over all samples, then over the light ones at that T
        light = [i for i in keep if not heavy[i]] or keep
        c = sum(map(cost.__getitem__, light))
        t = fill * ctx.budget * c / max(sum(map(mem.__getitem__, light)), 1e-12)
        if ctx.dual:
            t = min(t, fill * ctx.dual[1] * c / max(sum(map(ctx.comp.__getitem__, light)), 1e-12))
        limit = HEAVY_FRAC * t
        for i in keep:
            heavy[i] = cost[i] > limit
    return t, heavy


def _scales(ctx, target, fill):
    """Divisors turning a step's sums (cost, memory, compute) into slots; without a compute cap the third
    column repeats memory."""
    mem = fill * ctx.budget
    return [target, mem, fill * ctx.dual[1] if ctx.dual else mem]


def _cols(ctx):
    return [ctx.cost, ctx.mem, ctx.comp if ctx.dual else ctx.mem]


def _sums(indices, ctx, heavy, cols=None):
    """(cost, memory, compute) summed over the light samples of `indices`."""
    light = [i for i in indices if not heavy[i]]
    return [sum(map(col.__getitem__, light)) for col in cols or _cols(ctx)]


def _units(sums, scale):
    """Slots the light samples need: whichever of cost, memory and compute binds."""
    return max(s / d for s, d in zip(sums, scale))


def _stream(keep, ctx, rng, heavy, run, replicate=False):
    """Seeded epoch order (array of indices), {start position: length} of its heavy runs, and a bytearray
    that is 1 at the positions that continue a light run (replicate; all 0 otherwise).

    Classes are interleaved by key (j + u)/n for the j-th sample of a class of n (u uniform), so any prefix
    holds each class at its share; light samples come one by one in shuffled order (or with `replicate` in runs
    of `run` of one token count, but where counts meet), heavy ones in runs of `run` of one shape (a run keeps
    one key, so it stays contiguous)."""
    shape, full = ctx.shape, ctx.full
    buckets = {}
    for i in keep:
        buckets.setdefault(shape[i], []).append(i)
    classes, chain, heavy_chain = {}, [], []
    for key in sorted(buckets):  # sorted: the plan does not depend on the manifest order of first sight
        b = buckets[key]
        if heavy[b[0]] or replicate:
            rng.shuffle(b)
        if heavy[b[0]] or replicate:
            (heavy_chain if heavy[b[0]] else chain).append((-full[b[0]], key, b))
            continue
        classes.setdefault(token_class(full[b[0]]), []).extend(b)
    # Runs: every heavy sample (and with replicate every light one) by token count, most first, cut into runs of
    # `run`. A run then deals samples of one token count (one cost) to each slot but where one count ends and the
    # next begins, and only the last run is short; runs of one shape left a short run per shape, each a round
    # only partly heavy (a mix of 72 heavy 720p shapes at one clip per micro-batch, 64 ranks: 7.0% over the lower
    # bound, 0.5% by token count; light runs: docs/history/benchmarks.md, twenty-fourth session).
    for ch in (heavy_chain, chain):
        flat = [i for *_, b in sorted(ch) for i in b]
        for j in range(0, len(flat), run):
            classes.setdefault(token_class(full[flat[j]]), []).append(flat[j:j + run])
    items, keys = [], array("d")
    rnd = rng.random
    for c in sorted(classes):
        group = classes[c]
        rng.shuffle(group)
        sizes = [len(it) if isinstance(it, list) else 1 for it in group]
        n = sum(sizes)
        starts = range(n) if n == len(group) else accumulate(sizes, initial=0)
        items += group
        keys.extend([(j + rnd()) / n for j, _ in zip(starts, group)])
        for p, it in enumerate(group, len(items) - len(group)):  # a heavy shape's shorter, last run
            if isinstance(it, list) and heavy[it[0]] and len(it) < run:
                keys[p] = min(keys[p], REMAINDER_BEFORE)
    order, runs, cont = array("q"), {}, bytearray()
    # keys ascend within a class (but for the shorter runs moved up), so the sort merges a few sorted runs
    for p in sorted(range(len(items)), key=keys.__getitem__):
        it = items[p]
        if not isinstance(it, list):
            order.append(it)
            cont.append(0)
            continue
        if heavy[it[0]]:
            runs[len(order)] = len(it)
            cont.extend(bytes(len(it)))
        else:
            cont.extend(b"\0" + b"\1" * (len(it) - 1))
        order.extend(it)
    return order, runs, cont


class _Drawer:
    """The stream's read position, with cumulative slot sums of what has been drawn and the heavy runs that
    wait for a step with room."""

    def __init__(self, stream, runs, cont, ctx, heavy, scale, slots):
        self.stream, self.runs, self.heavy, self.scale, self.slots = stream, runs, heavy, scale, slots
        self.cont = cont  # 1 where a light run continues: the step does not end there
        self.cols = _cols(ctx)
        self.pos, self.n_heavy, self.sums, self.pending = 0, 0, [0.0] * len(self.cols), []
        self.taken = {}  # positions ahead of pos already pulled forward by sand()
        self.shape, self.ahead, self.horizon = ctx.shape, {}, 0
        first = {}
        for i in stream:
            if not heavy[i]:
                first.setdefault(ctx.shape[i], i)
        # light shapes, costliest first: (cost, memory, compute, shape)
        self.by_cost = sorted(((self.cols[0][i], self.cols[1][i], self.cols[2][i], key) for key, i in first.items()),
                              key=lambda t: -t[0])
        self.neg_cost = [-t[0] for t in self.by_cost]  # ascending: bisect finds the first shape within a gap

    def sand(self, gap, sl, k):
        """Pull forward a light sample of the costliest shape that costs at most `gap` and fits slot k
        (memory, compute cap), from the next max(SAND_WINDOW, SAND_SLOTS R*G) of the stream, or None. Counted as
        drawn now, skipped when reached. Per shape, a queue of its positions ahead: O(shapes) a call."""
        stream, ahead, pos = self.stream, self.ahead, self.pos
        end = min(len(stream), pos + max(SAND_WINDOW, SAND_SLOTS * self.slots))
        while self.horizon < end:
            p = self.horizon
            if not self.heavy[stream[p]]:
                ahead.setdefault(self.shape[stream[p]], deque()).append(p)
            self.horizon += 1
        mem_room, comp_room = sl.limit - sl.used[k], sl.limit_c - sl.used_c[k]
        by_cost = self.by_cost
        for j in range(bisect.bisect_left(self.neg_cost, -gap), len(by_cost)):
            c, m, x, key = by_cost[j]
            if m > mem_room or x > comp_room or key not in ahead:
                continue
            queue = ahead[key]
            while queue and queue[0] < pos:  # passed by the stream since
                queue.popleft()
            if queue:
                p = queue.popleft()
                i = stream[p]
                self.taken[p] = i
                for j, col in enumerate(self.cols):
                    self.sums[j] += col[i]
                return i
        return None

    def done(self):
        return self.pos >= len(self.stream) and not self.pending

    def drawn(self):
        return self.n_heavy + _units(self.sums, self.scale)

    def step(self, first, until):
        """One step's samples: `first` (deferred by the last step's packing), heavy runs that waited, then
        the stream until `until` slots are drawn in all and the step holds at least one sample per slot. A
        heavy run that would overflow the slots waits for the next step, so steps stay full; a waiting run
        is taken whole (a run cut in two leaves two rounds with some slots heavy and some light)."""
        cand = list(first)
        room = self.slots - sum(1 for i in cand if self.heavy[i])
        while self.pending:
            run = self.pending[0]
            take = min(len(run), max(room, self.slots - len(cand)))
            if take <= 0 or (take < len(run) and cand):
                break
            cand += run[:take]
            room -= take
            self.n_heavy += take
            if take < len(run):
                self.pending[0] = run[take:]
                break
            self.pending.pop(0)
        stream, end = self.stream, len(self.stream)
        while self.pos < end:
            n = self.runs.get(self.pos)
            if n is None:
                if not self._light(cand, until):
                    break  # drawn, or the stream's end
                continue
            if self.drawn() >= until and len(cand) >= self.slots:
                break
            run = stream[self.pos:self.pos + n].tolist()
            self.pos += n
            fit = n if not cand else int(room - _units(_sums(cand, None, self.heavy, self.cols), self.scale) + 1e-9)
            if n > fit:
                self.pending.append(run)  # waits whole; counted as drawn when a step takes it
                continue
            cand += run
            room -= n
            self.n_heavy += n
        while len(cand) < self.slots and self.pending:  # mostly heavy data: part of a run fills the step
            run = self.pending[0]
            take = self.slots - len(cand)
            cand += run[:take]
            self.n_heavy += min(take, len(run))
            if take < len(run):
                self.pending[0] = run[take:]
            else:
                self.pending.pop(0)
        return cand

    def _light(self, cand, until):
        """Light samples up to the next heavy run (returns True) or until the step is drawn or the stream
        ends (False); a light run is taken whole. The hot loop of the planner, hence plain locals."""
        stream, runs, end, slots = self.stream, self.runs, len(self.stream), self.slots
        (c0, c1, c2), (s0, s1, s2) = self.cols, self.sums
        left = until - self.n_heavy
        l0, l1, l2 = (left * d for d in self.scale)
        pos = self.pos
        taken, cont = self.taken, self.cont
        while pos < end and (cont[pos] or (s0 < l0 and s1 < l1 and s2 < l2) or len(cand) < slots):
            if pos in runs:
                break
            i = stream[pos]
            pos += 1
            if taken and taken.pop(pos - 1, None) is not None:
                continue  # already pulled forward as sand (already counted)
            cand.append(i)
            s0 += c0[i]
            s1 += c1[i]
            s2 += c2[i]
        self.pos, self.sums = pos, [s0, s1, s2]
        return pos in runs  # stopped at a heavy run: the caller decides on it


class _Slots:
    """One step's R*G slots: samples, summed line cost, memory and compute (the compute column repeats memory
    without a cap, so one check serves both)."""

    def __init__(self, ctx, n):
        self.cost, self.mem, self.comp = _cols(ctx)
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


def _pack(cand, ctx, slots):
    """LPT: costliest sample first into the cheapest slot that has room (memory, compute cap). Returns the
    slots and the samples none of the TRIES cheapest slots had room for."""
    sl = _Slots(ctx, slots)
    heap = [(0.0, k) for k in range(slots)]
    deferred = []
    cost, mem, comp, samples, used, used_c = sl.cost, sl.mem, sl.comp, sl.samples, sl.used, sl.used_c
    limit, limit_c = sl.limit, sl.limit_c
    replace = heapq.heapreplace
    fail_m = fail_c = math.inf  # memory and compute of the last sample that fit none of the TRIES cheapest slots
    for i in sorted(cand, key=cost.__getitem__, reverse=True):
        if mem[i] >= fail_m and comp[i] >= fail_c:
            # Nothing was placed since that sample failed, so the same slots are the cheapest and have no more
            # room: this one fails them too (at one clip per micro-batch, most of the packing time went here).
            deferred.append(i)
            continue
        load, k = heap[0]
        # the common case, inline (the hot loop): the cheapest slot has room
        if not samples[k] or used[k] + mem[i] <= limit and used_c[k] + comp[i] <= limit_c:
            replace(heap, (load + cost[i], k))
            samples[k].append(i)
            used[k] += mem[i]
            used_c[k] += comp[i]
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
            fail_m, fail_c = mem[i], comp[i]
            continue
        sl.add(k, i)
        fail_m = fail_c = math.inf
    sl.load = [0.0] * slots  # the heap held the loads
    for load, k in heap:
        sl.load[k] = load
    return sl, deferred


def _rounds(sl, ctx, r, draw, carry, replicate=False):
    """Slots sorted by cost, cut into rounds of R (the slots of one cost level), each round evened out
    (_even, _shed into `carry` while the stream lasts, _fill_gaps); a round's costliest slot goes to the
    least-loaded rank so far (even rank totals too). With `replicate` nothing is shed: a sample given back
    lands alone in the next step, whose rounds its runs would otherwise make exact."""
    order = sorted((k for k in range(len(sl.samples)) if sl.samples[k]), key=sl.load.__getitem__, reverse=True)
    step = [[] for _ in range(r)]
    total = [0.0] * r
    shape = ctx.shape
    for j in range(0, len(order), r):
        rd = order[j:j + r]
        _even(rd, sl, ctx)
        if not draw.done():  # a sample given back must have a next step to go to
            if not replicate:
                _shed(rd, sl, ctx.shape, carry)
            _densify(rd, sl, draw.heavy, carry)
        _fill_gaps(rd, sl, draw)
        ranks = sorted(range(r), key=total.__getitem__)
        for rank, k in zip(ranks, sorted(rd, key=sl.load.__getitem__, reverse=True)):
            mb = sl.samples[k]
            mb.sort(key=shape.__getitem__)  # stable: samples of one shape contiguous, in placement order
            step[rank].append(mb)
            total[rank] += sl.load[k]
    return step


def _even(rd, sl, ctx, passes=8, scan=4, tol=None):
    """Local improvement of one round: in each pass every slot above the mean, costliest first, trades with
    one of the `scan` cheapest slots not yet traded with, taking the move of one sample or the swap of two
    that best halves their gap within memory and the compute cap. A round costs its costliest slot; slots
    within `tol` of the mean are left alone. Few samples per slot (small budgets) are where LPT leaves gaps."""
    load, tol = sl.load, EVEN_TOL if tol is None else tol
    for _ in range(passes):
        mean = sum(load[k] for k in rd) / len(rd)
        light = sorted(rd, key=load.__getitem__)
        heavy = [k for k in reversed(light) if load[k] > mean * (1 + tol)]
        light = [k for k in light if load[k] < mean]
        improved = False
        for a in heavy:
            for b in light[:scan]:
                act = _best_trade(sl, a, b, ctx.shape)
                if act is not None:
                    x, y = act
                    sl.add(a, x, -1)
                    sl.add(b, x)
                    if y is not None:
                        sl.add(b, y, -1)
                        sl.add(a, y)
                    light.remove(b)
                    improved = True
                    break
        if not improved:
            return


def _shed(rd, sl, shape, out, tol=None):
    """Slots of a round above its mean (by more than `tol`) give samples back (to `out`, the next step) until
    they are not: each time the cheapest sample that covers the excess, else the costliest. A cost-dense
    slot (a long clip with its company) then no longer sets the round's pace; moving the sample within the
    step is what _even tried, and memory is what stopped it."""
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


def _best_trade(sl, a, b, shape):
    """(x from a, y from b or None): the move or swap that brings the pair's costs closest, or None if none
    lowers the costlier. One sample per distinct shape is tried (samples of one shape are interchangeable)."""
    cost, mem, comp = sl.cost, sl.mem, sl.comp
    gap = sl.load[a] - sl.load[b]
    xs = list({shape[i]: i for i in sl.samples[a]}.values())
    ys = [None] + list({shape[i]: i for i in sl.samples[b]}.values())
    if len(xs) * len(ys) >= NUMPY_PAIRS:
        return _best_trade_np(sl, a, b, xs, ys, gap)
    return _best_trade_py(sl, a, b, xs, ys, gap)


def _best_trade_py(sl, a, b, xs, ys, gap):
    """_best_trade pair by pair (few pairs: cheaper than numpy's per-call overhead)."""
    cost, mem, comp = sl.cost, sl.mem, sl.comp
    best, best_left = None, gap - 1e-9
    for x in xs:
        for y in ys:
            if y is None:
                if len(sl.samples[a]) == 1:
                    continue  # a slot keeps at least one sample
                d, dm, dc = cost[x], mem[x], comp[x]
            else:
                d, dm, dc = cost[x] - cost[y], mem[x] - mem[y], comp[x] - comp[y]
            if not 0 < d < gap or sl.used[b] + dm > sl.limit or sl.used[a] - dm > sl.limit:
                continue
            if sl.used_c[b] + dc > sl.limit_c or sl.used_c[a] - dc > sl.limit_c:
                continue
            left = abs(gap - 2 * d)  # the pair's new cost difference
            if left < best_left:
                best, best_left = (x, y), left
    return best


def _best_trade_np(sl, a, b, xs, ys, gap):
    """_best_trade over all (x, y) pairs at once, float for float the same arithmetic and the same pick: the
    first pair (x outer, y inner) with the least new difference, if below gap. Column 0 (y None) is a move."""
    cols = sl.ctx.np_cols()
    diff = cols[xs][:, None, :] - cols[[len(cols) - 1] + ys[1:]][None, :, :]
    d, dm = diff[..., 0], diff[..., 1]
    ok = (d > 0) & (d < gap) & (sl.used[b] + dm <= sl.limit) & (sl.used[a] - dm <= sl.limit)
    if sl.ctx.dual:  # without a compute cap its column repeats memory, checked above
        dc = diff[..., 2]
        ok &= (sl.used_c[b] + dc <= sl.limit_c) & (sl.used_c[a] - dc <= sl.limit_c)
    if len(sl.samples[a]) == 1:
        ok[:, 0] = False  # a slot keeps at least one sample
    left = np.where(ok, np.abs(gap - 2 * d), np.inf)
    j = int(np.argmin(left))
    if not left.flat[j] < gap - 1e-9:
        return None
    return xs[j // len(ys)], ys[j % len(ys)]
