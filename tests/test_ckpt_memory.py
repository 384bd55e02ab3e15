"""schedule/memory.py: how many blocks a micro-batch must checkpoint to fit, and the recompute left; and the
ZeRO-2 config it is shipped with."""
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.memory import (RecomputeCost, blocks_to_checkpoint, predicted_peak_bytes,
                                             recompute_factor, selective_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
L = 30
# H200-like: 140 GiB, 12 GiB fixed, 224 kB/token with every block checkpointed, 100 kB/token per open block
MEM = {"capacity_bytes": 140 * GIB, "safety": 0.9, "fixed_bytes": 12 * GIB, "bytes_per_token": 224e3,
       "bytes_per_sample": 20e6, "block_bytes_per_token": 100e3, "budget_tokens": 500_000}


def brute_force(tokens, samples, mem):
    for k in range(L + 1):
        if predicted_peak_bytes(tokens, samples, mem, L, k) <= mem["capacity_bytes"] * mem["safety"]:
            return k
    return L


def test_without_block_bytes_every_block_is_checkpointed():
    mem = {k: v for k, v in MEM.items() if k != "block_bytes_per_token"}
    assert blocks_to_checkpoint(1560, 1, mem, L) == L
    assert blocks_to_checkpoint(1560, 1, {"budget_tokens": 75600}, L) == L  # a profile with a token budget only
    assert RecomputeCost(mem, L, 0.25).factor(1560, 1) == 1.0  # every block checkpointed: the calibrated time


@pytest.mark.parametrize("tokens, samples", [(1560, 1), (1560 * 32, 32), (32760, 1), (75600, 1), (200_000, 4),
                                             (400_000, 1), (10**7, 1)])
def test_fewest_blocks_that_fit(tokens, samples):
    k = blocks_to_checkpoint(tokens, samples, MEM, L)
    assert k == brute_force(tokens, samples, MEM)
    cap = MEM["capacity_bytes"] * MEM["safety"]
    if k < L:
        assert predicted_peak_bytes(tokens, samples, MEM, L, k) <= cap
    if k > 0 and predicted_peak_bytes(tokens, samples, MEM, L, L) <= cap:
        assert predicted_peak_bytes(tokens, samples, MEM, L, k - 1) > cap  # one fewer would not fit


def test_small_micro_batches_checkpoint_nothing_large_ones_some_or_all():
    assert blocks_to_checkpoint(1560, 1, MEM, L) == 0
    assert blocks_to_checkpoint(32760, 1, MEM, L) == 0       # 32760 * (224k + 30 * 100k) = 106 GB < 113 GB
    k720 = blocks_to_checkpoint(75600, 1, MEM, L)
    assert 0 < k720 < L
    assert blocks_to_checkpoint(10**7, 1, MEM, L) == L       # does not fit even fully checkpointed
    ks = [blocks_to_checkpoint(s, 1, MEM, L) for s in range(1000, 600_000, 7919)]
    assert ks == sorted(ks)                                   # more tokens never checkpoint fewer blocks


def test_per_sample_bytes_count():
    # the same tokens split over more samples hold more per-sample buffers (text context)
    mem = dict(MEM, bytes_per_sample=3e9)
    assert blocks_to_checkpoint(32760, 8, mem, L) > blocks_to_checkpoint(32760, 1, mem, L)


def test_recompute_factor():
    assert recompute_factor(L, L, 0.25) == 1.0
    assert recompute_factor(0, L, 0.25) == pytest.approx(0.75)
    assert recompute_factor(15, L, 0.25) == pytest.approx(0.875)
    assert recompute_factor(0, L) == 1.0 and recompute_factor(0, L, None) == 1.0
    # the attention policy: of k = 30 checkpointed blocks, 20 keep their attention outputs
    assert recompute_factor(L, L, 0.25, 10, 0.06) == pytest.approx(1 - 0.06 * 20 / L)
    assert recompute_factor(20, L, 0.25, 5, 0.06) == pytest.approx(1 - 0.25 * 10 / L - 0.06 * 15 / L)
    cost = RecomputeCost(MEM, L, 0.3)
    k, _ = cost.ks(75600, 1)
    assert 0 < k < L and cost.factor(75600, 1) == pytest.approx(1 - 0.3 * (1 - k / L))
    assert cost.factor(1560, 1) == pytest.approx(0.7)  # an image fits with every block open
    attn = RecomputeCost(dict(MEM, attention_bytes_per_token=5e3), L, 0.3, 0.08, policy="attention")
    k, k_full = selective_checkpoint(300_000, 1, attn.memory, L)
    assert attn.ks(300_000, 1) == (k, k_full)
    assert attn.factor(300_000, 1) == pytest.approx(recompute_factor(k, L, 0.3, k_full, 0.08))
    assert attn.factor(0, 0, ks=(L, 0)) == pytest.approx(1 - 0.08)  # every block keeping its attention


@pytest.mark.parametrize("call, word", [
    (lambda: blocks_to_checkpoint(-1, 1, MEM, L), "tokens"),
    (lambda: blocks_to_checkpoint(10, 1.5, MEM, L), "samples"),
    (lambda: blocks_to_checkpoint(10, 1, MEM, 0), "num_layers"),
    (lambda: blocks_to_checkpoint(10, 1, [1], L), "profile_memory"),
    (lambda: blocks_to_checkpoint(10, 1, dict(MEM, block_bytes_per_token=-1), L), "block_bytes_per_token"),
    (lambda: blocks_to_checkpoint(10, 1, dict(MEM, safety=1.5), L), "safety"),
    (lambda: recompute_factor(0, L, 1.0), "recompute_frac"),
    (lambda: recompute_factor(31, L, 0.1), "k"),
    (lambda: recompute_factor(10, L, 0.1, 11), "k_full"),
    (lambda: recompute_factor(10, L, 0.1, 5, -0.1), "attention_recompute_frac"),
    (lambda: RecomputeCost(MEM, L, 0.2, policy="some"), "policy"),
    (lambda: predicted_peak_bytes(10, 1, {"fixed_bytes": 1}, L, 0), "bytes_per_token"),
])
def test_bad_input_names_the_argument(call, word):
    with pytest.raises(UserError, match=word):
        call()


def test_memory_module_imports_without_torch():
    code = "import sys, ds_adaptiveload.schedule.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_zero2_config_matches_the_zero3_one_but_for_zero():
    from ds_adaptiveload.train.config import load_ds_config

    z2, al2 = load_ds_config(os.path.join(ROOT, "configs", "ds_zero2_bf16.json"))
    z3, al3 = load_ds_config(os.path.join(ROOT, "configs", "ds_zero3_bf16.json"))
    zo = z2["zero_optimization"]
    assert zo["stage"] == 2 and zo["overlap_comm"] and zo["contiguous_gradients"]
    assert z2["bf16"] == {"enabled": True}
    for key in ("optimizer", "scheduler", "gradient_accumulation_steps", "gradient_clipping"):
        assert z2[key] == z3[key], key
    assert set(al2.to_dict()) == set(al3.to_dict()) and al2.policy == al3.policy
    assert al2.profile == al3.profile == "auto"  # the shipped profile of the GPU in use (ds_adaptiveload/shipped.py)
    from ds_adaptiveload.schedule.profile import CostProfile

    for gpu in ("h100", "h200"):  # the ZeRO-2 profiles auto picks, with the open-block fields
        prof = CostProfile.load(os.path.join(ROOT, "configs", "profiles", f"{gpu}-wan1.3b-zero2.yaml"))
        assert prof.meta["zero_stage"] == 2 and prof.memory["block_bytes_per_token"] > 0
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(**zo).stage == 2  # DeepSpeed's own schema accepts every key
    with open(os.path.join(ROOT, "configs", "ds_zero2_bf16.json")) as f:
        assert json.load(f)["zero_optimization"]["reduce_bucket_size"] >= 5e7


def test_selective_checkpoint_keeps_attention_before_opening_blocks():
    from ds_adaptiveload.schedule.memory import predicted_peak_bytes, selective_checkpoint

    L = 30
    mem = {"capacity_bytes": 100e9, "safety": 1.0, "fixed_bytes": 20e9, "bytes_per_token": 160e3,
           "block_bytes_per_token": 80e3, "attention_bytes_per_token": 5e3}
    assert selective_checkpoint(100_000, 1, {**mem, "attention_bytes_per_token": None}, L) == (
        blocks_to_checkpoint(100_000, 1, mem, L),) * 2  # no field: every checkpointed block whole
    seen = set()
    for tokens in (1_000, 50_000, 200_000, 230_000, 400_000, 480_000, 600_000):
        k, k_full = selective_checkpoint(tokens, 1, mem, L)
        assert 0 <= k_full <= k <= L
        kept = k - k_full  # blocks keeping attention; open blocks only once every block keeps it
        assert k_full == 0 or k == L
        # fits: the full-policy peak with L - k open blocks plus the kept blocks' attention bytes
        peak = predicted_peak_bytes(tokens, 1, mem, L, k) + tokens * kept * mem["attention_bytes_per_token"]
        assert predicted_peak_bytes(tokens, 1, mem, L, k, k_full) == pytest.approx(peak)  # the pair's own form
        assert peak <= mem["capacity_bytes"] or k_full == L, (tokens, k, k_full)
        # and is the most it can keep: one block fewer recomputed whole would not fit
        if 0 < k_full < L:
            more = peak + tokens * mem["attention_bytes_per_token"]
            assert more > mem["capacity_bytes"], (tokens, k, k_full)
        seen.add((k == L, k_full > 0))
    assert seen >= {(True, True), (True, False), (False, False)}, seen
    assert selective_checkpoint(1_000_000, 1, mem, L) == (L, L)  # nothing fits: all whole, as before


@pytest.mark.parametrize("tokens, samples", [(1560 * 32, 32), (1560 * 64, 64), (75600, 1), (200_000, 40)])
def test_open_blocks_pay_their_per_sample_bytes(tokens, samples):
    """memory.block_bytes_per_sample: what an open block adds per sample (the text context's keys and values). The
    count k and the peak both take it; without the key the plans are as before."""
    from ds_adaptiveload.schedule.memory import selective_checkpoint

    mem = dict(MEM, block_bytes_per_sample=9e6)
    k = blocks_to_checkpoint(tokens, samples, mem, L)
    assert k == brute_force(tokens, samples, mem) >= blocks_to_checkpoint(tokens, samples, MEM, L)
    assert predicted_peak_bytes(tokens, samples, mem, L, k) == pytest.approx(
        predicted_peak_bytes(tokens, samples, MEM, L, k) + samples * (L - k) * 9e6)
    attn = dict(mem, attention_bytes_per_token=5e3)
    k, k_full = selective_checkpoint(tokens, samples, attn, L)
    cap = MEM["capacity_bytes"] * MEM["safety"]
    assert predicted_peak_bytes(tokens, samples, attn, L, k, k_full) <= cap or k_full == L
    if 0 < k < L and k_full == 0:  # one more open block would not fit
        assert predicted_peak_bytes(tokens, samples, attn, L, k - 1, 0) > cap
    assert selective_checkpoint(tokens, samples, dict(attn, block_bytes_per_sample=0), L) == selective_checkpoint(
        tokens, samples, dict(MEM, attention_bytes_per_token=5e3), L)


FFN_MEM = {"capacity_bytes": 100e9, "safety": 1.0, "fixed_bytes": 20e9, "bytes_per_token": 160e3,
           "block_bytes_per_token": 80e3, "attention_bytes_per_token": 5e3, "ffn_bytes_per_token": 3e3,
           "block_bytes_per_sample": 1e6}


def ladder_time(k, k_full, k_ffn):
    """recompute_factor with H200-like fractions: open > attention kept > FFN output kept, per block."""
    return recompute_factor(k, L, 0.21, k_full, 0.14, k_ffn, 0.011)


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 700_000), samples=st.integers(1, 200))
def test_ffn_outputs_come_after_attention_and_before_open_blocks(tokens, samples):
    """memory.ffn_bytes_per_token: the configuration (k, k_full, k_ffn) fits whenever anything does, fills the
    ladder in order (whole -> attention kept -> FFN output kept -> open) with at most two rungs in use, and no
    configuration one rung up on one block would fit."""
    from ds_adaptiveload.schedule.memory import ffn_blocks

    k, k_full = selective_checkpoint(tokens, samples, FFN_MEM, L)
    k_ffn = ffn_blocks(tokens, samples, FFN_MEM, L, k, k_full)
    assert 0 <= k_full <= k <= L and 0 <= k_ffn <= k - k_full
    cap = FFN_MEM["capacity_bytes"]
    peak = predicted_peak_bytes(tokens, samples, FFN_MEM, L, k, k_full, k_ffn)
    assert peak <= cap * (1 + 1e-12) or k_full == L
    rungs = [k_full, k - k_full - k_ffn, k_ffn, L - k]  # blocks on each rung
    used = [i for i, n in enumerate(rungs) if n]
    assert used == list(range(used[0], used[0] + len(used))) and len(used) <= 2, rungs
    if tokens == 0 or k_full == L:
        return
    ups = []  # one block one rung higher
    if k_full:
        ups.append((k, k_full - 1, k_ffn))
    elif k_ffn < k:
        ups.append((k, 0, k_ffn + 1))
    elif k:
        ups.append((k - 1, 0, k - 1))
    for up in ups:
        assert predicted_peak_bytes(tokens, samples, FFN_MEM, L, *up) > cap, (tokens, samples, (k, k_full, k_ffn), up)
        assert ladder_time(*up) < ladder_time(k, k_full, k_ffn)  # and it would have been faster


