"""What the scheduling policies share: the planning context (tokens, shapes, caps, cost model), token classes,
one-shape micro-batches, round-robin dealing and the LPT dealing and slot filling that the epoch tail uses too.

Pure Python, no torch. Imports nothing of the planner: the planner builds on the policies, not the reverse.
"""
import bisect
import heapq
from dataclasses import dataclass

from ds_adaptiveload.schedule.memory import RecomputeCost
from ds_adaptiveload.schedule.offload import for_plan

# Step-composition classes for mix_tv, by full-sequence tokens: images and short clips, mid clips, long.
CLASS_BOUNDS = (4096, 20000)


def token_class(tokens: int) -> int:
    return bisect.bisect_left(CLASS_BOUNDS, tokens)


@dataclass
class Ctx:
    """What a policy plans with: per-sample tokens and shapes, per-shape batch caps and the cost model."""
    profile: object
    cfg: object   # planner.PlanConfig
    full: list    # full-sequence tokens per sample
    gpu: list     # per-GPU tokens per sample
    shape: list   # shape key per sample
    cap: dict     # shape key -> max micro-batch size

    def __post_init__(self):
        # Cost depends only on the shape: compute it once per shape, then index by sample.
        # (dict(zip()) keeps a shape's last per-GPU length, which is its only one: a pass in C over the samples)
        by_shape = {key: self.profile.sample_ms(g) for key, g in dict(zip(self.shape, self.gpu)).items()}
        self.cost = list(map(by_shape.__getitem__, self.shape))
        # --checkpoint-blocks auto: the recompute a micro-batch's open blocks skip (None: every block's, as profiled)
        self.recompute = (None if self.cfg.checkpoint == "all"
                          else RecomputeCost.of(self.profile, self.cfg.checkpoint_policy))
        self.fixed_offload = None  # activation_offload under a fixed checkpoint count: (tokens, t_ms) -> copy ms
        if self.cfg.activation_offload != "off":  # the recompute it saves and the copy time it does not hide
            self.recompute, self.fixed_offload = for_plan(self.recompute, self.profile, self.cfg.activation_offload)

    def base_ms(self, mb):
        """The profile's time for micro-batch mb with every block checkpointed."""
        return self.profile.micro_ms(len(mb), self.gpu[mb[0]])

    def mb_ms(self, mb, ks=None):
        """Predicted ms of micro-batch mb: base_ms less the recompute its checkpointing skips, plus the host-copy
        time its offloaded blocks do not hide (at ks: the plan set for the whole step, or its own)."""
        t = self.base_ms(mb)
        if self.recompute is None:
            return t if self.fixed_offload is None else t + self.fixed_offload(sum(map(self.gpu.__getitem__, mb)), t)
        return self.recompute.ms(t, sum(map(self.gpu.__getitem__, mb)), len(mb), ks)

    def step_ks(self, step):
        """auto-step: the plan (k, k, 0[, n]) every micro-batch of the step runs with (RecomputeCost.step_plan over
        all ranks); else None."""
        if self.recompute is None or self.cfg.checkpoint != "auto-step":
            return None
        return self.recompute.step_plan((sum(map(self.gpu.__getitem__, mb)), len(mb)) for mbs in step for mb in mbs)

    def step_costs(self, step):
        """Predicted ms of every micro-batch of the step, costs[rank][g] (what a replay compares measured times with)."""
        ks = self.step_ks(step)
        if ks is None:  # each micro-batch by its own plan: map, a pass in C (a plan of 1M samples costs 600,000)
            return [list(map(self.mb_ms, mbs)) for mbs in step]
        return [[self.mb_ms(mb, ks) for mb in mbs] for mbs in step]

    def step_pred(self, step, costs=None):
        """(predicted ms of every rank, predicted wall ms of the step), each micro-batch costed once (with 1M
        samples costing them twice, per rank and per round, took a fifth of the planning time). Every rank
        holds the same number of micro-batches; under lockstep the wall is the sum over rounds of the
        slowest micro-batch, else the slowest rank. costs: step_costs(step), where already computed."""
        costs = self.step_costs(step) if costs is None else costs
        fixed = self.profile.step_fixed_ms
        ranks = [fixed + sum(c) for c in costs]
        if not self.cfg.lockstep:
            return ranks, max(ranks)
        return ranks, fixed + sum(map(max, zip(*costs)))  # zip(*costs): the rounds (every rank holds G)

    def step_ms(self, step):
        return self.step_pred(step)[1]


def shuffled_buckets(indices, shape, rng):
    """[(shape key, shuffled sample indices of that shape)], by sorted shape key."""
    buckets = {}
    for i in indices:
        buckets.setdefault(shape[i], []).append(i)
    out = []
    for key in sorted(buckets):  # sorted so the plan does not depend on manifest order of first sight
        b = buckets[key]
        rng.shuffle(b)
        out.append((key, b))
    return out


def micro_batches(buckets, cap):
    """Each bucket cut into one-shape micro-batches of its shape's cap."""
    mbs = []
    for key, b in buckets:
        c = cap[key]
        mbs += [b[j:j + c] for j in range(0, len(b), c)]
    return mbs


def deal(mbs, ctx, rng):
    """Shuffle micro-batches and deal them round-robin, R*G a step."""
    rng.shuffle(mbs)
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    per_step = r * g
    steps = []
    for s in range(0, len(mbs), per_step):
        chunk = mbs[s:s + per_step]
        step = [[] for _ in range(r)]
        for j, mb in enumerate(chunk):
            step[j % r].append(mb)
        steps.append(step)
    return steps


def lpt_micro_batches(chunk, r, g, ctx, load_fn=None):
    """Deal whole micro-batches (sorted by cost, descending) to the least-loaded rank with a free slot."""
    load_fn = load_fn or ctx.mb_ms
    step = [[] for _ in range(r)]
    heap = [(0.0, k) for k in range(r)]
    for mb in chunk:
        ld, k = heapq.heappop(heap)
        step[k].append(mb)
        if len(step[k]) < g:
            heapq.heappush(heap, (ld + load_fn(mb), k))
    return step


def fill_slots(mbs, g):
    """Give every rank exactly G micro-batches: split its largest micro-batch while it has fewer; if it
    holds fewer than G samples, take one from the largest micro-batch elsewhere. Splitting costs nothing
    in the cost model beyond the per-micro-batch fixed time, which every rank then pays G times."""
    needy = []
    for k, rank_mbs in enumerate(mbs):
        while len(rank_mbs) < g:
            big = max(range(len(rank_mbs)), key=lambda m: len(rank_mbs[m]), default=None)
            if big is None or len(rank_mbs[big]) < 2:
                needy.append(k)
                break
            half = len(rank_mbs[big]) // 2
            rank_mbs.append(rank_mbs[big][half:])
            del rank_mbs[big][half:]
    if not needy:
        return
    donors = [(-len(mb), k, m) for k, rank_mbs in enumerate(mbs) for m, mb in enumerate(rank_mbs) if len(mb) >= 2]
    heapq.heapify(donors)
    for k in needy:
        while len(mbs[k]) < g and donors:
            _, d, m = heapq.heappop(donors)
            mb = mbs[d][m]
            mbs[k].append([mb.pop()])
            if len(mb) >= 2:
                heapq.heappush(donors, (-len(mb), d, m))
        # donors exhausted: too few samples in the step; the epoch tail pads
