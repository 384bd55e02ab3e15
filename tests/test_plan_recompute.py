"""The planner with --checkpoint-blocks auto (PlanConfig.checkpoint): each micro-batch costs the recompute its open
blocks skip (schedule/memory.RecomputeCost), per micro-batch or at the step's largest count (auto-step, ZeRO-3);
the invariants hold, and without the profile fields or with checkpoint "all" nothing changes."""
import dataclasses
import os

import pytest
from hypothesis import given, settings, strategies as st

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.memory import blocks_to_checkpoint, ffn_blocks, recompute_factor, selective_checkpoint
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.profile import CostProfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml"))
# The open-block fields bench/mfu.py measured for compiled regions on the H200 (fifth session, regions-attn), and the
# recompute shares of its compiled 720p 81f rows (docs/history/benchmarks.md: 0.220 of the time is recompute, 0.069
# with the attention policy, so keeping attention saves 1 - 0.78 / 0.931 = 0.16 of a fully checkpointed micro-batch).
OPEN = {"block_bytes_per_token": 51_510, "block_bytes_per_sample": 4_544_034, "attention_bytes_per_token": 4_992}
PROFILE = dataclasses.replace(BASE, memory={**BASE.memory, **OPEN}, recompute_frac=0.22,
                              attention_recompute_frac=0.16)
L = BASE.meta["model"]["num_layers"]


def expected_rank_ms(prof, mbs, gpu, policy="full", ks=None):
    """A rank's predicted ms recomputed here: the profile's time of each micro-batch times its recompute factor."""
    total = prof.step_fixed_ms
    for mb in mbs:
        tokens = sum(gpu[i] for i in mb)
        base = prof.packed_ms([gpu[i] for i in mb])
        if ks is None:
            k, kf = (selective_checkpoint(tokens, len(mb), prof.memory, L) if policy == "attention"
                     else (blocks_to_checkpoint(tokens, len(mb), prof.memory, L),) * 2)
        else:
            k, kf = ks
        kffn = ffn_blocks(tokens, len(mb), prof.memory, L, k, kf) if policy == "attention" and ks is None else 0
        total += base * recompute_factor(k, L, prof.recompute_frac, kf, prof.attention_recompute_frac, kffn,
                                         prof.ffn_recompute_frac)
    return total


def check_invariants(plan, n, cfg):
    real = sorted(i for s, step in enumerate(plan.steps) for r, mbs in enumerate(step) for m, mb in enumerate(mbs)
                  for i in mb if (s, r, m) not in plan.pad)
    assert real == list(range(n))  # every sample once (pads only repeat one at zero weight)
    assert all(len(step) == cfg.dp_size and all(len(mbs) == cfg.grad_accum for mbs in step) for step in plan.steps)
    mem = PROFILE.memory
    for step in plan.steps:
        for mbs in step:
            for mb in mbs:  # the budget holds whatever the checkpointing
                assert sum(plan.tokens[i] + mem["sample_tokens"] for i in mb) <= PROFILE.budget_tokens + 1e-6


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(["balanced", "packed", "equal-tokens", "dual"]), ranks=st.sampled_from([1, 2, 8]),
       G=st.sampled_from([1, 4]), lockstep=st.booleans(), ckpt_policy=st.sampled_from(["full", "attention"]),
       seed=st.integers(0, 3))
def test_auto_costs_each_micro_batch_at_its_own_checkpointing(policy, ranks, G, lockstep, ckpt_policy, seed):
    samples = make_mix("video-heavy", 160, seed=seed)
    cfg = PlanConfig(policy=policy, world_size=ranks, grad_accum=G, lockstep=lockstep, seed=seed, checkpoint="auto",
                     checkpoint_policy=ckpt_policy)
    plan = make_plan(samples, PROFILE, cfg)
    check_invariants(plan, len(samples), cfg)
    gpu = plan.tokens  # sp = 1: per-GPU tokens are the sample's
    for s, step in enumerate(plan.steps):
        for r, mbs in enumerate(step):
            assert plan.pred_ms[s][r] == pytest.approx(expected_rank_ms(PROFILE, mbs, gpu, ckpt_policy), rel=1e-9)
    assert make_plan(samples, PROFILE, cfg).steps == plan.steps  # deterministic


@pytest.mark.parametrize("policy", ["packed", "balanced"])
def test_ffn_outputs_kept_are_costed_and_only_under_attention(policy):
    """memory.ffn_bytes_per_token and time_ms.ffn_recompute_frac: each micro-batch costs what its FFN-keeping blocks
    skip (ffn_blocks), under the attention policy only; the full policy's plan is the same as without the fields."""
    prof = dataclasses.replace(PROFILE, memory={**PROFILE.memory, "ffn_bytes_per_token": 3_072},
                               ffn_recompute_frac=0.011)
    samples = make_mix("video-heavy", 200, seed=2)
    kw = dict(policy=policy, world_size=4, grad_accum=2, lockstep=True, checkpoint="auto")
    plan = make_plan(samples, prof, PlanConfig(**kw, checkpoint_policy="attention"))
    check_invariants(plan, len(samples), PlanConfig(**kw))
    kept = 0
    for s, step in enumerate(plan.steps):
        for r, mbs in enumerate(step):
            assert plan.pred_ms[s][r] == pytest.approx(expected_rank_ms(prof, mbs, plan.tokens, "attention"), rel=1e-9)
            kept += sum(ffn_blocks(sum(plan.tokens[i] for i in mb), len(mb), prof.memory, L,
                                   *selective_checkpoint(sum(plan.tokens[i] for i in mb), len(mb), prof.memory, L))
                        for mb in mbs)
    assert kept > 0, "some micro-batches should keep FFN outputs"
    full = [make_plan(samples, p, PlanConfig(**kw, checkpoint_policy="full")) for p in (prof, PROFILE)]
    assert (full[0].steps, full[0].pred_ms) == (full[1].steps, full[1].pred_ms)


