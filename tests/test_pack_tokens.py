"""PlanConfig.pack_tokens (adaptive_load.pack_tokens, plan --pack-tokens): packed micro-batches filled to a cap below
the memory budget, and "auto", the cap with the least predicted time per token (schedule/packed.pack_cap)."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.policies import packed
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from test_plan_recompute import BASE, PROFILE
from test_planner import GEO, H200, check_invariants, scenarios


def mb_memory(samples, profile, cfg, mb):
    return sum(per_gpu_tokens(GEO.tokens(samples[i].frames, samples[i].height, samples[i].width), cfg.sp)
               + profile.sample_tokens for i in mb)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), frac=st.sampled_from([0.05, 0.3, 0.6, 1.0, 1.7, "auto"]))
def test_capped_plans_keep_the_invariants_and_the_cap(sc, frac):
    """Every sample once, G per rank, the budget; a micro-batch of two or more samples within the cap; deterministic;
    the cap at the budget (or over it) plans exactly as no cap."""
    samples, profile, cfg, epoch = sc
    want = "auto" if frac == "auto" else max(1, int(frac * profile.budget_tokens))
    cfg = dataclasses.replace(cfg, policy="packed", pack_tokens=want)
    plan = make_plan(samples, profile, cfg, epoch)
    check_invariants(samples, profile, cfg, plan)
    assert 1 <= plan.pack_tokens <= profile.budget_tokens and plan.summary()["pack_tokens"] == plan.pack_tokens
    if want != "auto":
        assert plan.pack_tokens == min(want, profile.budget_tokens)
    for step in plan.steps:
        for mbs in step:
            for mb in mbs:
                if len(mb) > 1:
                    assert mb_memory(samples, profile, cfg, mb) <= plan.pack_tokens * (1 + 1e-12), "the cap"
    again = make_plan(samples, profile, cfg, epoch)
    assert (again.steps, again.pad, again.pack_tokens) == (plan.steps, plan.pad, plan.pack_tokens)
    if plan.pack_tokens == profile.budget_tokens:
        plain = make_plan(samples, profile, dataclasses.replace(cfg, pack_tokens=None), epoch)
        assert (plain.steps, plain.pred_ms) == (plan.steps, plan.pred_ms)


def test_auto_leaves_blocks_open_when_recompute_costs():
    """With --checkpoint-blocks auto and a profile that knows the recompute, full micro-batches checkpoint every
    block; auto picks a smaller cap, the one pack_cap's own estimate ranks fastest (within CAP_TOL), for every
    epoch alike, and the plan's predicted wall time drops with it."""
    samples = make_mix("video-heavy", 600, seed=0)
    kw = dict(policy="packed", world_size=8, grad_accum=4, lockstep=True, checkpoint="auto",
              checkpoint_policy="attention")
    full = make_plan(samples, PROFILE, PlanConfig(**kw))
    auto = make_plan(samples, PROFILE, PlanConfig(**kw, pack_tokens="auto"))
    assert full.pack_tokens == PROFILE.budget_tokens
    assert auto.pack_tokens < 0.5 * PROFILE.budget_tokens
    assert sum(auto.pred_wall_ms) < 0.95 * sum(full.pred_wall_ms)
    assert make_plan(samples, PROFILE, PlanConfig(**kw, pack_tokens="auto"), epoch=3).pack_tokens == auto.pack_tokens
    ctx = packed.PackedCtx(PROFILE, PlanConfig(**kw), full.tokens, full.tokens,
                           [(s.frames, s.height, s.width) for s in samples], {})
    import random
    order = random.Random("0/pack_tokens").sample(range(len(samples)), len(samples))
    est = {int(f * PROFILE.budget_tokens): packed._cap_ms(order, ctx, packed.PACK_FILL * int(f * PROFILE.budget_tokens))
           for f in packed.CAP_FRACS}
    assert est[auto.pack_tokens] <= min(est.values()) * (1 + packed.CAP_TOL)
    assert all(c <= auto.pack_tokens for c, t in est.items() if t <= min(est.values()) * (1 + packed.CAP_TOL))


@pytest.mark.parametrize("profile, ckpt", [(BASE, "auto"), (PROFILE, "all")])
def test_auto_keeps_the_budget_when_nothing_is_skipped(profile, ckpt):
    """Without recompute to skip (a profile without the fields, or every block checkpointed), a smaller micro-batch
    only adds its fixed cost and the floor: auto keeps the budget, and the plan is the uncapped one."""
    samples = make_mix("video-heavy", 400, seed=1)
    kw = dict(policy="packed", world_size=4, grad_accum=2, lockstep=True, checkpoint=ckpt)
    auto = make_plan(samples, profile, PlanConfig(**kw, pack_tokens="auto"))
    plain = make_plan(samples, profile, PlanConfig(**kw))
    assert auto.pack_tokens == profile.budget_tokens
    assert auto.steps == plain.steps


@pytest.mark.parametrize("value", [0, -5, "big", True, 1.5, [1]])
def test_bad_pack_tokens_are_named(value):
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    with pytest.raises(UserError, match="pack-tokens must be a positive integer"):
        PlanConfig(pack_tokens=value)
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.pack_tokens must be a positive integer"):
        AdaptiveLoadConfig.from_dict({"profile": H200, "pack_tokens": value}, "ds.json")


def test_pack_tokens_is_for_packed_only_and_reaches_the_config():
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    with pytest.raises(UserError, match="pack-tokens applies to the packed policy only"):
        PlanConfig(policy="balanced", pack_tokens=100_000)
    assert AdaptiveLoadConfig.from_dict({"profile": H200, "pack_tokens": "auto"}, "ds.json").pack_tokens == "auto"
    assert AdaptiveLoadConfig.from_dict({"profile": H200}, "ds.json").pack_tokens is None


def test_plan_command_takes_pack_tokens(tmp_path, capsys):
    from ds_adaptiveload.cli import main
    from ds_adaptiveload.plan_cli import dump_lines, plan_checkpoints
    from ds_adaptiveload.schedule.memory import RecomputeCost

    path = tmp_path / "p.yaml"
    PROFILE.to_yaml(str(path))
    dump = tmp_path / "d.jsonl"
    args = ["plan", "--mix", "video-heavy:200", "--profile", str(path), "--world-size", "2", "--grad-accum", "2",
            "--lockstep", "--checkpoint", "auto", "--checkpoint-policy", "attention"]
    assert main([*args, "--pack-tokens", "auto", "--dump", str(dump), "--json"]) == 0
    out = capsys.readouterr().out
    samples, cfg = make_mix("video-heavy", 200, seed=0), PlanConfig(
        world_size=2, grad_accum=2, lockstep=True, checkpoint="auto", checkpoint_policy="attention",
        pack_tokens="auto")
    want = make_plan(samples, PROFILE, cfg)
    assert f'"pack_tokens": {want.pack_tokens}' in out and want.pack_tokens < PROFILE.budget_tokens
    counts = plan_checkpoints(want, samples, PROFILE.geometry, cfg, RecomputeCost.of(PROFILE, "attention"))
    assert dump.read_text() == "".join(dump_lines(want, samples, counts)) and counts
    assert main([*args, "--pack-tokens", "lots"]) == 2
    assert "--pack-tokens must be a positive integer or auto, got 'lots'" in capsys.readouterr().err
