"""Digests of dumped plans over a grid of configs: the scheduler's output, frozen before the layout move
(issue #17), so a refactor that changes any plan fails tests/test_plan_digests.py. The packed policy has a grid
of its own (replicate on and off, pack_tokens null and auto), under lockstep as ZeRO-2/3 run it.
Regenerate only for an intended plan change:  python tests/plan_digests.py --write"""
import dataclasses
import hashlib
import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE = os.path.join(ROOT, "tests", "data", "plan_digests.json")
PROFILE = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")
GRID = {"policy": ("equal-tokens", "dual", "balanced"), "world_size": (2, 8, 64), "grad_accum": (1, 4),
        "lockstep": (False, True)}
PACKED_GRID = {"policy": ("packed",), "world_size": (2, 8, 64), "grad_accum": (1, 4), "lockstep": (True,),
               "replicate": (True, False), "pack_tokens": (None, "auto")}
# ... and at memory for one 720p clip (75,600 tokens + sample_tokens), where samples are heavy and come in runs
ONE_CLIP_GRID = {**PACKED_GRID, "pack_tokens": (None,), "budget_tokens": (75693,)}
SAMPLES = 3000  # video-heavy: enough for 64 ranks x G = 4 to hold several steps


def grid():
    for g in (GRID, PACKED_GRID, ONE_CLIP_GRID):
        keys = list(g)
        for values in itertools.product(*(g[k] for k in keys)):
            yield dict(zip(keys, values))


def digest(plan, samples) -> str:
    """sha256 of the --dump lines (step, rank, micro, ids, pad) of a plan."""
    from ds_adaptiveload.plan_cli import dump_lines

    h = hashlib.sha256()
    for line in dump_lines(plan, samples):
        h.update(line.encode())
    return h.hexdigest()


def compute() -> dict:
    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
    from ds_adaptiveload.schedule.profile import CostProfile

    profile = CostProfile.load(PROFILE)
    samples = make_mix("video-heavy", SAMPLES, seed=0)
    out = {}
    for cfg in grid():
        args = {k: v for k, v in cfg.items() if k != "budget_tokens"}
        prof = dataclasses.replace(profile, budget_tokens=cfg["budget_tokens"]) if "budget_tokens" in cfg else profile
        plan = make_plan(samples, prof, PlanConfig(seed=0, **args), epoch=1)
        out[json.dumps(cfg, sort_keys=True)] = digest(plan, samples)
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    with open(STORE, "w") as f:
        json.dump(compute(), f, indent=1, sort_keys=True)
