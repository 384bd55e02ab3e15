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
shape, which fill whole rounds (heavy_mix shortens them, leaving a heavy round's other slots to light samples).

When a slot holds only a few samples (memory for about one long clip), no sand is fine enough to even the
slots out. Light samples then come in runs of R of one token count too (`replicate`): LPT deals the R samples
of a run one to each slot of a round, so the slots of a round hold copies of one mix of token counts and cost
exactly the same. A slot that memory fills with small samples far below its round's cost gives all but its
costliest back and is filled anew with larger ones (packed_slots.py, _densify).

Pure Python, no torch: a function of (samples, profile, config, epoch), like the other policies.

Here: the target cost, heavy samples, the micro-batch cap and the epoch's loop over steps. The stream and the
drawing of a step's samples are in packed_stream.py; packing a step into slots and evening its rounds in
packed_slots.py.
"""
import math
import random
from dataclasses import dataclass
from itertools import repeat
from operator import gt


from ds_adaptiveload.schedule.policies.common import Ctx
from ds_adaptiveload.schedule.policies.packed_mix import even_mix
from ds_adaptiveload.schedule.policies.packed_redeal import refine
from ds_adaptiveload.schedule.policies.packed_slots import pack_step, sample_cols, step_rounds
from ds_adaptiveload.schedule.policies.packed_stream import Drawer, epoch_stream, light_of, light_sums, slot_units

# Average fill of a slot's memory that sets the target cost T; the rest is room for the packing to even out
# costs (0.86 and 0.97 predicted more wall time on video-heavy with memory for one 720p clip).
PACK_FILL = 0.92
# A sample costing more than this fraction of T on its own is heavy (it cannot be evened out with sand).
HEAVY_FRAC = 0.75
# replicate=None: light samples come in runs of R when a slot holds fewer than this many on average. At
# memory for one 720p clip (4.7 video-heavy samples a slot, 9.2 image-heavy) runs cut the predicted idle
# 0.17-0.38% -> 0.00-0.17% at 8 and 64 ranks, and the wall time with it; with 20 or more a slot the sand
# evens slots out already and runs only coarsen the steps' mix (docs/history/benchmarks.md, eighth session).
REPLICA_BELOW = 10
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
        # Per distinct length (samples are many, lengths few), as floats. A list of the shared objects, not an array:
        # as large (a pointer a sample), and read without making a float each time; the planner reads these
        # columns at random places millions of times.
        mem = {g: float(prof.mem_tokens(g)) for g in set(self.gpu)}
        self.mem = list(map(mem.__getitem__, self.gpu))
        # The compute cap sum(S_i^p) <= M_comp applies only when the profile states one.
        self.dual = (prof.dual_p, prof.dual_m_comp) if prof.dual_p is not None else None
        p = self.dual[0] if self.dual else 1.0
        self.comp = list(map({g: float(g ** p) for g in mem}.__getitem__, self.gpu)) if self.dual else None
        self.budget = self.profile.budget_tokens  # a micro-batch's memory, in tokens: pack_cap may lower it
        # Micro-batches repeat (a round's slots are copies under replicate, shapes are few): cost each sequence of
        # per-GPU tokens once. Keyed by the sequence, not its multiset, so the float sum is the uncached one.
        self._packed_ms = {}
        # Every block checkpointed and nothing offloaded: a micro-batch costs its profile time, so mb_ms is base_ms
        # (the planner costs every micro-batch three or four times over: 1M samples make 600,000 of them).
        if self.recompute is None and self.fixed_offload is None:
            self.mb_ms = self.base_ms

    def base_ms(self, mb, ks=None):
        """The profile's time for micro-batch mb packed, every block checkpointed (ks: unused, so that base_ms can
        stand in for mb_ms, which takes it)."""
        # (most micro-batches hold one sample where memory holds one clip: its key without the map)
        key = (self.gpu[mb[0]],) if len(mb) == 1 else tuple(map(self.gpu.__getitem__, mb))
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
    light_units = slot_units(light_sums(keep, ctx, heavy), scale)
    n_heavy = sum(1 for i in keep if heavy[i])
    replicate = ctx.cfg.replicate
    if replicate is None:
        replicate = r > 1 and len(keep) - n_heavy < REPLICA_BELOW * light_units
    # heavy_mix: heavy runs shorter than R, so a heavy round leaves slots to light samples (steps closer to the
    # data's mix, at the idle of rounds that no longer hold copies); light runs stay R, as replicate wants.
    heavy_run = max(1, r - round(ctx.cfg.heavy_mix * r))
    stream, runs, cont = epoch_stream(keep, ctx, rng, heavy, r, replicate, heavy_run)
    draw = Drawer(stream, runs, cont, ctx, heavy, scale, slots)
    units = n_heavy + light_units
    per_step = units / max(1, math.ceil(units / slots))
    steps, carry = [], []
    while not draw.done() or carry:
        # Step s ends where the stream's cumulative slots reach (s + 1) * per_step: a step's overshoot (its
        # last sample) is taken from the next one, so the epoch does not end on a small remainder.
        cand = draw.step(carry, (len(steps) + 1) * per_step)
        sl, carry = pack_step(cand, ctx, slots)
        steps.append(step_rounds(sl, ctx, r, draw, carry, replicate))
    return even_mix(refine(steps, ctx, r, g), ctx, r, g)


def _target(keep, ctx, fill):
    """Target cost T of a slot: the cost of `fill` of a slot's memory (and compute cap) at the data's average
    cost per token of memory, over the samples that are not heavy; and which samples are heavy at that T."""
    cost, mem = ctx.cost, ctx.mem
    heavy = bytearray(len(cost))
    t = None
    for _ in range(2):  # T over all samples, then over the light ones at that T
        light = light_of(keep, heavy) or keep
        c = sum(map(cost.__getitem__, light))
        t = fill * ctx.budget * c / max(sum(map(mem.__getitem__, light)), 1e-12)
        if ctx.dual:
            t = min(t, fill * ctx.dual[1] * c / max(sum(map(ctx.comp.__getitem__, light)), 1e-12))
        limit = HEAVY_FRAC * t
        if len(keep) == len(cost):  # every sample (keep ascends, no repeats): one pass in C
            heavy[:] = bytes(map(gt, cost, repeat(limit)))
        else:
            for i in keep:
                heavy[i] = cost[i] > limit
    return t, heavy


def _scales(ctx, target, fill):
    """Divisors turning a step's sums (cost, memory, compute) into slots; without a compute cap the third
    column repeats memory."""
    mem = fill * ctx.budget
    return [target, mem, fill * ctx.dual[1] if ctx.dual else mem]
