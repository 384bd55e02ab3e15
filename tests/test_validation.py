"""--val-data / --val-every (train/validation.py): fixed timesteps and per-id noise, a balanced share per rank, and
the same held-out loss on 1 and 2 CPU ranks (ZeRO-3, with stand-in forwards on the rank with fewer samples), logged
to the step log, OUTPUT/val.jsonl and DeepSpeed's csv monitor."""
import glob
import json
import os
import subprocess

import pytest

from ds_adaptiveload.train.validation import assign, id_seed, timesteps
from tests.launcher import DEEPSPEED, launcher_env, master_port, needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timesteps_spread_over_0_1_and_seeds_follow_the_id():
    assert timesteps() == [(2 * k + 1) / 16 for k in range(8)]
    assert id_seed(0, "a") == id_seed(0, "a") != id_seed(0, "b") != id_seed(1, "b")
    assert 0 <= id_seed(3, "clip/7") < 2**63


def test_assign_balances_the_cost_and_keeps_every_sample_once():
    costs = [10, 1, 7, 3, 3, 8, 2]
    shares = assign(costs, 3)
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(costs) and max(loads) == 12  # LPT: 10+2 | 8+3+1 | 7+3
    assert assign(costs, 1) == [sorted(range(len(costs)), key=lambda i: (-costs[i], i))]


def val_manifest(folder):
    from ds_adaptiveload.data.latents import write_synthetic
    from ds_adaptiveload.schedule.mixes import make_mix

    return write_synthetic(str(folder), make_mix("tiny", 5, 11), text_dim=64, max_text_len=32, seed=11, dtype="fp32")


def launch(out, gpus, *extra):
    from tests.test_train import test_config

    os.makedirs(out.parent, exist_ok=True)
    cfg = test_config(out.parent)
    cmd = [DEEPSPEED, "--num_gpus", str(gpus), "--master_port", str(master_port()), "launch/train_wan.py",
           "--deepspeed_config", str(cfg), "--model-config", "configs/wan_tiny.yaml", "--output", str(out),
           "--num-workers", "1", "--synthetic", "--synthetic-num", "16", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "val.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@needs_launcher
def test_held_out_loss_is_the_same_on_1_and_2_ranks_and_is_logged(tmp_path):
    manifest = val_manifest(tmp_path / "val")
    two = launch(tmp_path / "a" / "run", 2, "--max-steps", "2", "--val-data", manifest, "--val-every", "1")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert all(len(r["val_loss_t"]) == 8 for r in two)
    assert two[1]["val_loss"] != two[0]["val_loss"]  # the weights moved
    one = launch(tmp_path / "b" / "run", 1, "--max-steps", "1", "--val-data", manifest)
    assert [r["step"] for r in one] == [0, 1]
    # the starting weights are the same on 1 and 2 ranks (same seed): so is the held-out loss
    assert one[0]["val_loss"] == pytest.approx(two[0]["val_loss"], rel=1e-6)
    assert one[0]["val_loss_t"] == pytest.approx(two[0]["val_loss_t"], rel=1e-6)
    from tests.test_train import steps

    recs = steps(tmp_path / "a" / "run")
    assert [r.get("val_loss") for r in recs] == [two[1]["val_loss"], two[2]["val_loss"]]
    assert all(r["val_ms"] > 0 for r in recs)
    assert glob.glob(str(tmp_path / "a" / "monitor" / "**" / "*val*"), recursive=True)


def test_val_every_without_val_data_is_an_exit_2_error():
    import sys

    proc = subprocess.run([sys.executable, "launch/train_wan.py", "--deepspeed_config", "configs/ds_tiny_cpu.json",
                           "--model-config", "configs/wan_tiny.yaml", "--synthetic", "--max-steps", "1",
                           "--val-every", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--val-every 5: needs --val-data" in proc.stderr
