"""calibrate/blocks.py and Calibration.measure_open_blocks: the open-block fields (memory.block_bytes_per_token,
block_bytes_per_sample, attention_bytes_per_token, ffn_bytes_per_token, time_ms.recompute_frac,
attention_recompute_frac and ffn_recompute_frac) recovered
from synthetic peaks and times, the points chosen so that an open run fits, and the stage in a calibration with a
faked engine."""
import os

import pytest

from ds_adaptiveload import calibrate as cal
from ds_adaptiveload.calibrate import blocks
from ds_adaptiveload.schedule.profile import CostProfile
from tests.launcher import master_port
from tests.test_calibrate import FakeStepFn, fake_calibration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = 30
# The synthetic device: per open block 56.5 KB per token and 4.5 MB per sample, 5 KB per token for a block keeping its
# attention outputs, an open micro-batch 24% faster (no recompute), and 7% faster with every block keeping attention;
# 3 KB per token and 1.5% faster more with every block keeping its FFN output too.
OPEN_PER_TOKEN, OPEN_PER_SAMPLE, ATTN_PER_TOKEN, RECOMPUTE, ATTN_RECOMPUTE = 56_500, 4.5e6, 5_000, 0.24, 0.07
FFN_PER_TOKEN, FFN_RECOMPUTE = 3_000, 0.015


class OpenFakeStepFn(FakeStepFn):
    """FakeStepFn whose peak and time follow the checkpointing set through set_checkpointing."""

    def __init__(self, *args):
        super().__init__(*args)
        self.blocks, self.policy, self.calls = True, "full", []

    def set_checkpointing(self, blocks, policy="full"):
        self.blocks, self.policy = blocks, policy

    def __call__(self, p):
        ms, step_ms, peak = super().__call__(p)
        self.calls.append((p.role, self.blocks, self.policy))
        ckpt = L if self.blocks is True else self.blocks
        kept = ckpt if self.policy in ("attention", "attention-ffn") else 0
        ffn = ckpt if self.policy == "attention-ffn" else 0
        # what open blocks and kept outputs add is activation memory: on the fwd+bwd peak, not on the floor
        extra = ((kept * ATTN_PER_TOKEN + ffn * FFN_PER_TOKEN) * p.tokens
                 + (L - ckpt) * (OPEN_PER_TOKEN * p.tokens + OPEN_PER_SAMPLE * p.B))
        self.fwd_bwd_peak = int(self.activations(p) + extra)
        peak = max(peak, self.fwd_bwd_peak)
        saved = RECOMPUTE * (L - ckpt) / L + ATTN_RECOMPUTE * kept / L + FFN_RECOMPUTE * ffn / L
        return ms * (1 - saved), step_ms, int(peak)


def point(B, s, peak, ms=1000.0):
    p = cal.Point(B, (1, 1, 1), s, s, status="ok")
    p.peak_bytes, p.ms, p.step_ms = int(peak), [ms], [100.0]
    return p


def test_derive_recovers_the_per_token_per_sample_and_attention_terms():
    clip, images = point(1, 32760, 30e9), point(16, 1560, 28e9, ms=800.0)
    opened = [blocks.open_point(clip), blocks.open_point(images)]
    for o, c, ms in zip(opened, (clip, images), (760.0, 620.0)):
        o.status, o.ms = "ok", [ms]
        o.peak_bytes = c.peak_bytes + L * (OPEN_PER_TOKEN * c.tokens + OPEN_PER_SAMPLE * c.B)
    attn = blocks.open_point(clip, "attention")
    attn.status, attn.ms, attn.peak_bytes = "ok", [900.0], clip.peak_bytes + L * ATTN_PER_TOKEN * clip.tokens
    out = blocks.derive([(clip, opened[0]), (images, opened[1])], L, (clip, attn))
    mem = out["memory"]
    assert mem["block_bytes_per_token"] == pytest.approx(OPEN_PER_TOKEN, rel=1e-6)
    assert mem["block_bytes_per_sample"] == pytest.approx(OPEN_PER_SAMPLE, rel=1e-6)
    assert mem["attention_bytes_per_token"] == pytest.approx(ATTN_PER_TOKEN, rel=1e-6)
    assert out["time_ms"]["recompute_frac"] == pytest.approx(0.24)  # from the clip, the pair with the most tokens
    assert out["time_ms"]["attention_recompute_frac"] == pytest.approx(0.1)  # 900 ms against 1000 checkpointed
    attn.ms = [500.0]  # noise saving more than all the recompute: capped at recompute_frac
    assert blocks.derive([(clip, opened[0])], L, (clip, attn))["time_ms"]["attention_recompute_frac"] == 0.24
    assert [r["role"] for r in out["points"]] == ["open", "open", "attention"]
    assert "ffn_bytes_per_token" not in mem and "ffn_recompute_frac" not in out["time_ms"]


