"""Epoch planning: turn samples of very different token counts into per-rank micro-batches.

Pure Python (no torch, no process groups): every rank runs the same deterministic function of
(samples, profile, config, epoch) and takes its own share, so no communication is needed.

A plan is `steps[step][rank] -> [micro-batch, ...]` with exactly G micro-batches per rank per step (under
ZeRO-3 every forward all-gathers parameters, so ranks must run the same number of them), each micro-batch a
list of sample indices of one shape (no padding inside a micro-batch) whose per-GPU tokens fit M_mem; with
`packed` a micro-batch may hold several shapes (samples of one shape contiguous), its samples' tokens in M_mem.

Policies:
- equal-tokens: bucket by shape, B = floor(M_mem / S), shuffle micro-batches, deal them round-robin. What
  token-capped loaders (DeepSpeed dynamic batching, bucket loaders) do; the baseline.
- dual: the same with B also capped by the paper's compute constraint B * S^p <= M_comp.
- balanced: both caps, then balance every step. With G >= 2, each step draws a stratified slice of the
  epoch (every shape in proportion, so the step looks like the data) and packs its samples onto ranks by
  LPT (longest first to the least-loaded rank that has a free slot or an open micro-batch of that shape);
  images and short clips are the fine-grained filler that evens the totals. With G = 1 a rank runs one
  single-shape micro-batch per step, so balance requires steps of similar micro-batches: micro-batches are
  sorted by cost within a window of steps (`window`, default the whole epoch) and step order is shuffled.
  That trades step composition (mix_tv) for balance; a smaller window trades back.
- packed (schedule/packed.py): micro-batches of mixed shapes, every micro-batch of a step at about the same
  predicted cost, steps drawn from the stratified stream (so they look like the data), at any G.
"""
import bisect
import heapq
from array import array
import math
import random
from dataclasses import dataclass, field

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.memory import RecomputeCost

# Same-shape run length (in micro-batches) of the stratified stream; measured best of 1/2/4/8 on the
# video-heavy mix at 8-1024 ranks (docs/scheduler.md).
RUN_SLOTS = 1
POLICIES = ("balanced", "dual", "equal-tokens", "packed")
CHECKPOINT_MODES = ("all", "auto", "auto-step")
# Step-composition classes for mix_tv, by full-sequence tokens: images and short clips, mid clips, long.
CLASS_BOUNDS = (4096, 20000)


