"""Epoch planning: turn samples of very different token counts into per-rank micro-batches.

Pure Python (no torch, no process groups): every rank runs the same deterministic function of
(samples, profile, config, epoch) and takes its own share, so no communication is needed.

A plan is `steps[step][rank] -> [micro-batch, ...]` with exactly G micro-batches per rank per step (under
ZeRO-3 every forward all-gathers parameters, so ranks must run the same number of them), each micro-batch a
list of sample indices of one shape (no padding inside a micro-batch) whose per-GPU tokens fit M_mem; with
`packed` a micro-batch may hold several shapes (samples of one shape contiguous), its samples' tokens in M_mem.

Policies (one module each in schedule/policies/, named in its REGISTRY):
- equal-tokens (buckets.py): bucket by shape, B = floor(M_mem / S), shuffle micro-batches, deal them round-robin.
  What token-capped loaders (DeepSpeed dynamic batching, bucket loaders) do; the baseline.
- dual (buckets.py): the same with B also capped by the paper's compute constraint B * S^p <= M_comp.
- balanced (balanced.py): both caps, then balance every step. With G >= 2, each step draws a stratified slice of the
  epoch (every shape in proportion, so the step looks like the data) and packs its samples onto ranks by
  LPT (longest first to the least-loaded rank that has a free slot or an open micro-batch of that shape);
  images and short clips are the fine-grained filler that evens the totals. With G = 1 a rank runs one
  single-shape micro-batch per step, so balance requires steps of similar micro-batches: micro-batches are
  sorted by cost within a window of steps (`window`, default the whole epoch) and step order is shuffled.
  That trades step composition (mix_tv) for balance; a smaller window trades back.
- packed (packed.py): micro-batches of mixed shapes, every micro-batch of a step at about the same predicted cost,
  steps drawn from the stratified stream (so they look like the data), at any G.
"""
import gc
import random
from array import array
from contextlib import contextmanager
from itertools import chain
from operator import attrgetter
from dataclasses import dataclass

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.bound import lower_bound
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.offload import parse_setting
from ds_adaptiveload.schedule.policies import POLICIES, REGISTRY, Policy  # noqa: F401 (planner.POLICIES: the names)
from ds_adaptiveload.schedule.policies.baselines import BASELINES
from ds_adaptiveload.schedule.policies.common import CLASS_BOUNDS, fill_slots, lpt_micro_batches, token_class
from ds_adaptiveload.schedule.policies.packed import PackedCtx

CHECKPOINT_MODES = ("all", "auto", "auto-step")


@dataclass
class PlanConfig:
    policy: str = "packed"
    """packed (micro-batches of mixed shapes; needs the packed model) | balanced | dual | equal-tokens
    (policies.REGISTRY)."""
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
    (None: the better of policies.balanced.FILL_CHOICES by predicted wall time on a prefix of the epoch). packed:
    the average fraction of a micro-batch's memory that sets its target cost (None: policies.packed.PACK_FILL)."""
    lockstep: bool = False
    """Ranks wait for each other at every micro-batch, not only at the optimizer step: true under ZeRO-3
    (parameter all-gathers in every forward and backward) and ZeRO-2 (gradient reduce-scatter in every
    backward). A step then costs the sum over its G micro-batch rounds of the slowest rank's micro-batch."""
    replicate: bool = None
    """packed: light samples too in runs of R of one shape, so that the micro-batches of a round are copies
    (None: when a micro-batch holds fewer than packed.REPLICA_BELOW light samples on average)."""
    checkpoint: str = "all"
    """What the trainer checkpoints: all (every block, as calibrate measures: costs as the profile says) | auto
    (--checkpoint-blocks auto: each micro-batch only the blocks its memory needs, so it skips the rest's
    recompute) | auto-step (the same with the step's largest count on every micro-batch, as under ZeRO-3).
    auto costs micro-batches with schedule/memory.RecomputeCost, when the profile can say (else as all)."""
    checkpoint_policy: str = "full"
    """full | attention (--checkpoint-policy): with auto, what a checkpointed block keeps (RecomputeCost)."""
    pack_tokens: object = None
    """packed: the memory a micro-batch may fill, in tokens: None (the profile's budget) | an int (at most the
    budget; a sample over it runs alone) | "auto" (the cap with the least predicted time per token, packed.pack_cap:
    with checkpoint auto, smaller micro-batches leave blocks open and skip their recompute)."""

    activation_offload: object = "off"
    """off | auto | an int n >= 0 (adaptive_load.activation_offload; 0 is off): micro-batches are costed with the
    recompute that offloading checkpointed blocks' inputs saves and the host-copy time it does not hide
    (schedule/offload.py); "auto" needs checkpoint auto or auto-step."""
    heavy_mix: float = 0.0
    """packed: the fraction of each heavy round's slots (a round of clips that fill a micro-batch alone) left to
    light samples (images, short clips), so that the steps that hold heavy clips hold the data's other samples
    too: steps closer to the data's composition (lower mix_tv), at more idle. 0: heavy clips in runs of R, which
    fill whole rounds (the best balance); in [0, 1)."""

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("world_size", "sp", "grad_accum"):
            positive(name)
        if self.policy not in REGISTRY:
            raise UserError(f"policy must be one of {', '.join(REGISTRY)}, got {self.policy!r}")
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
        if self.replicate not in (None, True, False):
            raise UserError(f"replicate must be true, false or null, got {self.replicate!r}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise UserError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}")
        if self.checkpoint_policy not in ("full", "attention"):
            raise UserError(f"checkpoint-policy must be full or attention, got {self.checkpoint_policy!r}")
        check_pack_tokens(self.pack_tokens, "pack-tokens")
        self.activation_offload = parse_setting(self.activation_offload, "activation-offload")
        if not isinstance(self.heavy_mix, (int, float)) or isinstance(self.heavy_mix, bool) \
                or not 0 <= self.heavy_mix < 1:
            raise UserError(f"heavy-mix must be a number in [0, 1), got {self.heavy_mix!r}")
        for name, unset in (("pack-tokens", None), ("heavy-mix", 0.0)):
            if getattr(self, name.replace("-", "_")) != unset and self.policy != "packed":
                raise UserError(f"{name} applies to the packed policy only (policy is {self.policy!r})")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp


