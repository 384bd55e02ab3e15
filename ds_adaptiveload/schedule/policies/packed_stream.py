"""The packed policy's epoch stream (a seeded, stratified order with heavy and light runs) and the Drawer that
reads each step's samples from it, pulling light ones forward as sand for a round's gaps. Pure Python, no torch."""
import bisect
from array import array
from collections import deque
from itertools import accumulate, compress
from operator import itemgetter, not_

from ds_adaptiveload.schedule.policies.common import token_class
from ds_adaptiveload.schedule.policies.packed_slots import sample_cols

# How far ahead in the stream (at least) a round's cheaper slots look for light samples to
# fill their gap (few samples per slot, i.e. small budgets, leave gaps that moves and swaps cannot close).
SAND_WINDOW = 256
# ... and at least this many steps' slots: with one clip per micro-batch a slot beside a long clip needs many
# light samples, and 2 R*G ran dry (video-heavy, 1024 ranks, G = 1: idle 0.315% -> 0.22% at 32).
SAND_SLOTS = 32
# A heavy shape's last, shorter run is placed in the stream no later than this fraction of the epoch: in the last
# steps few light samples are left to fill the slots beside it (the same case: 0.22% -> 0.15%).
REMAINDER_BEFORE = 0.9


def light_of(indices, heavy):
    """The light samples of `indices`, in order (compress: one pass in C over a million samples)."""
    return list(compress(indices, map(not_, map(heavy.__getitem__, indices))))


def light_sums(indices, ctx, heavy, cols=None):
    """(cost, memory, compute) summed over the light samples of `indices`."""
    light = light_of(indices, heavy)
    return [sum(map(col.__getitem__, light)) for col in cols or sample_cols(ctx)]


def slot_units(sums, scale):
    """Slots the light samples need: whichever of cost, memory and compute binds."""
    return max(s / d for s, d in zip(sums, scale))


def epoch_stream(keep, ctx, rng, heavy, run, replicate=False, heavy_run=None):
    """Seeded epoch order (array of indices), {start position: length} of its heavy runs, and a bytearray
    that is 1 at the positions that continue a light run (replicate; all 0 otherwise).

    Classes are interleaved by key (j + u)/n for the j-th sample of a class of n (u uniform), so any prefix
    holds each class at its share; light samples come one by one in shuffled order (or with `replicate` in runs
    of `run` of one token count, but where counts meet), heavy ones in runs of `heavy_run` (default `run`) of one
    token count (a run keeps one key, so it stays contiguous)."""
    heavy_run = heavy_run or run
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
    with_runs = set()  # the classes that hold runs
    for ch, length in ((heavy_chain, heavy_run), (chain, run)):
        flat = [i for *_, b in sorted(ch) for i in b]
        for j in range(0, len(flat), length):
            c = token_class(full[flat[j]])
            classes.setdefault(c, []).append(flat[j:j + length])
            with_runs.add(c)
    items, keys = [], array("d")
    rnd = rng.random
    for c in sorted(classes):
        group = classes[c]
        rng.shuffle(group)
        if c not in with_runs:  # samples one by one (the common case, and most of the samples)
            n = len(group)
            items += group
            keys.extend([(j + rnd()) / n for j in range(n)])
            continue
        sizes = [len(it) if isinstance(it, list) else 1 for it in group]
        n = sum(sizes)
        items += group
        keys.extend([(j + rnd()) / n for j, _ in zip(accumulate(sizes, initial=0), group)])
        for p, it in enumerate(group, len(items) - len(group)):  # a heavy shape's shorter, last run
            if isinstance(it, list) and heavy[it[0]] and len(it) < heavy_run:
                keys[p] = min(keys[p], REMAINDER_BEFORE)
    # keys ascend within a class (but for the shorter runs moved up), so the sort merges a few sorted runs
    by_key = sorted(range(len(items)), key=keys.__getitem__)
    if not with_runs:
        return array("q", map(items.__getitem__, by_key)), {}, bytearray(len(items))
    order, runs, cont = array("q"), {}, bytearray()
    for p in by_key:
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


class Drawer:
    """The stream's read position, with cumulative slot sums of what has been drawn and the heavy runs that
    wait for a step with room."""

    def __init__(self, stream, runs, cont, ctx, heavy, scale, slots):
        self.stream, self.runs, self.heavy, self.scale, self.slots = stream, runs, heavy, scale, slots
        self.cont = cont  # 1 where a light run continues: the step does not end there
        self.cols = sample_cols(ctx)
        self.pos, self.n_heavy, self.sums, self.pending = 0, 0, [0.0] * len(self.cols), []
        self.taken = {}  # positions ahead of pos already pulled forward by sand()
        self.shape, self.ahead, self.horizon = ctx.shape, {}, 0
        # each shape's first position in the stream (written from the end: the last write is the first position)
        at = dict(zip(map(ctx.shape.__getitem__, reversed(stream)), range(len(stream) - 1, -1, -1)))
        # each light shape's first sample, in stream order (ties in by_cost keep that order; heavy goes by shape)
        first = {key: stream[p] for key, p in sorted(at.items(), key=itemgetter(1)) if not heavy[stream[p]]}
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
        if self.horizon < end:
            heavy, shape = self.heavy, self.shape
            for p in range(self.horizon, end):
                i = stream[p]
                if not heavy[i]:
                    ahead.setdefault(shape[i], deque()).append(p)
            self.horizon = end
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
        return self.n_heavy + slot_units(self.sums, self.scale)

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
            used = slot_units(light_sums(cand, None, self.heavy, self.cols), self.scale) if cand else 0.0
            fit = n if not cand else int(room - used + 1e-9)
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