def test_auto_step_uses_the_steps_largest_count_on_every_micro_batch():
    samples = make_mix("video-heavy", 200, seed=1)
    cfg = PlanConfig(policy="balanced", world_size=4, grad_accum=2, lockstep=True, checkpoint="auto-step")
    plan = make_plan(samples, PROFILE, cfg)
    gpu, mem = plan.tokens, PROFILE.memory
    varied = 0
    for s, step in enumerate(plan.steps):
        ks = [blocks_to_checkpoint(sum(gpu[i] for i in mb), len(mb), mem, L) for mbs in step for mb in mbs]
        varied += len(set(ks)) > 1
        for r, mbs in enumerate(step):
            assert plan.pred_ms[s][r] == pytest.approx(expected_rank_ms(PROFILE, mbs, gpu, ks=(max(ks),) * 2))
    assert varied, "the mix should give steps whose micro-batches need different counts"


def test_open_blocks_are_cheaper_and_all_leaves_plans_as_they_were():
    """An image micro-batch opens every block and saves the whole recompute; a full budget checkpoints more. With
    checkpoint "all", or a profile without the fields, plans and predictions equal the default's exactly."""
    samples = make_mix("video-heavy", 300, seed=0)
    default = make_plan(samples, PROFILE, PlanConfig(policy="balanced", world_size=8, grad_accum=4, lockstep=True))
    same = make_plan(samples, PROFILE, PlanConfig(policy="balanced", world_size=8, grad_accum=4, lockstep=True,
                                                  checkpoint="all"))
    assert (same.steps, same.pred_ms) == (default.steps, default.pred_ms)
    for prof in (BASE, dataclasses.replace(PROFILE, recompute_frac=0.0)):  # no block fields / no recompute share
        off = make_plan(samples, prof, PlanConfig(policy="balanced", world_size=8, grad_accum=4, lockstep=True,
                                                  checkpoint="auto"))
        ref = make_plan(samples, prof, PlanConfig(policy="balanced", world_size=8, grad_accum=4, lockstep=True))
        assert (off.steps, off.pred_ms) == (ref.steps, ref.pred_ms)
    auto = make_plan(samples, PROFILE, PlanConfig(policy="packed", world_size=8, grad_accum=4, lockstep=True,
                                                  checkpoint="auto"))
    full = make_plan(samples, PROFILE, PlanConfig(policy="packed", world_size=8, grad_accum=4, lockstep=True))
    assert auto.steps == full.steps  # packed evens per-sample costs: the same micro-batches, cheaper predictions
    assert sum(auto.pred_wall_ms) < sum(full.pred_wall_ms) <= sum(auto.pred_wall_ms) / (1 - PROFILE.recompute_frac)


def test_bad_checkpoint_settings_are_named():
    for kw, word in (({"checkpoint": "some"}, "checkpoint must be"), ({"checkpoint_policy": "x"}, "checkpoint-policy")):
        with pytest.raises(UserError, match=word):
            PlanConfig(**kw)
    with pytest.raises(UserError, match="attention_recompute_frac"):
        dataclasses.replace(PROFILE, attention_recompute_frac=1.0)


def test_plan_command_and_trainer_choose_the_mode(tmp_path, capsys):
    """`plan --checkpoint auto` equals make_plan's; train_wan's --checkpoint-blocks auto plans auto (auto-step under
    ZeRO-3); the command says when the profile cannot cost it."""
    from types import SimpleNamespace

    from ds_adaptiveload.cli import main
    from ds_adaptiveload.plan_cli import dump_lines, plan_checkpoints
    from ds_adaptiveload.schedule.memory import RecomputeCost
    from ds_adaptiveload.train.setup import plan_checkpoint

    path = tmp_path / "p.yaml"
    PROFILE.to_yaml(str(path))
    dump = tmp_path / "d.jsonl"
    assert main(["plan", "--mix", "video-heavy:120", "--profile", str(path), "--world-size", "2", "--grad-accum", "2",
                 "--lockstep", "--checkpoint", "auto", "--checkpoint-policy", "attention", "--dump", str(dump)]) == 0
    samples = make_mix("video-heavy", 120, seed=0)
    profile = CostProfile.load(str(path))
    cfg = PlanConfig(world_size=2, grad_accum=2, lockstep=True, checkpoint="auto", checkpoint_policy="attention")
    want = make_plan(samples, profile, cfg)
    counts = plan_checkpoints(want, samples, profile.geometry, cfg, RecomputeCost.of(profile, "attention"))
    assert dump.read_text() == "".join(dump_lines(want, samples, counts)) and counts
    capsys.readouterr()
    calibrated = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")  # no open-block fields
    assert main(["plan", "--mix", "video-heavy:20", "--profile", calibrated, "--world-size", "2",
                 "--checkpoint", "auto"]) == 0
    assert "costs every block checkpointed" in capsys.readouterr().err
    args = SimpleNamespace(checkpoint_blocks="auto", checkpoint_policy="attention")
    assert plan_checkpoint(args, 2) == {"checkpoint": "auto", "checkpoint_policy": "attention"}
    assert plan_checkpoint(args, 3)["checkpoint"] == "auto-step"
    assert plan_checkpoint(SimpleNamespace(checkpoint_blocks=True), 2)["checkpoint"] == "all"
