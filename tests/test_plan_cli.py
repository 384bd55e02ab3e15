"""The `plan` command is a contract: flags, --dump lines and --json keys."""
import json
import subprocess
import sys

import pytest

from ds_adaptiveload.cli import main
from ds_adaptiveload.schedule.manifest import write_manifest
from ds_adaptiveload.schedule.mixes import make_mix

H200 = "tests/data/h200-wan1.3b-blocks.yaml"
KEYS = {"policy", "world_size", "sp", "grad_accum", "steps", "micro_batches", "samples_total", "samples_planned",
        "samples_skipped", "idle_fraction", "mix_tv", "predicted_wall_s", "plan_seconds"}


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "m.jsonl"
    write_manifest(path, make_mix("video-heavy", 300, seed=3))
    return str(path)


def test_lockstep_flag(manifest, capsys):
    """--lockstep (ZeRO-2/3) predicts a step as rounds of micro-batches: never less wall than step-level
    sync for the same plan, and balanced then plans rounds that beat equal-tokens."""
    def run(*extra):
        assert main(["plan", "--manifest", manifest, "--profile", H200, "--world-size", "4", "--grad-accum", "4",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    eq, eq_lock = run("--policy", "equal-tokens"), run("--policy", "equal-tokens", "--lockstep")
    assert eq_lock["steps"] == eq["steps"] and eq_lock["predicted_wall_s"] > eq["predicted_wall_s"]
    bal_lock = run("--policy", "balanced", "--lockstep")
    assert bal_lock["predicted_wall_s"] < eq_lock["predicted_wall_s"] and bal_lock["idle_fraction"] < 0.1


def test_packed_policy_dump(tmp_path, manifest, capsys):
    """--policy packed: the same --json keys and --dump lines; a micro-batch may list ids of several shapes."""
    dump = tmp_path / "plan.jsonl"
    assert main(["plan", "--manifest", manifest, "--profile", H200, "--world-size", "4", "--grad-accum", "2",
                 "--policy", "packed", "--lockstep", "--dump", str(dump), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(summary) and summary["policy"] == "packed" and summary["samples_planned"] == 300
    # the lower bound on the epoch's predicted wall time, and how far the plan is from it
    assert summary["bound_binds"] in ("fixed", "work", "heaviest")
    assert 0 < summary["lower_bound_s"] <= summary["predicted_wall_s"] * (1 + 1e-9)
    assert summary["bound_gap"] == pytest.approx(summary["predicted_wall_s"] / summary["lower_bound_s"] - 1)
    parts = summary["lower_bound_parts_s"]  # the binding part is the bound; forced idle is within work
    assert parts[summary["bound_binds"]] == summary["lower_bound_s"] == max(parts["fixed"], parts["work"],
                                                                           parts["heaviest"])
    assert 0 <= parts["forced"] <= parts["work"]
    shapes = {s.id: (s.frames, s.height, s.width) for s in make_mix("video-heavy", 300, seed=3)}
    lines = [json.loads(line) for line in open(dump)]
    assert sum(len(r["ids"]) for r in lines if not r.get("pad")) == 300
    assert any(len({shapes[i] for i in r["ids"]}) > 1 for r in lines)


def test_replicate_flag(manifest, capsys):
    """--replicate on / off reach the packed plan: runs of R at a budget of one 720p clip change it."""
    out = {}
    for flag in ("on", "off", "auto"):
        assert main(["plan", "--manifest", manifest, "--profile", H200, "--world-size", "4", "--grad-accum", "1",
                     "--lockstep", "--replicate", flag, "--json"]) == 0
        out[flag] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        out[flag].pop("plan_seconds", None)
    assert out["on"] != out["off"] and out["auto"] == out["on"]  # the blocks profile: memory for one clip


def test_json_summary_and_dump(tmp_path, manifest, capsys):
    dump = tmp_path / "plan.jsonl"
    rc = main(["plan", "--manifest", manifest, "--profile", H200, "--world-size", "4", "--sp", "2",
               "--grad-accum", "2", "--policy", "balanced", "--seed", "1", "--epoch", "1", "--dump", str(dump),
               "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= set(summary)
    assert (summary["world_size"], summary["sp"], summary["grad_accum"], summary["dp_size"]) == (4, 2, 2, 2)
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    assert all(set(x) - {"pad"} == {"step", "rank", "micro", "ids"} for x in lines)
    assert len(lines) == summary["micro_batches"] == summary["steps"] * 2 * 2
    ids = [i for x in lines if not x.get("pad") for i in x["ids"]]
    assert len(ids) == len(set(ids)) == summary["samples_planned"] == 300
    assert {x["rank"] for x in lines} == {0, 1}


def test_table_output(manifest, capsys):
    assert main(["plan", "--manifest", manifest, "--profile", H200, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "predicted idle fraction" in out and "packed" in out  # the default policy


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "frames": 1, "height": 64, "width": 64}\n{"id": "b", "frames": 2, "height": 64, "width": 64}\n')
    assert main(["plan", "--manifest", str(bad), "--profile", H200, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.jsonl:2" in err and "'b'" in err
    assert main(["plan", "--manifest", str(bad), "--profile", str(tmp_path / "nope.yaml"), "--world-size", "2"]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_oversize_skip_reports(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "img", "frames": 1, "height": 480, "width": 832}\n'
                    '{"id": "long", "frames": 161, "height": 720, "width": 1280}\n')
    assert main(["plan", "--manifest", str(path), "--profile", H200, "--world-size", "1", "--json"]) == 2
    assert "smallest sequence-parallel degree that fits it is 2" in capsys.readouterr().err
    assert main(["plan", "--manifest", str(path), "--profile", H200, "--world-size", "1", "--json",
                 "--on-oversize", "skip"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["samples_skipped"] == 1 and "long" in cap.err


def test_plan_does_not_import_torch():
    code = ("import sys; from ds_adaptiveload.cli import main; "
            f"main(['plan', '--mix', 'video-heavy:200', '--profile', '{H200}', '--world-size', '2', '--json']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("mode", ["auto", "auto-step"])
def test_dump_lines_carry_the_checkpoint_counts(tmp_path, manifest, capsys, mode):
    """--checkpoint auto / auto-step: each --dump line holds the [k, k_full, k_ffn] the trainer runs the micro-batch
    at (the memory model's own under auto, the step's largest k on every micro-batch under auto-step), and --json
    their range; under all neither appears."""
    from ds_adaptiveload.plan_cli import run_profile
    from ds_adaptiveload.schedule.geometry import per_gpu_tokens
    from ds_adaptiveload.schedule.memory import checkpoint_plan
    from ds_adaptiveload.schedule.profile import CostProfile

    src = "configs/profiles/h200-wan1.3b-zero2.yaml"
    profile = run_profile(CostProfile.load(src), None, 8, src)
    shapes = {s.id: (s.frames, s.height, s.width) for s in make_mix("video-heavy", 300, seed=3)}

    def own(ids):
        tokens = sum(per_gpu_tokens(profile.geometry.tokens(*shapes[i]), 2) for i in ids)
        return list(checkpoint_plan(tokens, len(ids), profile.memory, profile.meta["model"]["num_layers"]))

    dump = tmp_path / "plan.jsonl"
    for ckpt in (mode, "all"):
        assert main(["plan", "--manifest", manifest, "--profile", src, "--world-size", "8", "--sp", "2",
                     "--grad-accum", "2", "--lockstep", "--policy", "balanced", "--checkpoint", ckpt, "--dump", str(dump),
                     "--json"]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        lines = [json.loads(x) for x in dump.read_text().splitlines()]
        if ckpt == "all":
            assert summary["checkpoint_blocks"] is None and not any("checkpoint" in x for x in lines)
            continue
        for x in lines:
            step = [y for y in lines if y["step"] == x["step"]]
            k = max(own(y["ids"])[0] for y in step)
            assert x["checkpoint"] == (own(x["ids"]) if mode == "auto" else [k, k, 0])
        ks = [x["checkpoint"][0] for x in lines]
        assert summary["checkpoint_blocks"] == [min(ks), max(ks)] and min(ks) < max(ks)
