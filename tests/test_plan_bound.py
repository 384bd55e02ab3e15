"""The lower bound holds for every policy and baseline and is reached where it should be; the baselines pass
the same checker as the policies."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _toy_profile(**kw):
    """Cost = tokens/1000 + (tokens/1000)^2 ms per sample: a 6,000-token sample costs 42, ten 1,000-token ones 20."""
    return CostProfile(fixed_ms=kw.pop("fixed_ms", 0.0), per_token_ms=1e-3, per_token_sq_ms=1e-6,
                       budget_tokens=kw.pop("budget_tokens", 10_000), **kw)


def test_forced_idle_makes_the_bound_exact_where_big_samples_leave_a_round_part_full():
    """4 ranks, G = 1, 5 samples of 6,000 tokens (over half the memory: one per micro-batch) and 70 of 1,000. The
    best plan is a round of four big ones (42), a round of the fifth beside three full micro-batches of small ones
    (42, three ranks idle 22 each) and a round of small ones (20): 104 + 3 steps' fixed cost. The work over the
    ranks alone says 87.5 and the costliest samples per round 86; the three forced idle slots make it 104."""
    profile = _toy_profile(step_fixed_ms=5.0)
    b = lower_bound([6000] * 5 + [1000] * 70, profile, PlanConfig("packed", 4, lockstep=True))
    assert b["steps_min"] == 3 and b["binds"] == "work"
    assert b["wall_s"] == pytest.approx((104 + 3 * 5) / 1000, rel=1e-12)
    assert b["heaviest_s"] == pytest.approx((86 + 15) / 1000, rel=1e-12)
    # without lockstep a step's micro-batches need not wait for each other's rounds: no forced idle counted
    free = lower_bound([6000] * 5 + [1000] * 70, profile, PlanConfig("packed", 4, lockstep=False))
    assert free["work_s"] == pytest.approx((87.5 + 15) / 1000, rel=1e-12)
    # a multiple of the ranks leaves no slot idle
    full = lower_bound([6000] * 4 + [1000] * 70, profile, PlanConfig("packed", 4, lockstep=True))
    assert full["work_s"] == pytest.approx(((4 * 42 + 70 * 2) / 4 + 15) / 1000, rel=1e-12)


@st.composite
def _random_lockstep_plans(draw):
    """Samples, a profile, (R, G) and a plan of them under lockstep built at random (first-fit of a shuffled
    order, then micro-batches in random or costliest-first order, rounds and the last step topped up with pads
    of single samples): its predicted wall in ms by the same rules as the planner's."""
    sizes = draw(st.lists(st.sampled_from([500, 1000, 1500, 3000, 4000, 5200, 6000, 8000, 12_000]), min_size=1,
                          max_size=40))
    profile = _toy_profile(fixed_ms=draw(st.sampled_from([0.0, 3.0])),
                           step_fixed_ms=draw(st.sampled_from([0.0, 7.0])),
                           floor_ms=draw(st.sampled_from([0.0, 0.0, 9.0])),
                           sample_tokens=draw(st.sampled_from([0, 40])),
                           budget_tokens=draw(st.sampled_from([6000, 10_000, 13_000])))
    r, g = draw(st.integers(2, 6)), draw(st.integers(1, 3))
    order = draw(st.permutations(range(len(sizes))))
    mbs = []
    used = lambda mb: sum(profile.mem_tokens(sizes[j]) for j in mb)  # noqa: E731
    for i in order:  # first fit; a sample over the budget runs alone
        m = profile.mem_tokens(sizes[i])
        fit = next((mb for mb in mbs if used(mb) + m <= profile.budget_tokens), None)
        if fit is None:
            mbs.append([i])
        else:
            fit.append(i)
    cost = [profile.packed_ms([sizes[j] for j in mb]) for mb in mbs]
    if draw(st.booleans()):
        cost.sort(reverse=True)
    else:
        cost = [cost[k] for k in draw(st.permutations(range(len(cost))))]
    pad = [profile.packed_ms([sizes[draw(st.integers(0, len(sizes) - 1))]]) for _ in range(-len(cost) % (r * g))]
    cost += pad
    rounds = [max(cost[k:k + r]) for k in range(0, len(cost), r)]
    wall = len(cost) // (r * g) * profile.step_fixed_ms + sum(rounds)
    return sizes, profile, r, g, wall


@settings(max_examples=300, deadline=None)
@given(_random_lockstep_plans())
def test_no_random_lockstep_plan_beats_the_bound(case):
    sizes, profile, r, g, wall = case
    b = lower_bound(sizes, profile, PlanConfig("packed", r, grad_accum=g, lockstep=True))
    assert wall / 1000 >= b["wall_s"] * (1 - 1e-9), b