def test_ffn_field_absent_or_full_policy_keeps_no_ffn_output():
    from ds_adaptiveload.schedule.memory import checkpoint_ks, ffn_blocks

    plain = {key: v for key, v in FFN_MEM.items() if key != "ffn_bytes_per_token"}
    for tokens in (1_000, 200_000, 400_000):
        ks = selective_checkpoint(tokens, 1, plain, L)
        assert ffn_blocks(tokens, 1, plain, L, *ks) == 0
        k, k_full = checkpoint_ks(tokens, 1, FFN_MEM, L, "full")
        assert k == k_full and ffn_blocks(tokens, 1, FFN_MEM, L, k, k_full) == 0
    # with the field, a micro-batch that opened blocks before opens fewer: FFN outputs take that memory first
    assert selective_checkpoint(200_000, 1, FFN_MEM, L)[0] > selective_checkpoint(200_000, 1, plain, L)[0]


def test_recompute_cost_counts_the_ffn_blocks():
    from ds_adaptiveload.schedule.memory import ffn_blocks

    attn = RecomputeCost(FFN_MEM, L, 0.21, 0.14, "attention", ffn_frac=0.011)
    for tokens in (50_000, 200_000, 350_000):
        k, k_full = attn.ks(tokens, 1)
        k_ffn = ffn_blocks(tokens, 1, FFN_MEM, L, k, k_full)
        assert attn.ffn_blocks(tokens, 1) == k_ffn
        assert attn.factor(tokens, 1) == pytest.approx(ladder_time(k, k_full, k_ffn))
    assert RecomputeCost(FFN_MEM, L, 0.21, 0.14, "full", ffn_frac=0.011).ffn_blocks(200_000, 1) == 0
    assert attn.factor(200_000, 1, (30, 30)) == pytest.approx(ladder_time(30, 30, 0))  # a step's own ks: no FFN
    with pytest.raises(UserError, match="k_ffn"):
        predicted_peak_bytes(1000, 1, FFN_MEM, L, 10, 4, 7)
    with pytest.raises(UserError, match="ffn_recompute_frac"):
        RecomputeCost(FFN_MEM, L, 0.21, 0.14, "attention", ffn_frac=1.5)
