"""The packed policy's class-mixing swaps (schedule/policies/packed_mix.py): steps come closer to the epoch's class
shares (mix_tv), no step's predicted wall time rises, and the plan stays valid."""
import dataclasses

import pytest

from ds_adaptiveload.schedule.bound import check_plan
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.policies import packed
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "configs/profiles/h200-wan1.3b-zero3.yaml"
CLIP = 75600  # one 81x720x1280 clip; memory.sample_tokens is 93


def plans(monkeypatch, mix, n, ranks, g, lockstep=True):
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=CLIP + 93)
    cfg = PlanConfig("packed", ranks, grad_accum=g, lockstep=lockstep)
    mixed = make_plan(make_mix(mix, n), profile, cfg)
    check_plan(mixed, profile)  # coverage exactly once, G micro-batches a rank, the budget, the predicted times
    with monkeypatch.context() as m:
        m.setattr(packed, "even_mix", lambda steps, *_: steps)
        kept = make_plan(make_mix(mix, n), profile, cfg)
    eq = make_plan(make_mix(mix, n), profile, dataclasses.replace(cfg, policy="equal-tokens"))
    return mixed, kept, eq


@pytest.mark.parametrize("mix,g", [("openvid-720p", 4), ("panda-web", 1)])
def test_swaps_lower_mix_tv_and_raise_no_step(monkeypatch, mix, g):
    """One clip of memory, 16 ranks: runs of R copies make steps of one kind; the swaps mix them. Under lockstep
    round swaps keep the epoch's wall time, micro-batch swaps keep every step's at most what it was."""
    mixed, kept, eq = plans(monkeypatch, mix, 3000, 16, g)
    assert mixed.summary()["mix_tv"] < kept.summary()["mix_tv"] - 0.01
    assert sum(mixed.pred_wall_ms) <= sum(kept.pred_wall_ms) * (1 + 1e-9)
    if g == 1:  # a step is one round: only micro-batch swaps, each step's wall at most what it was
        assert all(a <= b * (1 + 1e-9) for a, b in zip(mixed.pred_wall_ms, kept.pred_wall_ms))
    else:  # rounds of several steps mixed: steps as close to the data as random dealing's, or closer
        assert mixed.summary()["mix_tv"] <= eq.summary()["mix_tv"]
    assert sorted(map(sorted, (mb for st in mixed.steps for mbs in st for mb in mbs))) == \
        sorted(map(sorted, (mb for st in kept.steps for mbs in st for mb in mbs)))  # whole micro-batches moved


def test_without_lockstep_steps_are_kept(monkeypatch):
    """Without lockstep a step costs its slowest rank, and rank totals are what packed evens out: no swaps."""
    mixed, kept, _ = plans(monkeypatch, "video-heavy", 3000, 16, 4, lockstep=False)
    assert mixed.steps == kept.steps
