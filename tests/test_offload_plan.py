"""schedule/offload.py: how many checkpointed blocks offload their inputs, from the memory and time model."""
import pytest

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.memory import RecomputeCost, checkpoint_plan, predicted_peak_bytes
from ds_adaptiveload.schedule.offload import attach, fits, offload_blocks, offload_ms, parse_setting

L = 10
IN_BPT = 1000.0  # a block input's bytes per token
MEM = {"capacity_bytes": 100e6, "safety": 1.0, "fixed_bytes": 0.0, "bytes_per_token": 10 * IN_BPT + 2000.0,
       "block_bytes_per_token": 4000.0}


def test_off_is_the_checkpoint_plan():
    for tokens in (100, 2000, 8000):
        assert offload_blocks(tokens, 1, MEM, L, "off", IN_BPT) == (*checkpoint_plan(tokens, 1, MEM, L), 0)


def test_offload_frees_the_inputs_and_opens_blocks():
    tokens = 5000  # all checkpointed: 60 MB; each open block 20 MB more
    k0 = checkpoint_plan(tokens, 1, MEM, L)[0]
    k, _, _, n = offload_blocks(tokens, 1, MEM, L, 4, IN_BPT)
    assert n == 4 and k < k0  # 4 inputs off the device (20 MB) open one block more
    assert fits(tokens, 1, MEM, L, (k, k, 0, n), IN_BPT)
    assert not fits(tokens, 1, MEM, L, (k, k, 0, 0), IN_BPT)


def test_an_int_offloads_at_most_the_checkpointed_blocks():
    k, _, _, n = offload_blocks(100, 1, MEM, L, 8, IN_BPT)  # everything fits open
    assert (k, n) == (0, 0)


def test_auto_makes_a_too_large_micro_batch_fit():
    tokens = 9000  # every block checkpointed needs 108 MB > 100 MB
    assert not fits(tokens, 1, MEM, L, (L, L, 0, 0), IN_BPT)
    plan = offload_blocks(tokens, 1, MEM, L, "auto", IN_BPT)  # no time model: the fewest that fit
    assert fits(tokens, 1, MEM, L, plan, IN_BPT) and plan[3] == 1  # 9 MB of 8 MB over
    assert not fits(tokens, 1, MEM, L, (*plan[:3], plan[3] - 1), IN_BPT)


@pytest.mark.parametrize("host_bps, offloads", [(1e15, True), (1e3, False)])
def test_auto_weighs_recompute_against_the_host_link(host_bps, offloads):
    tokens = 5000
    mem = {**MEM, "host_link_bytes_per_s": host_bps}
    plan = offload_blocks(tokens, 1, mem, L, "auto", IN_BPT, t_ms=1000.0, fracs=(0.3, 0.0, 0.0))
    assert (plan[3] > 0) == offloads
    if offloads:  # a free link: offload until no checkpointed block is left to open
        assert plan[0] < checkpoint_plan(tokens, 1, MEM, L)[0]
    else:
        assert plan == (*checkpoint_plan(tokens, 1, MEM, L), 0)


def test_exposed_copy_time():
    # 1000 tokens x 1000 B at 1e9 B/s: 1 ms each way; a 0.4 ms forward hides 0.4, the 0.8 ms backward 0.8
    assert offload_ms(1000, 3, 0.4, 1000.0, 1e9) == pytest.approx(3 * (0.6 + 0.2))
    assert offload_ms(1000, 3, 5.0, 1000.0, 1e9) == 0.0


def test_recompute_cost_plans_carry_the_count():
    cost = attach(RecomputeCost(MEM, L, 0.3), 4, IN_BPT / 2)  # a width of IN_BPT / 2 bf16 values
    k, k_full, k_ffn, n = cost.plan(5000, 1)
    assert n == 4 and cost.factor(5000, 1) < RecomputeCost(MEM, L, 0.3).factor(5000, 1)
    assert predicted_peak_bytes(5000, 1, MEM, L, k, k_full, k_ffn) - n * IN_BPT * 5000 <= MEM["capacity_bytes"]
    assert attach(RecomputeCost(MEM, L, 0.3), "off", 500).plan(5000, 1) == checkpoint_plan(5000, 1, MEM, L)