def check_pack_tokens(v, name) -> None:
    """None, "auto" or a positive int, else a UserError naming `name`."""
    if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        return
    raise UserError(f"{name} must be a positive integer, \"auto\" or null, got {v!r}")


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
    pack_tokens: int = None
    """packed: the memory a micro-batch was filled to, in tokens (PlanConfig.pack_tokens resolved)."""
    bound: dict = None
    """bound.lower_bound of the planned samples: the least predicted wall time any plan of them can have."""
    mb_ms: list = None
    """mb_ms[step] -> predicted ms of the step's micro-batches, rank after rank (an array: micro_batch_ms reads it)."""

    def micro_batch_ms(self, step: int) -> list:
        """[dp_rank][g] -> predicted ms of each micro-batch of the step (its pred_ms less the profile's step_fixed_ms,
        by micro-batch): what a replay of the plan compares its measured times with (bench/e2e/replay.py)."""
        flat, out, at = self.mb_ms[step], [], 0
        for mbs in self.steps[step]:
            out.append(list(flat[at:at + len(mbs)]))
            at += len(mbs)
        return out

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
            "pack_tokens": self.pack_tokens,
            "lower_bound_s": self.bound["wall_s"] if self.bound else None,
            "bound_binds": self.bound["binds"] if self.bound else None,
            "bound_gap": sum_max / 1000 / self.bound["wall_s"] - 1 if self.bound and self.bound["wall_s"] else None,
        }


def mix_tv(plan: Plan) -> float:
    """Mean over steps of the total-variation distance between the step's class shares (by sample
    count) and the epoch's: 0 when every step looks like the data, up to 1 when steps are single-class."""
    classes = bytes(map({t: token_class(t) for t in set(plan.tokens)}.__getitem__, plan.tokens))
    ncls = len(CLASS_BOUNDS) + 1
    epoch = [0] * ncls
    per_step = []
    for s, step in enumerate(plan.steps):
        ids = [i for r, mbs in enumerate(step) for m, mb in enumerate(mbs) if (s, r, m) not in plan.pad for i in mb]
        step_classes = bytes(map(classes.__getitem__, ids))
        counts = [step_classes.count(c) for c in range(ncls)]
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
    return plan_with(samples, profile, cfg, epoch, REGISTRY[cfg.policy])


def baseline_plan(name, samples, profile, cfg: PlanConfig, epoch=0) -> Plan:
    """The best plan of baseline `name` (policies/baselines.py) over its tuning knob by predicted wall time: the
    same data and cost model as the policies, so the tuning is the baseline's best."""
    cfg = PlanConfig("equal-tokens", cfg.world_size, cfg.sp, cfg.grad_accum, cfg.seed, cfg.on_oversize,
                     lockstep=cfg.lockstep)
    maker, knobs = BASELINES[name]
    plans = [plan_with(samples, profile, cfg, epoch,
                       Policy(lambda keep, ctx, rng, k=k: maker(keep, ctx, rng, k), PackedCtx)) for k in knobs]
    return min(plans, key=lambda p: sum(p.pred_wall_ms))


