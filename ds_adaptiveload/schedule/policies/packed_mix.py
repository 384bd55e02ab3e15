"""The packed policy's last pass under lockstep: rounds and micro-batches swapped between steps so that each step's
token classes come closer to the epoch's shares, where the epoch's predicted wall time does not rise. Pure Python."""
import bisect
from itertools import chain

from ds_adaptiveload.schedule.policies.common import CLASS_BOUNDS, token_class

# Candidates tried per (micro-batch kind, wanted kind): the nearest below in cost first. More found few further swaps
# (openvid-720p, one clip, 64 ranks, G = 1: 200 candidates gave mix_tv 0.166 against 0.181) for twice the time.
SCAN = 48
# Passes over the steps, most uneven first; a second pass finds swaps the first one's moves opened.
PASSES = 2
# Steps searched for a round to swap with one of a step's rounds: those furthest the other way in the step's most
# uneven class.
ROUND_PEERS = 32
# No swaps where the steps' mean distance from the epoch's class shares is at most this: at six clips of memory
# steps already hold thousands of samples near the epoch's shares, and the search took a fifth of the planning time
# (1M openvid-720p samples, 1024 ranks, G = 1: 3.4 of 16.4 s of CPU). 0.02 left two cases above random dealing's
# 0.010-0.017 (openvid-720p, 1024 ranks, five and six clips, G = 4).
MIX_ABOVE = 0.005


def even_mix(steps, ctx, r, g):
    """`steps` with whole rounds (G >= 2) and then micro-batches swapped between full steps, each where it lowers the
    sum over the two steps of the total-variation distance of a step's class shares (mix_tv, by sample count) from the
    epoch's. Under lockstep a step costs its fixed cost plus the sum of its rounds' slowest micro-batches: a round
    swap keeps the epoch's wall time, and a micro-batch may take the place of another only up to that round's
    slowest, so no step's wall rises. Runs of R copies (heavy samples, `replicate`) keep rounds even but make rounds
    of one kind; these swaps mix them across steps. Without lockstep (a step costs its slowest rank) and under
    checkpoint auto-step (a micro-batch's cost depends on its whole step) the steps are kept as they are."""
    if not ctx.cfg.lockstep or ctx.cfg.checkpoint == "auto-step" or len(steps) < 2:
        return steps
    cls = {t: token_class(t) for t in set(ctx.full)}  # per token count: its class
    if _mean_distance(steps, ctx, r, g, cls) <= MIX_ABOVE:
        return steps
    st = _MixState(steps, ctx, r, g, cls)
    if len(st.full) < 2:
        return steps
    if g > 1:
        _swap_rounds(st, g)
        if sum(st.tvs.values()) <= MIX_ABOVE * len(st.tvs):
            return steps
    for _ in range(PASSES):
        if not sum([st.swap_from(a) for a in sorted(st.full, key=st.tvs.__getitem__, reverse=True)]):
            break
    return steps


def _is_full(step, r, g) -> bool:
    """A step of every rank's G micro-batches (an epoch's short last step is not)."""
    return len(step) == r and set(map(len, step)) == {g}


def _mean_distance(steps, ctx, r, g, cls):
    """The mean over full steps of the distance of a step's class shares from theirs over those steps (mix_tv)."""
    of = bytes(map(cls.__getitem__, ctx.full)).__getitem__  # each sample's class
    ncls = len(CLASS_BOUNDS) + 1
    counts = []
    for step in steps:
        if _is_full(step, r, g):
            classes = bytes(map(of, chain.from_iterable(chain.from_iterable(step))))
            counts.append([classes.count(c) for c in range(ncls)])
    total = [sum(c) for c in zip(*counts)]
    n = sum(total)
    if not counts or not n:
        return 0.0
    return sum(0.5 * sum(abs(c / (sum(cnt) or 1) - e / n) for c, e in zip(cnt, total)) for cnt in counts) / len(counts)