def test_derive_recovers_the_ffn_terms_against_the_attention_run():
    clip = point(1, 32760, 30e9)
    attn, ffn = blocks.open_point(clip, "attention"), blocks.open_point(clip, "attention-ffn")
    attn.status, attn.ms, attn.peak_bytes = "ok", [900.0], clip.peak_bytes + L * ATTN_PER_TOKEN * clip.tokens
    ffn.status, ffn.ms = "ok", [885.0]
    ffn.peak_bytes = attn.peak_bytes + L * FFN_PER_TOKEN * clip.tokens
    opened = blocks.open_point(clip)
    opened.status, opened.ms, opened.peak_bytes = "ok", [760.0], clip.peak_bytes + L * OPEN_PER_TOKEN * clip.tokens
    out = blocks.derive([(clip, opened)], L, (clip, attn), ffn=(clip, ffn))
    assert out["memory"]["ffn_bytes_per_token"] == pytest.approx(FFN_PER_TOKEN, rel=1e-6)
    assert out["time_ms"]["ffn_recompute_frac"] == pytest.approx(0.015)  # 15 ms of the checkpointed 1000
    assert [r["role"] for r in out["points"]] == ["open", "attention", "attention-ffn"]
    ffn.ms = [500.0]  # noise saving more than the attention policy leaves of the recompute: capped there
    capped = blocks.derive([(clip, opened)], L, (clip, attn), ffn=(clip, ffn))["time_ms"]
    assert capped["ffn_recompute_frac"] == pytest.approx(capped["recompute_frac"] - capped["attention_recompute_frac"])
    attn.status = "skipped"  # without the attention run there is no baseline: no FFN fields
    assert "ffn_bytes_per_token" not in blocks.derive([(clip, opened)], L, (clip, attn), ffn=(clip, ffn))["memory"]


def test_derive_with_one_pair_or_none_ran():
    clip = point(1, 32760, 30e9)
    o = blocks.open_point(clip)
    assert blocks.derive([(clip, o)], L) == {"memory": {}, "time_ms": {}, "points": [blocks._row(clip, o)]}
    o.status, o.ms, o.peak_bytes = "ok", [1200.0], clip.peak_bytes + L * OPEN_PER_TOKEN * clip.tokens
    out = blocks.derive([(clip, o)], L)
    assert out["memory"] == {"block_bytes_per_token": OPEN_PER_TOKEN, "block_bytes_per_sample": 0}
    assert out["time_ms"]["recompute_frac"] == 0.0  # slower open: no recompute saved, clamped at 0


def test_choose_points_takes_the_largest_that_fit_open():
    mem = (23e9, 1.84e5, 0.0, 1.87e7)  # fit_memory's (fixed, per token, floor, per sample)
    pts = [point(1, 1560, 24e9), point(1, 32760, 30e9), point(1, 75600, 40e9), point(16, 1560, 30e9),
           point(32, 1560, 33e9), point(2, 32760, 35e9)]
    chosen = blocks.choose_points(pts, mem, 0.9 * 140 * 2**30)
    assert [(p.B, p.s) for p in chosen] == [(1, 32760), (16, 1560)]  # 75,600 tokens and 32 images do not fit open
    assert all(blocks.open_bound(p, mem) <= 0.9 * 140 * 2**30 for p in chosen)
    assert [(p.B, p.s) for p in blocks.choose_points(pts[:3] + pts[5:], mem, 0.9 * 140 * 2**30)] == [(1, 32760)]
    assert blocks.choose_points(pts, mem, 20e9) == []


