"""Pinned host memory of activation offload (schedule/offload.py): the buffers' size, the plan's hold per rank in
plan --json and the trainer's start-up line, memory.host_bytes_per_rank bounding "auto" and refusing an integer."""
import json
import logging
from types import SimpleNamespace

import pytest

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.offload import (offload_blocks, pinned_buffer_bytes, pinned_host_bytes)
from test_offload_time import L, _profile, _samples

IN_BPT = 1000.0
MEM = {"capacity_bytes": 100e6, "safety": 1.0, "fixed_bytes": 0.0, "bytes_per_token": 12000.0,
       "block_bytes_per_token": 4000.0}
MB = 2**23  # a 5,000-token input, 5 MB, in its power-of-two pinned buffer


def test_buffers_round_up_to_a_power_of_two():
    assert pinned_buffer_bytes(5000, IN_BPT) == MB
    assert pinned_buffer_bytes(4096, 1024.0) == 2**22  # already a power of two
    assert pinned_buffer_bytes(9000, IN_BPT) == 2 * MB
    # per size the most buffers one micro-batch takes: the caching allocator reuses freed buffers of a size
    assert pinned_host_bytes([(5000, 4), (5000, 2), (9000, 1), (100, 0)], IN_BPT) == 4 * MB + 2 * MB


@pytest.mark.parametrize("host_buffers, n", [(None, 1), (1, 1), (0, 0)])
def test_auto_offloads_what_the_host_holds(host_buffers, n):
    """9,000 tokens need one input off the device; auto takes it only where the host holds its buffer."""
    mem = MEM if host_buffers is None else {**MEM, "host_bytes_per_rank": host_buffers * 2 * MB}
    assert offload_blocks(9000, 1, mem, L, "auto", IN_BPT)[3] == n


def test_auto_never_plans_more_than_fits():
    mem = {**MEM, "host_link_bytes_per_s": 1e15, "host_bytes_per_rank": 2 * MB + 1}  # room for two 5 MB buffers
    for tokens in (2000, 5000, 8000):
        free = offload_blocks(tokens, 1, {**mem, "host_bytes_per_rank": None}, L, "auto", IN_BPT, t_ms=600.0,
                              fracs=(0.3, 0.0, 0.0))
        plan = offload_blocks(tokens, 1, mem, L, "auto", IN_BPT, t_ms=600.0, fracs=(0.3, 0.0, 0.0))
        assert plan[3] * pinned_buffer_bytes(tokens, IN_BPT) <= mem["host_bytes_per_rank"]
        assert plan[3] <= free[3]
    assert offload_blocks(5000, 1, {**mem, "host_bytes_per_rank": None}, L, "auto", IN_BPT, t_ms=600.0,
                          fracs=(0.3, 0.0, 0.0))[3] > 2  # the bound binds


def test_an_integer_over_the_host_is_refused():
    mem = {**MEM, "host_bytes_per_rank": 3 * MB}
    assert offload_blocks(5000, 1, mem, L, 3, IN_BPT)[3] == 3
    with pytest.raises(UserError, match=r"^adaptive_load.activation_offload \(--activation-offload\) 4: .* 0.03 GiB "
                                        r"of pinned host memory, over the profile's memory.host_bytes_per_rank "
                                        r"\(0.02 GiB\); give at most 3"):
        offload_blocks(5000, 1, mem, L, 4, IN_BPT)


def _write(tmp_path, host):
    prof = _profile(1e8)
    if host is not None:
        prof.memory["host_bytes_per_rank"] = host
    prof.to_yaml(str(tmp_path / "p.yaml"))
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "frames": 1, "height": 800, "width": 1600})
                                              + "\n" for i in range(4)))
    return ["plan", "--manifest", str(tmp_path / "m.jsonl"), "--profile", str(tmp_path / "p.yaml"), "--world-size",
            "2", "--policy", "equal-tokens", "--json"]


