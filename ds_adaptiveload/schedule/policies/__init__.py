"""Scheduling policies: each turns an epoch's samples into steps of per-rank micro-batches (pure Python, no torch).

REGISTRY is the one list of policy names: PlanConfig's check, the config schema, the plan and dataset-report
commands and the planner's property tests read it. A policy is a module here with a function
`steps(keep, ctx, rng) -> steps[step][rank] -> [micro-batch, ...]` and one line below. The planner
(schedule/planner.py) imports this registry; nothing here imports the planner.
"""
from dataclasses import dataclass
from typing import Callable, Optional

from ds_adaptiveload.schedule.policies import balanced, buckets, packed
from ds_adaptiveload.schedule.policies.common import Ctx


@dataclass(frozen=True)
class Policy:
    steps: Callable
    """steps(keep, ctx, rng): the epoch's steps of the kept sample indices (the last may be short: the planner
    fills it to G micro-batches per rank)."""
    ctx: type = Ctx
    """The context the policy plans with: common.Ctx, or packed.PackedCtx for micro-batches of mixed shapes."""
    cap_of: Optional[Callable] = None
    """cap_of(keep, ctx, seed): the memory a micro-batch may fill, in tokens (packed.pack_cap); None: the
    profile's budget."""
    dual_cap: bool = False
    """One-shape micro-batch sizes are also capped by the compute constraint B * S^p <= M_comp."""


REGISTRY = {
    "balanced": Policy(balanced.balanced_steps),
    "dual": Policy(buckets.bucket_steps, dual_cap=True),
    "equal-tokens": Policy(buckets.bucket_steps),
    "packed": Policy(packed.packed_steps, packed.PackedCtx, packed.pack_cap),
}
POLICIES = tuple(REGISTRY)
