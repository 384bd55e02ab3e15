"""The packed policy's second opinions (schedule/policies/packed_redeal.py): a short last step folded into the steps
before it, uneven steps packed anew with the next; plans stay valid and predict less wall time."""
import dataclasses

import pytest

from ds_adaptiveload.schedule.bound import check_plan
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.policies import packed, packed_redeal
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "configs/profiles/h200-wan1.3b-zero3.yaml"
CLIP = 75600  # one 81x720x1280 clip; memory.sample_tokens is 93


def plan(mix, n, ranks, clips, g):
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=clips * CLIP + 93)
    p = make_plan(make_mix(mix, n), profile, PlanConfig("packed", ranks, grad_accum=g, lockstep=True))
    check_plan(p, profile)  # coverage exactly once, G micro-batches a rank, the budget, the predicted times
    return p


def test_a_short_last_step_is_folded_into_the_steps_before(monkeypatch):
    """image-heavy at memory for three 720p clips, 64 ranks, G = 4: four steps' worth of samples; without the fold
    a fifth step of a few images pays 256 micro-batch floors."""
    folded = plan("image-heavy", 20000, 64, 3, 4)
    assert len(folded.steps) == folded.bound["steps_min"] == 4
    assert folded.summary()["bound_gap"] < 0.001
    monkeypatch.setattr(packed_redeal, "FOLD_STEPS", 0)
    kept = plan("image-heavy", 20000, 64, 3, 4)
    assert len(kept.steps) == 5 and kept.summary()["bound_gap"] > 0.01
    assert sum(folded.pred_wall_ms) < sum(kept.pred_wall_ms)


def test_uneven_steps_packed_anew_with_the_next(monkeypatch):
    """The bimodal world-model mix at one clip per micro-batch, 8 ranks, G = 4: long windows among short clips leave
    rounds uneven; repacking such a step with the next predicts less wall time, and changes only some steps (the
    class-mixing swaps after it, which move micro-batches between any steps, left out)."""
    monkeypatch.setattr(packed, "even_mix", lambda steps, *_: steps)
    redealt = plan("worldmodel", 6000, 8, 1, 4)
    monkeypatch.setattr(packed_redeal, "REDEAL_ABOVE", float("inf"))
    kept = plan("worldmodel", 6000, 8, 1, 4)
    assert sum(redealt.pred_wall_ms) < sum(kept.pred_wall_ms)
    same = sum(a == b for a, b in zip(redealt.steps, kept.steps))
    assert 0 < same < len(kept.steps)


@pytest.mark.parametrize("lockstep", [True, False])
def test_second_opinions_keep_plans_valid_and_deterministic(lockstep):
    profile = dataclasses.replace(CostProfile.load(PROFILE), budget_tokens=2 * CLIP + 93)
    samples = make_mix("video-heavy", 3000)
    cfg = PlanConfig("packed", 8, grad_accum=2, lockstep=lockstep)
    a, b = make_plan(samples, profile, cfg), make_plan(samples, profile, cfg)
    check_plan(a, profile)
    assert a.steps == b.steps