@dataclass
class PlanConfig:
    policy: str = "balanced"
    """balanced | dual | equal-tokens | packed (micro-batches of mixed shapes; needs the packed model)."""
    world_size: int = 1
    """GPUs in the job; the data-parallel size is world_size / sp."""
    sp: int = 1
    """Ulysses sequence-parallel degree k: a sample is split over k GPUs, which see the same samples."""
    grad_accum: int = 1
    """G: micro-batches per rank per optimizer step."""
    seed: int = 0
    """Shuffling seed; the plan is a function of (seed, epoch)."""
    on_oversize: str = "error"
    """error | skip: what to do with a sample whose per-GPU tokens exceed M_mem."""
    window: int = None
    """balanced with G = 1: steps per cost-sorting window (0 or None = whole epoch)."""
    fill: float = None
    """balanced with G >= 2: a step draws samples worth this fraction of its R*G micro-batch slots
    (None: the better of FILL_CHOICES by predicted wall time on a prefix of the epoch). packed: the average
    fraction of a micro-batch's memory that sets its target cost (None: packed.PACK_FILL)."""
    lockstep: bool = False
    """Ranks wait for each other at every micro-batch, not only at the optimizer step: true under ZeRO-3
    (parameter all-gathers in every forward and backward) and ZeRO-2 (gradient reduce-scatter in every
    backward). A step then costs the sum over its G micro-batch rounds of the slowest rank's micro-batch."""
    checkpoint: str = "all"
    """What the trainer checkpoints: all (every block, as calibrate measures: costs as the profile says) | auto
    (--checkpoint-blocks auto: each micro-batch only the blocks its memory needs, so it skips the rest's
    recompute) | auto-step (the same with the step's largest count on every micro-batch, as under ZeRO-3).
    auto costs micro-batches with schedule/memory.RecomputeCost, when the profile can say (else as all)."""
    checkpoint_policy: str = "full"
    """full | attention (--checkpoint-policy): with auto, what a checkpointed block keeps (RecomputeCost)."""

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("world_size", "sp", "grad_accum"):
            positive(name)
        if self.policy not in POLICIES:
            raise UserError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.world_size % self.sp:
            raise UserError(f"world-size {self.world_size} is not divisible by sp {self.sp}")
        if self.on_oversize not in ("error", "skip"):
            raise UserError(f"on-oversize must be 'error' or 'skip', got {self.on_oversize!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 0):
            raise UserError(f"window must be an integer >= 0, got {self.window!r}")
        if not isinstance(self.lockstep, bool):
            raise UserError(f"lockstep must be true or false, got {self.lockstep!r}")
        if self.fill is not None and not 0.1 <= self.fill <= 1.0:
            raise UserError(f"fill must be in [0.1, 1], got {self.fill!r}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise UserError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}")
        if self.checkpoint_policy not in ("full", "attention"):
            raise UserError(f"checkpoint-policy must be full or attention, got {self.checkpoint_policy!r}")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp


@dataclass
class Plan:
    steps: list
    """steps[step][dp_rank] -> list of G micro-batches, each a list of sample indices."""
    pred_ms: list
    """pred_ms[step][dp_rank] -> predicted compute ms of that rank in that step."""
    pad: set
    """(step, rank, micro) of micro-batches that repeat a sample only to keep ranks in lockstep at the
    epoch's end; the trainer gives them zero loss weight. Not counted as planned samples."""
    skipped: list
    """Indices of samples skipped as oversize (on_oversize=skip)."""
    tokens: list
    """Full-sequence tokens of every sample (index -> S)."""
    config: PlanConfig
    epoch: int
    dual: tuple = None
    """(p, M_comp) of the compute constraint for this data (used by the dual policy)."""
    pred_wall_ms: list = None
    """pred_wall_ms[step] -> predicted wall ms of the step: the slowest rank's pred_ms, or under lockstep
    the sum over micro-batch rounds of the slowest rank's micro-batch (>= the slowest rank's total)."""

    def summary(self) -> dict:
        cfg = self.config
        sum_max = sum(self.pred_wall_ms)
        sum_mean = sum(sum(r) / len(r) for r in self.pred_ms)
        planned = sum(len(mb) for s, step in enumerate(self.steps) for r, mbs in enumerate(step)
                      for m, mb in enumerate(mbs) if (s, r, m) not in self.pad)
        return {
            "policy": cfg.policy, "world_size": cfg.world_size, "sp": cfg.sp, "dp_size": cfg.dp_size,
            "grad_accum": cfg.grad_accum, "seed": cfg.seed, "epoch": self.epoch,
            "steps": len(self.steps),
            "micro_batches": len(self.steps) * cfg.dp_size * cfg.grad_accum,
            "samples_total": len(self.tokens), "samples_planned": planned,
            "samples_skipped": len(self.skipped), "pad_micro_batches": len(self.pad),
            "idle_fraction": max(0.0, 1 - sum_mean / sum_max) if sum_max else 0.0,
            "mix_tv": mix_tv(self),
            "predicted_wall_s": sum_max / 1000,
        }


def token_class(tokens: int) -> int:
    return bisect.bisect_left(CLASS_BOUNDS, tokens)


def mix_tv(plan: Plan) -> float:
    """Mean over steps of the total-variation distance between the step's class shares (by sample
    count) and the epoch's: 0 when every step looks like the data, up to 1 when steps are single-class."""
    classes = [token_class(t) for t in plan.tokens]
    ncls = len(CLASS_BOUNDS) + 1
    epoch = [0] * ncls
    per_step = []
    for s, step in enumerate(plan.steps):
        counts = [0] * ncls
        for r, mbs in enumerate(step):
            for m, mb in enumerate(mbs):
                if (s, r, m) not in plan.pad:
                    for i in mb:
                        counts[classes[i]] += 1
        per_step.append(counts)
        epoch = [a + b for a, b in zip(epoch, counts)]
    total = sum(epoch)
    if not total:
        return 0.0
    tvs = []
    for counts in per_step:
        n = sum(counts)
        if n:
            tvs.append(0.5 * sum(abs(c / n - e / total) for c, e in zip(counts, epoch)))
    return sum(tvs) / len(tvs) if tvs else 0.0


# ----------------------------------------------------------------------------------------------------
# Entry point


def make_plan(samples, profile, cfg: PlanConfig, epoch: int = 0) -> Plan:
    """Plan one epoch. `samples` need .id, .frames, .height, .width (manifest.Sample)."""
    if not samples:
        raise UserError("no samples to plan")
    full, gpu, shape = _tokens(samples, profile, cfg.sp)
    keep, skipped = _oversize(samples, full, gpu, profile, cfg)
    rng = random.Random(f"{cfg.seed}/{epoch}")
    dual = profile.dual_for(min((gpu[i] for i in keep), default=1), max((gpu[i] for i in keep), default=1))
    cap = _batch_caps(gpu, shape, keep, profile, dual if cfg.policy == "dual" else None)
    if cfg.policy == "packed":  # its own module; imported here because it builds on this one's helpers
        from ds_adaptiveload.schedule import packed
        ctx = packed.PackedCtx(profile, cfg, full, gpu, shape, cap)
    else:
        ctx = _Ctx(profile, cfg, full, gpu, shape, cap)
    if not keep:
        steps = []
    elif cfg.policy == "packed":
        steps = packed.packed_steps(keep, ctx, rng)
    elif cfg.policy in ("equal-tokens", "dual"):
        steps = _deal(_micro_batches(_shuffled_buckets(keep, shape, rng), cap), ctx, rng)
    elif cfg.lockstep and cfg.grad_accum > 1:
        steps = _balanced_rounds(keep, ctx, rng)
    elif cfg.grad_accum == 1 or cfg.window:
        steps = _balanced_sorted(keep, ctx, rng)
    else:
        steps = _balanced_mixed(keep, ctx, rng)
    pad = _finish_tail(steps, ctx, keep)
    ks = [ctx.step_ks(step) for step in steps]
    pred = [[ctx.rank_ms(mbs, k) for mbs in step] for step, k in zip(steps, ks)]
    return Plan(steps, pred, pad, skipped, full, cfg, epoch, dual, [ctx.step_ms(st, k) for st, k in zip(steps, ks)])


@dataclass
class _Ctx:
    profile: object
    cfg: PlanConfig
    full: list    # full-sequence tokens per sample
    gpu: list     # per-GPU tokens per sample
    shape: list   # shape key per sample
    cap: dict     # shape key -> max micro-batch size

    def __post_init__(self):
        # Cost depends only on the shape: compute it once per shape, then index by sample.
        by_shape = {}
        for g, key in zip(self.gpu, self.shape):
            if key not in by_shape:
                by_shape[key] = self.profile.sample_ms(g)
        self.cost = [by_shape[key] for key in self.shape]
        # --checkpoint-blocks auto: the recompute a micro-batch's open blocks skip (None: every block's, as profiled)
        self.recompute = (None if self.cfg.checkpoint == "all"
                          else RecomputeCost.of(self.profile, self.cfg.checkpoint_policy))

    def base_ms(self, mb):
        """The profile's time for micro-batch mb with every block checkpointed."""
        return self.profile.micro_ms(len(mb), self.gpu[mb[0]])

    def mb_ms(self, mb, ks=None):
        """Predicted ms of micro-batch mb: base_ms less the recompute its checkpointing skips (at ks: (k, k_full)
        set for the whole step, or its own)."""
        t = self.base_ms(mb)
        if self.recompute is None:
            return t
        return t * self.recompute.factor(sum(map(self.gpu.__getitem__, mb)), len(mb), ks)

    def step_ks(self, step):
        """auto-step: the (k, k) every micro-batch of the step runs with, its largest over all ranks; else None."""
        if self.recompute is None or self.cfg.checkpoint != "auto-step":
            return None
        k = max(self.recompute.ks(sum(map(self.gpu.__getitem__, mb)), len(mb))[0] for mbs in step for mb in mbs)
        return k, k

    def rank_ms(self, mbs, ks=None):
        return self.profile.step_fixed_ms + sum(self.mb_ms(mb, ks) for mb in mbs)

    def step_ms(self, step, ks=None):
        """Predicted wall time of a step (every rank holds the same number of micro-batches); ks: step_ks(step)."""
        ks = self.step_ks(step) if ks is None else ks
        if not self.cfg.lockstep:
            return max(self.rank_ms(mbs, ks) for mbs in step)
        return self.profile.step_fixed_ms + sum(max(self.mb_ms(mbs[k], ks) for mbs in step)
                                                for k in range(len(step[0])))


def _tokens(samples, profile, sp):
    """Per-sample full tokens, per-GPU tokens and shape key; the objects are shared per shape (memory)."""
    geo = profile.geometry
    cache, full, gpu, shape = {}, [], [], []
    for s in samples:
        key = (s.frames, s.height, s.width)
        hit = cache.get(key)
        if hit is None:
            try:
                t = geo.tokens(*key)
            except ValueError as e:
                raise UserError(f"sample {s.id!r}: {e}") from None
            hit = cache[key] = (t, per_gpu_tokens(t, sp), key)
        full.append(hit[0])
        gpu.append(hit[1])
        shape.append(hit[2])
    return full, gpu, shape


def _oversize(samples, full, gpu, profile, cfg):
    keep, skipped = [], []
    budget = profile.budget_tokens
    for i, g in enumerate(gpu):
        if profile.mem_batch(g) >= 1:
            keep.append(i)
        elif cfg.on_oversize == "skip":
            skipped.append(i)
        else:
            room = budget - profile.sample_tokens  # what one sample's tokens may take
            k = int(-(-full[i] // room)) if room > 0 else "none"
            own = f" (+{profile.sample_tokens:.0f} of memory.sample_tokens)" if profile.sample_tokens else ""
            raise UserError(
                f"sample {samples[i].id!r} ({samples[i].frames}x{samples[i].height}x{samples[i].width}) has "
                f"{g} tokens per GPU at sp={cfg.sp}{own}, over memory.budget_tokens={budget}; the smallest "
                f"sequence-parallel degree that fits it is {k} (it must divide the world size), or pass "
                f"--on-oversize skip")
    return keep, skipped


def _batch_caps(gpu, shape, keep, profile, dual):
    """Largest micro-batch per shape: memory cap, and with `dual` (p, M_comp) also the compute cap."""
    cap = {}
    for i in keep:
        key = shape[i]
        if key not in cap:
            b = profile.mem_batch(gpu[i])
            cap[key] = min(b, profile.comp_batch(gpu[i], dual)) if dual else b
    return cap


def _shuffled_buckets(indices, shape, rng):
    buckets = {}
    for i in indices:
        buckets.setdefault(shape[i], []).append(i)
    out = []
    for key in sorted(buckets):  # sorted so the plan does not depend on manifest order of first sight
        b = buckets[key]
        rng.shuffle(b)
        out.append((key, b))
    return out


def _micro_batches(buckets, cap):
    mbs = []
    for key, b in buckets:
        c = cap[key]
        mbs += [b[j:j + c] for j in range(0, len(b), c)]
    return mbs


# ----------------------------------------------------------------------------------------------------
# Baselines: shuffle micro-batches, deal round-robin


def _deal(mbs, ctx, rng):
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
    for key, b in _shuffled_buckets(indices, ctx.shape, rng):
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
    3. Split micro-batches so every rank runs exactly G (see _fill_slots)."""
    r, g = ctx.cfg.dp_size, ctx.cfg.grad_accum
    buckets = {}
    for i in cand:
        buckets.setdefault(ctx.shape[i], []).append(i)
    mbs = _micro_batches(sorted(buckets.items()), ctx.cap)
    cost = ctx.cost
    mbs.sort(key=lambda mb: -len(mb) * cost[mb[0]])
    step = _lpt_micro_batches(mbs, r, g, ctx, load_fn=lambda mb: len(mb) * cost[mb[0]])
    _rebalance(step, ctx, g)
    _fill_slots(step, g)
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


def _fill_slots(mbs, g):
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
    the epoch's last step (_finish_tail)."""
    per_step = ctx.cfg.dp_size * ctx.cfg.grad_accum
    chunks = _windows(_stratified_stream(keep, ctx, rng), ctx)
    carry = []
    for w, chunk in enumerate(chunks):
        mbs = _micro_batches(_shuffled_buckets(carry + chunk, ctx.shape, rng), ctx.cap)
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
        window_steps = [_lpt_micro_batches(mbs[s:s + per_step], r, g, ctx) for s in range(0, len(mbs), per_step)]
        rng.shuffle(window_steps)  # no epoch sorted by length
        steps += window_steps
        if rest:
            steps.append(_lpt_micro_batches(rest, r, g, ctx))
    return steps


def _lpt_micro_batches(chunk, r, g, ctx, load_fn=None):
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


# ----------------------------------------------------------------------------------------------------
# Epoch tail


def _finish_tail(steps, ctx, keep):
    """Make every rank hold exactly G micro-batches in every step. Only the last step can be short; its
    micro-batches are split first (real samples spread over more slots), and slots still empty get a pad
    micro-batch: a repeat of the cheapest sample, trained with zero loss weight."""
    pad = set()
    g = ctx.cfg.grad_accum
    if not steps:
        return pad
    for s, step in enumerate(steps):
        short = any(len(mbs) != g for mbs in step)
        if not short:
            continue
        if s != len(steps) - 1:
            raise RuntimeError(f"planner bug: step {s} is short but not last")
        # Redistribute the step's micro-batches so each rank has at most G, then split and pad.
        flat = [mb for mbs in step for mb in mbs]
        flat.sort(key=ctx.mb_ms, reverse=True)
        new = _lpt_micro_batches(flat, len(step), g, ctx)
        _fill_slots(new, g)
        cheapest = min(keep, key=lambda i: (ctx.gpu[i], i))
        for k, mbs in enumerate(new):
            while len(mbs) < g:
                pad.add((s, k, len(mbs)))
                mbs.append([cheapest])
        steps[s] = new
    return pad
