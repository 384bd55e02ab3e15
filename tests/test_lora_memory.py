"""The LoRA memory and cost model: state bytes without the base's optimizer state and gradients (schedule/zero.py), a
full-training profile moved to a LoRA run (bigger budget), LoRA model FLOPs, and `calibrate --lora-rank` on CPU."""
import os
import subprocess
import sys

import pytest
import yaml

from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.schedule.zero import for_run, lora_of, state_bytes
from ds_adaptiveload.train.config import LoraSettings
from tests.launcher import master_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W13 = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml"))
W14 = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_14b.yaml"))
MODS = LoraSettings(rank=32).modules()


def test_state_bytes_of_a_lora_run():
    P, L = W14.num_params(), W14.lora_params(32, MODS)
    assert state_bytes(P, 2, 1, L) == 2 * P + 16 * L  # bf16 base, adapters with grads and Adam
    assert state_bytes(P, 3, 4, L) == 2 * P / 4 + 16 * L / 4
    assert state_bytes(P, 1, 4, L) == 2 * P + 4 * L + 12 * L / 4
    assert 30e9 < state_bytes(P, 2, 1, L) < 32e9 < 220e9 < state_bytes(P, 2, 1)  # 14B: 31 GB against 229 GB


def test_full_profile_moved_to_a_lora_run_gains_budget():
    prof = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "h100-wan1.3b-zero2.yaml"))
    stage, world = prof.meta["zero_stage"], prof.meta["train_world_size"]
    P, L = W13.num_params(), W13.lora_params(32, MODS)
    moved, notes = for_run(prof, stage, world, "p.yaml", lora=L)
    freed = state_bytes(P, stage, world) - state_bytes(P, stage, world, L)
    assert moved.memory["fixed_bytes"] == round(prof.memory["fixed_bytes"] - freed)
    assert moved.budget_tokens == int(prof.budget_tokens + freed / prof.memory["bytes_per_token"])
    assert moved.budget_tokens > prof.budget_tokens * 1.1
    assert lora_of(moved) == L and "full training to LoRA (43,745,280 adapter parameters)" in notes[0]
    back, _ = for_run(moved, stage, world, "p.yaml")  # and back to full training: the same budget
    assert abs(back.budget_tokens - prof.budget_tokens) <= 1 and lora_of(back) is None
    assert for_run(moved, stage, world, "p.yaml", lora=L)[0] is moved  # already for this run


def test_lora_flops():
    S = 75_600
    lora, full = W14.lora_flops_per_sample(S, 32, MODS), W14.flops_per_sample(S)
    no_adapters = W14.lora_flops_per_sample(S, 0, MODS)
    # adapters: forward, input and weight gradients = 3 x 2 x r x (in + out) per token, cross k/v on the text
    d, f, t = W14.dim, W14.ffn_dim, W14.text_len
    per_block = S * (6 * 2 * d + (d + f) + (f + d)) + t * 2 * 2 * d  # 6 projections of S rows, cross k, v of t
    assert lora - no_adapters == pytest.approx(3 * 2 * 32 * per_block * W14.num_layers)
    # no weight gradients and nothing for the embeddings: less than a full step, more than its 2/3
    assert 2 / 3 * full < no_adapters < full
    # with attention dominant at 720p 81f (~70% of the FLOPs), LoRA saves ~10%
    assert 0.85 < lora / full < 0.95


@pytest.mark.slow
def test_calibrate_lora_rank_on_cpu(tmp_path):
    """The measuring loop with --lora-rank: the step measured trains adapters only; meta.lora names them."""
    out = tmp_path / "tiny-lora.yaml"
    # One thread, two timed repeats, and micro-batches from 256 to 4 x 3,456 tokens: the fit needs times that grow
    # with tokens, and with 2 threads, one repeat and at most 2 x 1,920 tokens, timing noise on a busy 2-core
    # machine once made the smallest micro-batch the slowest (calibrate then rightly refuses to fit).
    env = dict(os.environ, MASTER_PORT=str(master_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ds_adaptiveload", "calibrate", "--model-config", "configs/wan_tiny.yaml",
         "--deepspeed_config", "configs/ds_tiny_cpu.json", "--out", str(out), "--lora-rank", "4",
         "--lora-targets", "self_attn,ffn", "--shapes", "1x256x256,9x256x256,17x256x384,33x256x384",
         "--heldout", "", "--batches", "1,4", "--no-probe-budget", "--no-open-blocks", "--packs", "0", "--repeats", "2",
         "--time-budget", "150"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    meta = yaml.safe_load(out.read_text())["meta"]
    tiny = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    mods = LoraSettings(rank=4, targets=["self_attn", "ffn"]).modules()
    assert meta["lora"] == {"rank": 4, "alpha": None, "targets": ["self_attn", "ffn"],
                            "params": tiny.lora_params(4, mods)}
    bad = subprocess.run([sys.executable, "-m", "ds_adaptiveload", "calibrate", "--model-config",
                          "configs/wan_1_3b.yaml", "--deepspeed_config", "configs/ds_zero2_bf16.json", "--out",
                          str(tmp_path / "x.yaml"), "--estimate", "--lora-rank", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --estimate models full training only")


def test_docs_fits_table_is_the_scripts():
    """docs/training.md's what-fits-where table is bench/lora/fits.py's output (regenerate it after a change)."""
    sys.path.insert(0, os.path.join(ROOT, "bench", "lora"))
    import fits

    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        text = f.read()
    start = text.index("<!-- fits: python bench/lora/fits.py -->\n") + len("<!-- fits: python bench/lora/fits.py -->\n")
    assert text[start:text.index("<!-- /fits -->")] == fits.table()
    # the memory model's verdicts: the 14B 720p 81f clip needs offload on 80 GB, fits 141 GB as it is
    rows = [r.split(" | ") for r in fits.table().splitlines()[2:]]
    verdict = {(r[0].strip("| "), r[1], r[2], r[4]): r[6] for r in rows}
    assert verdict[("14B", "720p", "81", "80 GB")] == "with offload"
    assert verdict[("14B", "720p", "81", "141 GB")] == "yes"
