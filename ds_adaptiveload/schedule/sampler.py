"""The sampler: this rank's share of the epoch plan, resumable mid-epoch.

Every rank computes the same plan (a pure function of samples, profile, config, seed and epoch) and keeps
its own rows, so ranks agree without communication. Torch-free: a DataLoader can take `iter_micro()` as
its batch_sampler (lists of sample indices) while the trainer reads the step structure from `__iter__`.
"""
import hashlib
from array import array
from dataclasses import dataclass

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.planner import Plan, PlanConfig, make_plan


@dataclass
class StepBatch:
    step: int
    """Index of the optimizer step within the epoch."""
    micro_batches: list
    """This rank's G micro-batches, each a list of sample indices of one shape (packed: of several shapes,
    samples of one shape contiguous)."""
    pad: list
    """Per micro-batch: True if it only repeats a sample to keep ranks in lockstep (zero loss weight)."""
    pred_ms: list
    """Predicted compute ms of every data-parallel rank in this step."""
    pred_wall_ms: float
    """Predicted wall ms of the step (Plan.pred_wall_ms: lockstep-aware)."""
    global_samples: int
    """Real (non-pad) samples in this step over all data-parallel ranks: the loss normaliser."""
    all_micro_batches: list
    """Every data-parallel rank's micro-batches of this step (the plan's row, the same on every rank), for
    settings all ranks must agree on without communication (the ZeRO-3 checkpoint count, trainer.py)."""


def fingerprint(samples) -> str:
    """Identifies the manifest content the plan depends on (ids and shapes, in order)."""
    h = hashlib.sha1()
    for s in samples:
        h.update(f"{s.id}\0{s.frames}\0{s.height}\0{s.width}\n".encode())
    return h.hexdigest()


def plan_digest(plan) -> str:
    """Identifies a plan's micro-batches (every rank's, in order, and the pads)."""
    h = hashlib.sha1()
    for step in plan.steps:
        for mbs in step:
            for mb in mbs:
                h.update(array("q", mb).tobytes())
                h.update(b"|")
            h.update(b"/")
    h.update(repr(sorted(plan.pad)).encode())
    return h.hexdigest()


_STATE_KEYS = {"version", "epoch", "next_step", "seed", "policy", "world_size", "sp", "grad_accum",
               "lockstep", "num_samples", "fingerprint"}
# States written before 2026-12-02 have no "plan" (the digest of the epoch's plan): they load unchecked.
_OPTIONAL_KEYS = {"plan"}


class AdaptiveSampler:
    def __init__(self, samples, profile, cfg: PlanConfig, dp_rank: int):
        if not 0 <= dp_rank < cfg.dp_size:
            raise UserError(f"dp_rank {dp_rank} out of range for data-parallel size {cfg.dp_size}")
        self.samples, self.profile, self.cfg, self.dp_rank = samples, profile, cfg, dp_rank
        self.epoch = 0
        self.next_step = 0
        self._plan = None
        self._fingerprint = None
        self._digest = None  # plan_digest of self._plan

    # -- plan --------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.next_step, self._plan, self._digest = epoch, 0, None, None

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = make_plan(self.samples, self.profile, self.cfg, self.epoch)
        return self._plan

    def __len__(self) -> int:
        return len(self.plan.steps)

    def step_batch(self, step: int) -> StepBatch:
        plan, r = self.plan, self.dp_rank
        mbs = plan.steps[step][r]
        pad = [(step, r, m) in plan.pad for m in range(len(mbs))]
        total = sum(len(mb) for k, rank_mbs in enumerate(plan.steps[step]) for m, mb in enumerate(rank_mbs)
                    if (step, k, m) not in plan.pad)
        return StepBatch(step, mbs, pad, list(plan.pred_ms[step]), plan.pred_wall_ms[step], total, plan.steps[step])

    def __iter__(self):
        """Yields this rank's steps from `next_step` on; `next_step` advances as steps are handed out."""
        while self.next_step < len(self):
            batch = self.step_batch(self.next_step)
            self.next_step += 1
            yield batch

    def iter_micro(self):
        """Flat micro-batches (lists of sample indices) in training order, for a DataLoader batch_sampler.
        Iterates from `next_step` without moving it: the trainer owns the position."""
        for step in range(self.next_step, len(self)):
            yield from self.plan.steps[step][self.dp_rank]

    # -- resume ------------------------------------------------------------------------------------
    def state_dict(self, next_step: int = None) -> dict:
        """Plain dict. Pass `next_step` (the first step not yet trained) when a prefetching loader runs
        ahead of training; it defaults to the sampler's own position."""
        return {"version": 1, "epoch": self.epoch, "next_step": self.next_step if next_step is None else next_step,
                **self._layout(), "plan": self._plan_digest()}

    def _plan_digest(self) -> str:
        """plan_digest of this epoch's plan, computed once per epoch."""
        if self._digest is None:
            self._digest = plan_digest(self.plan)
        return self._digest

    def _layout(self) -> dict:
        """What fixes the samples of a position: manifest, seed, layout."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.samples)
        c = self.cfg
        return {"seed": c.seed, "policy": c.policy, "world_size": c.world_size, "sp": c.sp, "grad_accum": c.grad_accum,
                "lockstep": c.lockstep, "num_samples": len(self.samples), "fingerprint": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Restores the position; refuses a state from a different manifest, seed or layout, or (mid-epoch)
        one whose epoch was planned differently (other planner settings or version), since the same position
        would then mean different samples."""
        if not isinstance(state, dict):
            raise UserError(f"sampler state must be a dict, got {type(state).__name__}")
        extra, missing = set(state) - _STATE_KEYS - _OPTIONAL_KEYS, _STATE_KEYS - set(state)
        if extra or missing:
            raise UserError(f"sampler state: unexpected keys {sorted(extra)}, missing keys {sorted(missing)}")
        mine = self._layout()
        diff = [k for k in mine if state[k] != mine[k]]
        if diff:
            raise UserError("sampler state does not match this run: " +
                            ", ".join(f"{k} saved {state[k]!r} now {mine[k]!r}" for k in diff))
        self.set_epoch(state["epoch"])
        if not 0 <= state["next_step"] <= len(self):
            raise UserError(f"sampler state: next_step {state['next_step']} outside 0..{len(self)}")
        if state["next_step"] and "plan" in state and state["plan"] != self._plan_digest():
            raise UserError(
                f"sampler state: epoch {self.epoch} was planned differently when this state was saved (same "
                f"manifest, seed and layout, but other adaptive_load settings or another ds_adaptiveload version), "
                f"so resuming at step {state['next_step']} would skip or repeat samples; resume with the settings "
                f"and version that saved it, or from a checkpoint taken at an epoch's start")
        self.next_step = state["next_step"]