def _swap_rounds(st, g):
    """Whole rounds (the k-th micro-batch of every rank) swapped between steps, each where it lowers the two steps'
    distances most, over the ROUND_PEERS steps furthest the other way. G rounds a step give G times the kinds to
    mix."""
    ncls = len(st.share)
    for _ in range(PASSES):
        rounds = {s: st.round_vecs(s, g) for s in st.full}
        dev = {s: [c / (sum(st.cnt[s]) or 1) - e for c, e in zip(st.cnt[s], st.share)] for s in st.full}
        by_class = [sorted(st.full, key=lambda s, c=c: dev[s][c]) for c in range(ncls)]
        made = 0
        for a in sorted(st.full, key=st.tvs.__getitem__, reverse=True):
            c = max(range(ncls), key=lambda c: abs(dev[a][c]))
            peers = by_class[c][:ROUND_PEERS] if dev[a][c] > 0 else by_class[c][-ROUND_PEERS:]
            best, best_d = None, -1e-12
            for ka, va in enumerate(rounds[a]):
                for b in peers:
                    if b != a:
                        for kb, vb in enumerate(rounds[b]):
                            d = st.gain(a, va, vb) + st.gain(b, vb, va)
                            if d < best_d:
                                best, best_d = (ka, b, kb), d
            if best is not None:
                ka, b, kb = best
                st.swap_rounds(a, ka, b, kb, rounds[a][ka], rounds[b][kb])
                rounds[a][ka], rounds[b][kb] = rounds[b][kb], rounds[a][ka]
                made += 1
        if not made:
            return