def calibration(tmp_path, monkeypatch, ds, *flags):
    """(profile, the OpenFakeStepFn it ran with) of a faked-engine calibration (tests/test_calibrate.py)."""
    fake = {}

    def step_fn(*args):
        fake["fn"] = OpenFakeStepFn(*args)
        return fake["fn"]

    return fake_calibration(tmp_path, monkeypatch, ds, *flags, step_fn=step_fn), fake["fn"]


def test_calibration_writes_the_open_block_fields(tmp_path, monkeypatch):
    """ZeRO-2: both open runs and the attention run; the profile written and read back carries the fields, and
    the model is back to every block checkpointed after them."""
    prof, fn = calibration(tmp_path, monkeypatch, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    # both chosen points' checkpointed steps peak at the fake's floor: the extras count from their fwd+bwd peaks
    assert [r["ckpt_peak_bytes"] for r in prof.fit["open_blocks"]] == [int(FakeStepFn.FLOOR)] * 4
    assert prof.memory["block_bytes_per_token"] == pytest.approx(OPEN_PER_TOKEN, rel=1e-3)
    assert prof.memory["block_bytes_per_sample"] == pytest.approx(OPEN_PER_SAMPLE, rel=1e-3)
    assert prof.memory["attention_bytes_per_token"] == pytest.approx(ATTN_PER_TOKEN, rel=1e-3)
    assert prof.recompute_frac == pytest.approx(RECOMPUTE, abs=0.01)
    assert prof.attention_recompute_frac == pytest.approx(ATTN_RECOMPUTE, abs=0.01)
    assert prof.memory["ffn_bytes_per_token"] == pytest.approx(FFN_PER_TOKEN, rel=1e-3)
    assert prof.ffn_recompute_frac == pytest.approx(FFN_RECOMPUTE, abs=0.005)
    assert [r["status"] for r in prof.fit["open_blocks"]] == ["ok", "ok", "ok", "ok"]
    assert {c for c in fn.calls if c[0] == "open"} == {("open", 0, "full")}
    assert {c for c in fn.calls if c[0] == "attention"} == {("attention", L, "attention")}
    assert {c for c in fn.calls if c[0] == "attention-ffn"} == {("attention-ffn", L, "attention-ffn")}
    assert (fn.blocks, fn.policy) == (True, "full")
    prof.to_yaml(str(tmp_path / "p.yaml"))  # what `calibrate` writes (cli.run)
    back = CostProfile.load(str(tmp_path / "p.yaml"))
    assert back.recompute_frac == prof.recompute_frac and back.memory["block_bytes_per_token"] > 0
    assert back.attention_recompute_frac == prof.attention_recompute_frac > 0
    assert back.ffn_recompute_frac == prof.ffn_recompute_frac > 0


def test_zero3_skips_the_attention_run_and_no_open_blocks_skips_all(tmp_path, monkeypatch):
    z3 = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    prof, fn = calibration(tmp_path, monkeypatch, z3)
    assert [r["role"] for r in prof.fit["open_blocks"]] == ["open", "open"]
    assert "attention_bytes_per_token" not in prof.memory and prof.memory["block_bytes_per_token"] > 0
    assert "ffn_bytes_per_token" not in prof.memory and prof.attention_recompute_frac == prof.ffn_recompute_frac == 0.0
    prof, fn = calibration(tmp_path, monkeypatch, z3, "--no-open-blocks")
    assert "open_blocks" not in prof.fit and "block_bytes_per_token" not in prof.memory
    assert prof.recompute_frac == 0.0 and not any(c[0] == "open" for c in fn.calls)



_REAL_ENGINE_RUN = """
import sys
sys.path.insert(0, {root!r})
from ds_adaptiveload.calibrate import engine
from ds_adaptiveload.cli import main

# CPU has no peak memory: a synthetic one from the model's checkpointing as the real engine runs it, and a capacity
engine.capacity = lambda device: 64 * 2**30
def peak(self, p):
    m = self.engine.module
    ckpt = len(m.blocks) if m.checkpoint_blocks is True else m.checkpoint_blocks
    keep = ckpt if m.checkpoint_policy == "attention" else 0
    ffn = m.checkpoint_ffn_blocks
    return int(2**30 + 1000 * p.tokens + (len(m.blocks) - ckpt) * (300 * p.tokens + 5000 * p.B) + 20 * keep * p.tokens
               + 7 * ffn * p.tokens)
engine.StepFn._peak = peak
step = engine.StepFn.__call__
def timed(self, p):  # the real step runs; its time is synthetic too (2 cores under load time noise, not work)
    _, step_ms, peak_bytes = step(self, p)
    m = self.engine.module
    ckpt = len(m.blocks) if m.checkpoint_blocks is True else m.checkpoint_blocks
    keep = ckpt if m.checkpoint_policy == "attention" else 0
    ms = 0.1 * p.B * p.s * (1 + 0.3 * ckpt / len(m.blocks)) * (1 - 0.1 * keep / len(m.blocks))
    return ms * (1 - 0.02 * m.checkpoint_ffn_blocks / len(m.blocks)), step_ms, peak_bytes
engine.StepFn.__call__ = timed
sys.exit(main(["calibrate", "--model-config", "configs/wan_tiny.yaml", "--deepspeed_config", {ds!r},
               "--out", {out!r}, "--shapes", "1x64x64,5x64x64,9x64x64,17x64x96", "--heldout", "",
               "--batches", "1,2,4", "--probe-tokens", "192", "--repeats", "2", "--time-budget", "120",
               "--no-probe-budget", "--packs", "0"]))
"""


def test_open_block_runs_on_a_real_zero2_engine(tmp_path):
    """The open, attention-policy and FFN-keeping runs through the real StepFn and a DeepSpeed ZeRO-2 engine (tiny
    model, one gloo process): set_checkpointing switches what the model recomputes, and the fields come out of the
    (synthetic, checkpointing-driven) peaks: 300 bytes per token and 5,000 per sample per open block, 20 per attention
    block, 7 per FFN output kept, and times (0.3 x the open time more with every block checkpointed, 10% less with
    every block keeping attention, 2% less again with every FFN output kept)."""
    import json
    import subprocess
    import sys

    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        ds = json.load(f)
    ds["zero_optimization"] = {"stage": 2}
    ds["csv_monitor"]["enabled"] = False
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "p.yaml"
    code = _REAL_ENGINE_RUN.format(root=ROOT, ds=str(tmp_path / "ds.json"), out=str(out))
    env = dict(os.environ, MASTER_PORT=str(master_port()), OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    prof = CostProfile.load(str(out))
    assert [r["status"] for r in prof.fit["open_blocks"]] == ["ok", "ok", "ok", "ok"], prof.fit["open_blocks"]
    assert prof.memory["block_bytes_per_token"] == pytest.approx(300, rel=1e-3)
    assert prof.memory["block_bytes_per_sample"] == pytest.approx(5000, rel=1e-3)
    assert prof.memory["attention_bytes_per_token"] == pytest.approx(20, rel=1e-3)
    assert prof.recompute_frac == pytest.approx(1 - 1 / 1.3, abs=1e-3)  # the synthetic time: 0.3 more per block
    assert prof.attention_recompute_frac == pytest.approx(0.1, abs=1e-3)  # and 10% less keeping every attention
    assert prof.memory["ffn_bytes_per_token"] == pytest.approx(7, abs=0.5)
    assert prof.ffn_recompute_frac == pytest.approx(0.9 * 0.02, abs=1e-3)  # 2% of the attention run's time


def test_derive_differences_against_the_fwd_bwd_peak_not_the_optimizer_floor():
    """A checkpointed point whose step peak is the floor (the optimizer step's, above its fwd+bwd): the extra bytes of
    the open and attention runs count from the fitted line's fwd+bwd peak (ckpt_peak). Against the floor they came
    out 2,716 instead of ~5,300 bytes per token for attention on the H200 (docs/history/benchmarks.md, thirteenth
    session)."""
    fixed, per_token, per_sample, floor = 23e9, 172_500.0, 22.6e6, 31.3e9
    mem = (fixed, per_token, floor, per_sample)
    clip, images = point(1, 32760, floor), point(16, 1560, floor * 1.001)  # both steps peak at the floor
    line = {id(c): fixed + per_token * c.tokens + per_sample * c.B for c in (clip, images)}
    opened = [blocks.open_point(clip), blocks.open_point(images)]
    for o, c in zip(opened, (clip, images)):
        o.status, o.ms = "ok", [700.0]
        o.peak_bytes = line[id(c)] + L * (OPEN_PER_TOKEN * c.tokens + OPEN_PER_SAMPLE * c.B)
    attn = blocks.open_point(clip, "attention")
    attn.status, attn.ms, attn.peak_bytes = "ok", [900.0], line[id(clip)] + L * ATTN_PER_TOKEN * clip.tokens
    out = blocks.derive([(clip, opened[0]), (images, opened[1])], L, (clip, attn), mem)["memory"]
    assert out["block_bytes_per_token"] == pytest.approx(OPEN_PER_TOKEN, rel=1e-4)
    assert out["block_bytes_per_sample"] == pytest.approx(OPEN_PER_SAMPLE, rel=1e-3)
    assert out["attention_bytes_per_token"] == pytest.approx(ATTN_PER_TOKEN, rel=1e-3)
    low = blocks.derive([(clip, opened[0]), (images, opened[1])], L, (clip, attn))["memory"]  # against the floor
    assert low["attention_bytes_per_token"] < 0.8 * ATTN_PER_TOKEN
    above = point(1, 32760, floor * 1.5)  # above the floor: the measured peak is the fwd+bwd peak
    assert blocks.ckpt_peak(above, mem) == above.peak_bytes and blocks.ckpt_peak(clip, None) == clip.peak_bytes


def test_shipped_zero2_profile_fields_are_derive_of_its_stored_runs():
    """configs/profiles/h200-wan1.3b-zero2.yaml's open-block fields are what blocks.derive makes of the runs stored
    in its fit.open_blocks, with its fitted memory line."""
    from types import SimpleNamespace as NS

    prof = CostProfile.load(os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero2.yaml"))
    m, fit = prof.memory, prof.fit

    def run(r, peak, ms, role):
        return NS(role=role, B=r["B"], shape=r["shape"], tokens=r["tokens"], status="ok", peak_bytes=r[peak],
                  median_ms=r[ms], note="")

    pairs = [(run(r, "ckpt_peak_bytes", "ckpt_ms", "fit"), run(r, "peak_bytes", "ms", r["role"]))
             for r in fit["open_blocks"]]
    mem = (m["fixed_bytes"], m["bytes_per_token"], fit["memory"]["floor_bytes_measured"], m["bytes_per_sample"])
    out = blocks.derive([p for p in pairs if p[1].role == "open"], prof.meta["model"]["num_layers"],
                        next(p for p in pairs if p[1].role == "attention"), mem)
    assert out["memory"] == {k: m[k] for k in ("block_bytes_per_token", "block_bytes_per_sample",
                                               "attention_bytes_per_token")}
    assert out["time_ms"] == {"recompute_frac": prof.recompute_frac, "attention_recompute_frac":
                              prof.attention_recompute_frac}
