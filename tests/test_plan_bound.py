"""The lower bound holds for every policy and baseline and is reached where it should be; the baselines pass
the same checker as the policies."""
import dataclasses

import pytest

from ds_adaptiveload.schedule.bound import check_plan, lower_bound
from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, baseline_plan, make_plan
from ds_adaptiveload.schedule.policies.baselines import BASELINES
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "configs/profiles/h200-wan1.3b-zero3.yaml"


@pytest.mark.parametrize("mix", ["video-heavy", "worldmodel", "openvid-720p"])
@pytest.mark.parametrize("budget", [75693, 226893])
def test_baselines_pass_the_checker_and_stay_above_the_bound(mix, budget):
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=budget)
    samples = make_mix(mix, 1500, seed=3)
    for g in (1, 3):
        cfg = PlanConfig("packed", 8, grad_accum=g, lockstep=True)
        plans = [baseline_plan(name, samples, profile, cfg) for name in BASELINES]
        plans.append(make_plan(samples, profile, cfg))
        for plan in plans:
            check_plan(plan, profile)
            assert sum(plan.pred_wall_ms) / 1000 >= plan.bound["wall_s"] * (1 - 1e-9)
            assert plan.summary()["bound_gap"] >= -1e-9


def test_bound_is_reached_by_rounds_of_equal_clips():
    """R x G x 5 copies of one clip that fills a micro-batch: every plan is 5 steps of full rounds, which is
    exactly the bound (the heaviest-per-round and work parts agree)."""
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=75693)
    samples = [Sample(f"c{i}", 81, 720, 1280) for i in range(8 * 2 * 5)]
    plan = make_plan(samples, profile, PlanConfig("packed", 8, grad_accum=2, lockstep=True))
    assert plan.bound["steps_min"] == 5
    assert sum(plan.pred_wall_ms) / 1000 == pytest.approx(plan.bound["wall_s"], rel=1e-12)


def test_heaviest_part_binds_when_few_long_clips_meet_many_images():
    """8 long clips and a few images at 64 ranks: the rounds holding the clips cost a clip each, which the
    work over 64 ranks underestimates; the bound says so and no plan goes below it."""
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=75693)
    samples = [Sample(f"c{i}", 81, 720, 1280) for i in range(8)] + [Sample(f"i{i}", 1, 480, 832) for i in range(64)]
    cfg = PlanConfig("packed", 64, grad_accum=1, lockstep=True)
    b = lower_bound([75600] * 8 + [1560] * 64, profile, cfg)
    assert b["binds"] == "heaviest" and b["heaviest_s"] > b["work_s"]
    plan = make_plan(samples, profile, cfg)
    assert sum(plan.pred_wall_ms) / 1000 >= b["wall_s"] * (1 - 1e-12)


def test_bound_is_none_when_checkpointing_changes_costs():
    profile = CostProfile.load(PROFILE)
    assert lower_bound([1560], profile, PlanConfig("packed", 2, checkpoint="auto")) is None


def test_check_plan_catches_a_lost_sample():
    profile = CostProfile.load(PROFILE)
    plan = make_plan(make_mix("video-heavy", 200), profile, PlanConfig("balanced", 2, grad_accum=2))
    mb = next(mb for mb in plan.steps[0][0] if len(mb) > 1)
    mb.pop()
    with pytest.raises(ValueError, match="exactly once|predicted wall"):
        check_plan(plan, profile)