@pytest.mark.parametrize("checkpoint", ["auto", "all"])
def test_plan_json_reports_the_pinned_bytes(tmp_path, capsys, checkpoint):
    from ds_adaptiveload.cli import main

    argv = _write(tmp_path, 5 * MB) + ["--checkpoint", checkpoint, "--activation-offload", "4"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pinned_host_bytes"] == 4 * MB and summary["host_bytes_per_rank"] == 5 * MB


@pytest.mark.parametrize("checkpoint", ["auto", "all"])
def test_plan_refuses_an_offload_the_host_cannot_hold(tmp_path, capsys, checkpoint):
    from ds_adaptiveload.cli import main

    assert main(_write(tmp_path, 3 * MB) + ["--checkpoint", checkpoint, "--activation-offload", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: adaptive_load.activation_offload (--activation-offload) 4:")
    assert "memory.host_bytes_per_rank" in err and len(err.strip().splitlines()) == 1


def _line(tmp_path, host, meminfo_kb, setting=3, blocks=True):
    from ds_adaptiveload.schedule.planner import PlanConfig
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler
    from ds_adaptiveload.train.setup import offload_line

    prof = _profile(1e8)
    if host is not None:
        prof.memory["host_bytes_per_rank"] = host
    sampler = AdaptiveSampler(_samples(2), prof, PlanConfig("equal-tokens", world_size=2,
                                                            activation_offload=setting), 0)
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    al = SimpleNamespace(activation_offload=setting)
    return offload_line(al, blocks, SimpleNamespace(dim=500, num_layers=L), prof, sampler, None,
                        str(tmp_path / "meminfo"))


def test_the_start_up_line(tmp_path, monkeypatch):
    """The trainer's line: the blocks and pinned GiB per rank, against the profile's key, else MemAvailable over the
    host's ranks; a warning where the host cannot hold it."""
    monkeypatch.setenv("LOCAL_SIZE", "2")
    level, text = _line(tmp_path, 4 * MB, 10)
    assert level == logging.INFO and "3 blocks" in text and "predicted 24.0 MiB of it per rank" in text
    assert "(memory.host_bytes_per_rank: 32.0 MiB)" in text
    level, text = _line(tmp_path, None, 2 * 2**20)  # 2 GiB over 2 ranks
    assert level == logging.INFO and "MemAvailable / LOCAL_SIZE: 1.0 GiB" in text
    level, text = _line(tmp_path, None, 1000)
    assert level == logging.WARNING and "more than the host holds" in text
    assert "2 blocks" in _line(tmp_path, None, 10**8, blocks=2)[1]  # only the checkpointed blocks offload
    assert _line(tmp_path, None, 10, setting="off") is None


def test_the_start_up_line_under_auto_checkpointing(tmp_path):
    """--checkpoint-blocks auto: the counts are the loader's (its RecomputeCost), 4 of 7 checkpointed blocks here."""
    from ds_adaptiveload.schedule.memory import RecomputeCost
    from ds_adaptiveload.schedule.offload import attach
    from ds_adaptiveload.schedule.planner import PlanConfig
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler
    from ds_adaptiveload.train.setup import offload_line

    prof = _profile(1e8)
    cfg = PlanConfig("equal-tokens", world_size=2, checkpoint="auto", activation_offload=4)
    sampler = AdaptiveSampler(_samples(2), prof, cfg, 0)
    recompute = attach(RecomputeCost.of(prof), 4, 500, prof)
    level, text = offload_line(SimpleNamespace(activation_offload=4), "auto", SimpleNamespace(dim=500, num_layers=L),
                               prof, sampler, recompute, str(tmp_path / "no-meminfo"))
    assert level == logging.INFO
    assert text == ("[train_wan] activation offload: 4-4 blocks per micro-batch keep their input in pinned host "
                    "memory, predicted 32.0 MiB of it per rank")  # no host figure: no key, no /proc/meminfo read