def pack_cost(profile, shapes, sp: int = 1) -> tuple:
    """(predicted fwd+bwd ms, memory in tokens' worth) of one micro-batch of samples of `shapes` ((F, H, W)
    each) at Ulysses degree sp, exactly as the packed policy costs and fills a slot (PackedCtx.mb_ms, the sum of
    PackedCtx.mem): what calibrate's packed validation predicts its measured micro-batches with."""
    full = [profile.geometry.tokens(*sh) for sh in shapes]
    gpu = [per_gpu_tokens(t, sp) for t in full]
    ctx = PackedCtx(profile, PlanConfig("packed", world_size=sp, sp=sp), full, gpu, [tuple(sh) for sh in shapes], {})
    return ctx.mb_ms(range(len(shapes))), sum(ctx.mem)


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off for the block (back on after, if it was). Planning allocates millions of
    small lists and tuples and makes no reference cycles, and every full collection the allocations trigger walks all
    live objects, the manifest's million samples included."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def plan_with(samples, profile, cfg: PlanConfig, epoch, policy: Policy) -> Plan:
    """The plan that `policy.steps(keep, ctx, rng)` makes of the samples: oversize samples set aside, the last step
    filled to G micro-batches per rank, every step costed, the lower bound (schedule/bound.py) attached.
    policy.ctx: the context class (micro-batches of mixed shapes need packed.PackedCtx); policy.cap_of(keep, ctx,
    seed): the memory a micro-batch may fill (packed's pack_cap), else the profile's budget."""
    if not samples:
        raise UserError("no samples to plan")
    full, gpu, shape = _tokens(samples, profile, cfg.sp)
    keep, skipped = _oversize(samples, full, gpu, profile, cfg)
    rng = random.Random(f"{cfg.seed}/{epoch}")
    dual = profile.dual_for(min((gpu[i] for i in keep), default=1), max((gpu[i] for i in keep), default=1))
    cap = _batch_caps(gpu, shape, keep, profile, dual if policy.dual_cap else None)
    ctx = policy.ctx(profile, cfg, full, gpu, shape, cap)
    if policy.cap_of is not None:
        ctx.budget = policy.cap_of(keep, ctx, cfg.seed)
    steps = policy.steps(keep, ctx, rng) if keep else []
    pad = _finish_tail(steps, ctx, keep)
    pred, wall, mb_ms = [], [], []
    for step in steps:
        costs = ctx.step_costs(step)
        ranks, w = ctx.step_pred(step, costs)
        pred.append(ranks)
        wall.append(w)
        mb_ms.append(array("d", chain.from_iterable(costs)))  # 8 bytes a micro-batch: 10M samples plan in 4 GB
    return Plan(steps, pred, pad, skipped, full, cfg, epoch, dual, wall,
                ctx.budget if policy.cap_of is not None else None, lower_bound([gpu[i] for i in keep], profile, cfg),
                mb_ms)


def _tokens(samples, profile, sp):
    """Per-sample full tokens, per-GPU tokens and shape key; the objects are shared per shape (memory)."""
    geo = profile.geometry
    key_of = attrgetter("frames", "height", "width")  # keys are not kept: a tuple a sample is memory
    cache, bad = {}, {}
    for key in set(map(key_of, samples)):  # shapes are few, samples many
        try:
            t = geo.tokens(*key)
        except ValueError as e:
            bad[key] = e
            continue
        cache[key] = (t, per_gpu_tokens(t, sp), key)
    if bad:  # the first sample in manifest order with a bad shape
        s = next(s for s in samples if key_of(s) in bad)
        raise UserError(f"sample {s.id!r}: {bad[key_of(s)]}") from None
    hits = list(map(cache.__getitem__, map(key_of, samples)))
    return [h[0] for h in hits], [h[1] for h in hits], [h[2] for h in hits]


def _oversize(samples, full, gpu, profile, cfg):
    keep, skipped = [], []
    budget = profile.budget_tokens
    fits = {g: profile.mem_batch(g) >= 1 for g in set(gpu)}  # per distinct length: samples are many, lengths few
    if all(fits.values()):
        return list(range(len(gpu))), skipped
    for i, g in enumerate(gpu):
        if fits[g]:
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
                f"sequence-parallel degree that fits it is {k} (it must divide the world size), or set "
                f"adaptive_load.on_oversize to \"skip\" (plan: --on-oversize skip)")
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
        new = lpt_micro_batches(flat, len(step), g, ctx)
        fill_slots(new, g)
        cheapest = min(keep, key=lambda i: (ctx.gpu[i], i))
        for k, mbs in enumerate(new):
            while len(mbs) < g:
                pad.add((s, k, len(mbs)))
                mbs.append([cheapest])
        steps[s] = new
    return pad
