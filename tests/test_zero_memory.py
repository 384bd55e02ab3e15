"""schedule/zero.py: a profile's memory moved to another ZeRO stage and world size (pure, no torch), and the plan
command planning with it."""
import dataclasses
import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from ds_adaptiveload.calibrate.fit import train_fixed_bytes
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.schedule.zero import ZERO_SHARDED_BYTES, calibrated_for, for_run, state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATED = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")


@pytest.fixture(scope="module")
def z3():
    return CostProfile.load(CALIBRATED)  # ZeRO-3, measured on 1 rank, written for 2


def test_state_bytes_follow_the_zero_papers_accounting():
    P = 1e9
    assert [state_bytes(P, 0, w) for w in (1, 8)] == [16e9, 16e9]
    assert state_bytes(P, 1, 4) == 4e9 + 3e9 and state_bytes(P, 2, 4) == 2e9 + 3.5e9 and state_bytes(P, 3, 4) == 4e9
    assert all(state_bytes(P, s, 1) == 16e9 for s in range(4))  # one rank holds everything whatever the stage
    for bad, msg in (((P, 4, 2), "ZeRO stage"), ((P, 3, 0), "world size"), ((P, 3, True), "world size")):
        with pytest.raises(UserError, match=msg):
            state_bytes(*bad)


def test_moving_the_calibrated_profile_to_one_rank_gives_back_what_calibrate_measured_there(z3):
    """calibrate measured the fixed bytes on one rank and wrote them for 2 (fit.memory): moved back to 1 rank the
    profile's fixed bytes are the measured ones, and the budget shrinks by the difference in tokens' worth."""
    note = z3.fit["memory"]
    assert (note["measured_world_size"], note["train_world_size"]) == (1, 2)
    one, lines = for_run(z3, 3, 1, "p.yaml")
    assert one.memory["fixed_bytes"] == pytest.approx(note["fixed_bytes_measured"], abs=2)
    delta = note["fixed_bytes_measured"] - z3.memory["fixed_bytes"]
    assert one.budget_tokens == pytest.approx(z3.budget_tokens - delta / z3.memory["bytes_per_token"], abs=1)
    assert one.memory["budget_tokens"] == one.budget_tokens
    assert one.meta["train_world_size"] == 1 and one.meta["rescaled_from"]["budget_tokens"] == z3.budget_tokens
    (line,) = lines  # same stage: no warning about the time terms
    assert line.startswith("p.yaml: memory moved from ZeRO-3 on 2 rank(s) to this run's ZeRO-3 on 1")
    assert f"{z3.budget_tokens:,} -> {one.budget_tokens:,} tokens" in line
    assert for_run(z3, 3, 2) == (z3, [])  # the run it was written for: untouched


def test_a_zero2_run_keeps_its_bf16_weights_whole(z3):
    """ZeRO-2 on 8 ranks: 2 bytes per parameter whole on every rank and 14 sharded; the time-terms warning is given."""
    P = z3.meta["model"]["params"]
    eight, (_, warn) = for_run(z3, 2, 8)
    measured_one = z3.fit["memory"]["fixed_bytes_measured"]  # 16 bytes per parameter on its one rank
    assert eight.memory["fixed_bytes"] == pytest.approx(measured_one - 16 * P + 2 * P + 14 * P / 8, abs=2)
    assert "time terms were measured under ZeRO-3" in warn and eight.meta["zero_stage"] == 2
    assert for_run(z3, 3, 8)[0].budget_tokens > eight.budget_tokens  # ZeRO-3 shards the weights too


def test_same_stage_moves_agree_with_calibrates_own_rescaling(z3):
    """calibrate --train-world-size and for_run are one accounting: the same fixed bytes for each stage and size."""
    P = z3.meta["model"]["params"]
    measured = z3.fit["memory"]["fixed_bytes_measured"]
    for stage in (1, 2, 3):
        at_two = dict(z3.meta, zero_stage=stage)
        base = dataclasses.replace(z3, meta=at_two, memory={**z3.memory, "fixed_bytes": train_fixed_bytes(
            measured, P, 1, 2, ZERO_SHARDED_BYTES[stage])})
        for world in (1, 4, 64):
            want = train_fixed_bytes(measured, P, 1, world, ZERO_SHARDED_BYTES[stage])
            assert for_run(base, stage, world)[0].memory["fixed_bytes"] == pytest.approx(want, abs=2)


@settings(max_examples=60, deadline=None)
@given(stage=st.sampled_from([1, 2, 3]), w1=st.integers(1, 1024), w2=st.integers(1, 1024),
       stage2=st.sampled_from([0, 1, 2, 3]))
def test_moves_compose_and_more_ranks_never_shrink_the_budget(stage, w1, w2, stage2):
    """Moving A -> B -> C equals A -> C (within a token of rounding); at one stage the budget never falls as ranks
    are added; and the planner keeps every moved budget (no micro-batch over it)."""
    z3 = CostProfile.load(CALIBRATED)
    a = for_run(z3, stage, w1)[0]
    direct = for_run(z3, stage2, w2)[0]
    via = for_run(a, stage2, w2)[0]
    assert abs(via.budget_tokens - direct.budget_tokens) <= 1
    assert via.memory["fixed_bytes"] == pytest.approx(direct.memory["fixed_bytes"], abs=2)
    lo, hi = sorted((w1, w2))
    assert for_run(z3, stage, lo)[0].budget_tokens <= for_run(z3, stage, hi)[0].budget_tokens


def test_profiles_that_cannot_say_are_left_alone_and_an_impossible_run_is_refused(z3, tmp_path):
    tiny = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"))
    assert calibrated_for(tiny) is None and for_run(tiny, 2, 8) == (tiny, [])
    no_params = dataclasses.replace(z3, meta={**z3.meta, "model": {}})
    assert calibrated_for(no_params) is None
    # as if 20B parameters had been calibrated under ZeRO-3 on 2 ranks: one rank holds 160 GB more than each did
    big = dataclasses.replace(z3, meta={**z3.meta, "model": {"params": 20e9}})
    with pytest.raises(UserError, match=r"p\.yaml: under ZeRO-2 on 1 rank\(s\).*leaves no memory for tokens"):
        for_run(big, 2, 1, "p.yaml")


def test_plan_command_plans_with_the_moved_budget(tmp_path, capsys):
    """`plan --world-size 8` with a 2-rank ZeRO-3 profile plans with the budget moved to 8 ranks (said in an info line, on stdout),
    --zero-stage 2 with ZeRO-2's; the dumps equal make_plan's with for_run's profiles."""
    from ds_adaptiveload.cli import main
    from ds_adaptiveload.plan_cli import dump_lines
    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan

    z3 = CostProfile.load(CALIBRATED)
    samples = make_mix("video-heavy", 400, seed=0)
    for extra, stage in (([], 3), (["--zero-stage", "2"], 2)):
        dump = tmp_path / f"plan{stage}.jsonl"
        assert main(["plan", "--mix", "video-heavy:400", "--profile", CALIBRATED, "--world-size", "8",
                     "--policy", "packed", "--lockstep", "--dump", str(dump), "--json", *extra]) == 0
        out = capsys.readouterr().out
        assert f"to this run's ZeRO-{stage} on 8" in out
        want = make_plan(samples, for_run(z3, stage, 8)[0], PlanConfig(policy="packed", world_size=8, lockstep=True))
        assert dump.read_text() == "".join(dump_lines(want, samples))
    assert main(["plan", "--mix", "video-heavy:50", "--profile", CALIBRATED, "--world-size", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "memory moved" not in out.err and json.loads(out.out.splitlines()[-1])["world_size"] == 2