@pytest.mark.parametrize("bad", ["on", -1, 1.5, True])
def test_bad_setting(bad):
    with pytest.raises(UserError, match="adaptive_load.activation_offload"):
        parse_setting(bad, "x.json: adaptive_load.activation_offload")
    assert parse_setting(0, "x") == "off" and parse_setting(3, "x") == 3


def _profile_file(tmp_path):
    import dataclasses
    import os

    from ds_adaptiveload.schedule.profile import CostProfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = CostProfile.load(os.path.join(root, "configs", "profiles", "h200-wan1.3b-zero3.yaml"))
    prof = dataclasses.replace(base, memory={**base.memory, "block_bytes_per_token": 51_510}, recompute_frac=0.22)
    path = tmp_path / "p.yaml"
    prof.to_yaml(str(path))
    return str(path)


def test_plan_command_shows_the_offload_count(tmp_path, capsys):
    """plan --dump/--json carry the offloaded blocks beside k, k_full, k_ffn; "off" dumps what no flag dumps."""
    import json

    from ds_adaptiveload.cli import main

    path = _profile_file(tmp_path)
    argv = ["plan", "--mix", "video-heavy:40", "--profile", path, "--world-size", "2", "--checkpoint", "auto"]
    dumps = {}
    for name, extra in (("none", []), ("off", ["--activation-offload", "off"]), ("n", ["--activation-offload", "3"]),
                        ("auto", ["--activation-offload", "auto"])):
        dumps[name] = tmp_path / f"{name}.jsonl"
        assert main(argv + extra + ["--json", "--dump", str(dumps[name])]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert ("offload_blocks" in summary) == (name in ("n", "auto"))
    assert dumps["off"].read_text() == dumps["none"].read_text()
    rows = [json.loads(line) for line in dumps["n"].read_text().splitlines()]
    assert all(len(r["checkpoint"]) == 4 and r["checkpoint"][3] == min(3, r["checkpoint"][0]) for r in rows)
    plain = [json.loads(line) for line in dumps["none"].read_text().splitlines()]
    assert any(r["checkpoint"][0] < p["checkpoint"][0] for r, p in zip(rows, plain))  # freed memory opens blocks


@pytest.mark.parametrize("value", ["on", "-2", "2.5"])
def test_bad_flag_and_key_are_named(tmp_path, capsys, value):
    from ds_adaptiveload.cli import main
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    assert main(["plan", "--mix", "video-heavy:10", "--profile", _profile_file(tmp_path), "--world-size", "1",
                 "--checkpoint", "auto", "--activation-offload", value]) == 2
    assert capsys.readouterr().err.startswith("error: --activation-offload must be")
    for bad in ("on", -2, 2.5, True):
        with pytest.raises(UserError, match=r"^run.json: adaptive_load.activation_offload must be"):
            AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "activation_offload": bad}, "run.json")
    good = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "activation_offload": 4}, "run.json")
    assert good.activation_offload == 4
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml"}, "run.json").activation_offload == "off"


def test_the_trainer_config_checks_the_checkpointing(tmp_path):
    """read_config: --activation-offload over the JSON's key; auto needs --checkpoint-blocks auto, any offload needs
    checkpointed blocks; each refusal names the file, the key and the flag."""
    import json
    import os
    from types import SimpleNamespace

    from ds_adaptiveload.train.setup import read_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ds = json.load(open(os.path.join(root, "configs", "ds_tiny_cpu.json")))
    ds["adaptive_load"]["activation_offload"] = 2
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    args = SimpleNamespace(deepspeed_config=str(tmp_path / "ds.json"), model_config="configs/wan_tiny.yaml",
                           fault=None, checkpoint_blocks=True, checkpoint_policy="full", compile_blocks=False,
                           compile_cache=None, resume=None, activation_offload=None)
    assert read_config(args, 1, 0).al.activation_offload == 2
    args.activation_offload = "auto"
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.activation_offload \"auto\" needs --checkpoint-blocks"):
        read_config(args, 1, 0)
    args.checkpoint_blocks = "auto"
    assert read_config(args, 1, 0).al.activation_offload == "auto"
    args.activation_offload, args.checkpoint_blocks = "3", False
    with pytest.raises(UserError, match="adaptive_load.activation_offload needs --checkpoint-blocks$"):
        read_config(args, 1, 0)
    args.activation_offload = "x"
    with pytest.raises(UserError, match="ds.json: --activation-offload must be"):
        read_config(args, 1, 0)