class _MixState:
    """Per full step: class counts, its distance, each round's cap (its slowest micro-batch), and its micro-batches
    grouped by (kind, cost, round) -> ranks, a kind being a micro-batch's class counts; an index of the groups by
    kind, sorted by cost (entries of emptied groups are skipped on reading)."""

    def __init__(self, steps, ctx, r, g, cls):
        self.steps = steps
        ncls = len(CLASS_BOUNDS) + 1
        seen = {}  # per sequence of per-GPU tokens: (cost, kind); micro-batches repeat (a round's copies)
        self.full = [s for s, step in enumerate(steps) if _is_full(step, r, g)]
        self.groups, self.cnt, self.cap = {}, {}, {}
        epoch, index = [0] * ncls, {}
        gpu, full = ctx.gpu.__getitem__, ctx.full
        for s in self.full:
            groups, cap = {}, [0.0] * g
            for rk, mbs in enumerate(steps[s]):
                for k, mb in enumerate(mbs):
                    key = tuple(map(gpu, mb))
                    ck = seen.get(key)
                    if ck is None:
                        v = [0] * ncls
                        for i in mb:
                            v[cls[full[i]]] += 1
                        c = ctx.mb_ms(mb)
                        ck = seen[key] = (c, [(tuple(v), c, m) for m in range(g)])  # its group key per round
                    c, gk = ck[0], ck[1][k]
                    if gk in groups:
                        groups[gk].append(rk)
                    else:
                        groups[gk] = [rk]
                    if c > cap[k]:
                        cap[k] = c
            cnt = [0] * ncls
            for (v, c, k), ranks in groups.items():
                cnt = [a + b * len(ranks) for a, b in zip(cnt, v)]
                index.setdefault(v, []).append((c, s, k))
            self.groups[s], self.cnt[s], self.cap[s] = groups, cnt, cap
            epoch = [a + b for a, b in zip(epoch, cnt)]
        total = sum(epoch) or 1
        self.share = [e / total for e in epoch]
        self.index = {v: sorted(lst) for v, lst in index.items()}
        self.tvs = {s: self._tv(self.cnt[s]) for s in self.full}
        self._gains = {}  # per step: (out, into) -> gain, while its counts stand

    def _tv(self, cnt):
        n = sum(cnt) or 1
        return 0.5 * sum([abs(c / n - e) for c, e in zip(cnt, self.share)])

    def gain(self, s, out, into):
        """The change of step s's distance when class counts `out` leave it and `into` come (tuples). Remembered
        until step s's counts change: the search asks again for the same kinds (a step's micro-batches are many,
        their kinds few; 1M samples at six clips asked 530,000 times for 3,000 swaps made)."""
        memo = self._gains.get(s)
        if memo is None:
            memo = self._gains[s] = {}
        d = memo.get((out, into))
        if d is None:
            d = memo[out, into] = self._tv([c - a + b for c, a, b in zip(self.cnt[s], out, into)]) - self.tvs[s]
        return d

    def round_vecs(self, s, g):
        vecs = [[0] * len(self.share) for _ in range(g)]
        for (v, _, k), ranks in self.groups[s].items():
            vecs[k] = [a + b * len(ranks) for a, b in zip(vecs[k], v)]
        return [tuple(v) for v in vecs]

    def _recount(self, s, out, into):
        self.cnt[s] = [c - a + b for c, a, b in zip(self.cnt[s], out, into)]
        self.tvs[s] = self._tv(self.cnt[s])
        self._gains.pop(s, None)

    def swap_rounds(self, a, ka, b, kb, va, vb):
        for mbs_a, mbs_b in zip(self.steps[a], self.steps[b]):
            mbs_a[ka], mbs_b[kb] = mbs_b[kb], mbs_a[ka]
        ga = {key: ranks for key, ranks in self.groups[a].items() if key[2] == ka and ranks}
        gb = {key: ranks for key, ranks in self.groups[b].items() if key[2] == kb and ranks}
        for s, k, old, new in ((a, ka, ga, gb), (b, kb, gb, ga)):
            for key in old:
                del self.groups[s][key]
            for (v, c, _), ranks in new.items():
                self.groups[s][v, c, k] = ranks
                bisect.insort(self.index[v], (c, s, k))
        self.cap[a][ka], self.cap[b][kb] = self.cap[b][kb], self.cap[a][ka]
        self._recount(a, va, vb)
        self._recount(b, vb, va)

    def swap_from(self, a):
        """Swaps of step a's micro-batches, each for the best candidate of another kind; the number made."""
        made = 0
        for key in list(self.groups[a]):
            while self.groups[a].get(key) and self._best_swap(a, key):
                made += 1
        return made

    def _best_swap(self, a, key):
        """The swap of a micro-batch of group `key` of step a that lowers the two steps' distances most, over the other
        kinds (per kind the candidate nearest below in cost that fits); made, and True, where one lowers them."""
        va, ca, ka = key
        room = self.cap[a][ka]
        best, best_d = None, -1e-12
        for vb, lst in self.index.items():
            if vb == va:
                continue
            d_a = self.gain(a, va, vb)
            if d_a >= best_d:
                continue
            j = bisect.bisect_right(lst, (room, float("inf")))
            for cb, sb, kb in lst[max(0, j - SCAN):j][::-1]:
                if sb != a and ca <= self.cap[sb][kb] and self.groups[sb].get((vb, cb, kb)):
                    d = d_a + self.gain(sb, vb, va)
                    if d < best_d:
                        best, best_d = (sb, (vb, cb, kb)), d
                    break
        if best is None:
            return False
        b, key_b = best
        self._apply(a, key, b, key_b, self._copies(a, key, b, key_b))
        return True

    def _copies(self, a, key_a, b, key_b):
        """How many copies of the swap (a group of a round's copies for another's) keep lowering the two distances."""
        va, vb = key_a[0], key_b[0]
        most = min(len(self.groups[a][key_a]), len(self.groups[b][key_b]))
        ca, cb = self.cnt[a], self.cnt[b]
        step = [y - x for x, y in zip(va, vb)]
        tv = self._tv
        # the two distances at n copies; n + 1 copies' become n + 2's baseline (the counts are the same integers)
        now = tv([c + d for c, d in zip(ca, step)]) + tv([c - d for c, d in zip(cb, step)])
        n = 1
        while n < most:
            nxt = tv([c + (n + 1) * d for c, d in zip(ca, step)]) + tv([c - (n + 1) * d for c, d in zip(cb, step)])
            if nxt >= now - 1e-12:
                break
            now = nxt
            n += 1
        return n

    def _apply(self, a, key_a, b, key_b, n):
        """n micro-batches of group key_a of step a swapped for n of group key_b of step b."""
        (va, ca, ka), (vb, cb, kb) = key_a, key_b
        ga, gb = self.groups[a][key_a], self.groups[b][key_b]
        ras, rbs = ga[-n:], gb[-n:]
        del ga[-n:], gb[-n:]
        steps = self.steps
        for ra, rb in zip(ras, rbs):
            steps[a][ra][ka], steps[b][rb][kb] = steps[b][rb][kb], steps[a][ra][ka]
        for s, k, v, c, ranks in ((a, ka, vb, cb, ras), (b, kb, va, ca, rbs)):
            group = self.groups[s].setdefault((v, c, k), [])
            if not group:
                bisect.insort(self.index[v], (c, s, k))
            group += ranks
        self._recount(a, [n * x for x in va], [n * x for x in vb])
        self._recount(b, [n * x for x in vb], [n * x for x in va])
