"""calibrate's pure parts and stages: the fits recover known coefficients, OOM points become bounds, the time budget
holds, and the stages run with a faked engine (the command itself and 2-rank runs: test_calibrate_runs.py)."""
import os
import random
import subprocess
import sys
import time

import pytest

from ds_adaptiveload import calibrate as cal
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.profile import CostProfile, smooth_max
from tests.launcher import master_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEO = Geometry()
TRUE = (60.0, 0.017, 1.6e-6)  # fixed, per_token, per_token_sq (ms): the 1.3B block profile x 1.36


def model_ms(p, coef=TRUE):
    f, a, b = coef
    return f + a * p.B * p.s + b * p.B * p.s * p.s


def fake_step(noise=0.02, seed=0, oom_over=None, mem=(20e9, 2.2e5), floor=0):
    """step_fn with the TRUE time model, multiplicative noise, a linear memory model above `floor` (fixed,
    per token[, per sample]) and an OOM threshold."""
    rng = random.Random(seed)

    def step(p):
        if oom_over and p.tokens > oom_over:
            raise MemoryError(f"CUDA out of memory at {p.tokens} tokens")
        peak = mem[0] + mem[1] * p.tokens + (mem[2] * p.B if len(mem) > 2 else 0)
        return model_ms(p) * (1 + rng.gauss(0, noise)), 12.0, int(max(floor, peak))
    return step


def points(**kw):
    return cal.grid_points(cal.GRID_SHAPES, cal.HELDOUT_SHAPES, GEO, **kw)


def test_grid_covers_images_to_longest_clip_and_puts_b1_first():
    pts = points()
    fit = [p for p in pts if p.role == "fit"]
    assert {p.S for p in fit} == {1560, 4680, 9360, 18720, 32760, 46800, 75600}
    # priority: shortest B=1, shortest largest-B, longest B=1, then the other B=1 shortest first
    assert [(p.S, p.B) for p in pts[:3]] == [(1560, 1), (1560, 32), (75600, 1)]
    assert [p.S for p in pts[3:8]] == [4680, 9360, 18720, 32760, 46800] and all(p.B == 1 for p in pts[3:8])
    assert all(p.role == "heldout" and p.B == 1 for p in pts[8:13])
    assert all(p.tokens <= 75600 for p in fit) and max(p.B for p in fit if p.S == 1560) == 32
    assert {p.S for p in pts if p.role == "heldout"}.isdisjoint({p.S for p in fit})
    # under sp=2 the per-GPU tokens halve (rounded up)
    assert {p.s for p in points(sp=2) if p.B == 1 and p.role == "fit"} == {780, 2340, 4680, 9360, 16380, 23400, 37800}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_time_recovers_known_coefficients_with_noise(seed):
    pts = points()
    cal.time_schedule(pts, fake_step(noise=0.02, seed=seed), budget_s=1e9, repeats=3)
    fixed, a, b, floor = cal.fit_time(pts)
    assert floor == 0  # no floor in the data: the noise must not buy one (seed 2 fits one under every point)
    assert fixed == pytest.approx(TRUE[0], rel=0.15)
    assert a == pytest.approx(TRUE[1], rel=0.10)
    assert b == pytest.approx(TRUE[2], rel=0.05)
    rows = cal.report(pts, (fixed, a, b, floor), None)
    held = cal.err_summary(rows, "heldout")
    assert held["n"] >= 5 and held["worst_abs_rel_err"] < 0.08


@pytest.mark.parametrize("seed", [0, 1])
def test_fit_time_finds_a_host_bound_floor(seed):
    """Steps that cannot go below ~1 s (ZeRO-3's host-side gathers on one GPU) and the line above it: the
    fit recovers both, and predicts held-out shapes on either side; a plain line does not."""
    rng = random.Random(seed)
    floor_ms = 1000.0

    def step(p):
        return max(floor_ms, model_ms(p)) * (1 + rng.gauss(0, 0.03)), 12.0, None

    pts = points()
    cal.time_schedule(pts, step, budget_s=1e9, repeats=3)
    coef = cal.fit_time(pts)
    assert coef[3] == pytest.approx(floor_ms, rel=0.08)
    assert coef[1] == pytest.approx(TRUE[1], rel=0.15) and coef[2] == pytest.approx(TRUE[2], rel=0.1)
    held = cal.err_summary(cal.report(pts, coef, None), "heldout")
    fit = [p for p in pts if p.role == "fit" and p.status == "ok"]
    y = [p.median_ms for p in fit]
    plain = cal.nnls([(1.0, p.B * p.s, p.B * p.s * p.s) for p in fit], y, [1 / v for v in y])
    line = cal.err_summary(cal.report(pts, (*plain, 0.0), None), "heldout")
    assert held["median_abs_rel_err"] < 0.05 and line["median_abs_rel_err"] > 2 * held["median_abs_rel_err"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_time_recovers_a_soft_knee(seed):
    """Host and GPU work overlapping only partly (as measured under ZeRO-3): near the knee a step takes
    longer than either. On points dense around it the fit recovers floor and line and predicts held-out
    shapes there within 3.5% of the truth; a hard max is 5-8% low there."""
    rng = random.Random(seed)
    floor_ms = 1000.0

    def truth(p):
        return smooth_max(floor_ms, model_ms(p), cal.TIME_FLOOR_Q)

    fit = [(1, s) for s in (1560, 4680, 9360, 14040, 18720, 23400, 32760, 46800, 75600)]
    fit += [(b, 1560) for b in (2, 4, 8, 16, 32)] + [(b, 4680) for b in (2, 4, 8)] + [(2, 9360), (4, 9360), (2, 18720)]
    held = [(1, s) for s in (12000, 16000, 20000, 26000)] + [(3, 6000), (2, 12000), (6, 3000)]
    pts = [cal.Point(B, (1, 1, 1), s, s) for B, s in fit] + [cal.Point(B, (1, 1, 1), s, s, role="heldout")
                                                             for B, s in held]
    for p in pts:
        p.status, p.step_ms, p.ms = "ok", [12.0], [truth(p) * (1 + rng.gauss(0, 0.02)) for _ in range(3)]
    coef = cal.fit_time(pts)
    assert coef[3] == pytest.approx(floor_ms, rel=0.03)
    assert coef[1] == pytest.approx(TRUE[1], rel=0.2) and coef[2] == pytest.approx(TRUE[2], rel=0.05)
    assert max(abs(cal.predict_ms(coef, p.B, p.s) / truth(p) - 1) for p in pts if p.role == "heldout") < 0.035
    # the model itself: the line alone without a floor, 2^(1/q) x both where they meet, the larger far from it
    assert cal.predict_ms((60.0, 0.01, 0.0, 0.0), 2, 1000) == pytest.approx(80.0)
    assert cal.predict_ms((0.0, 1.0, 0.0, 500.0), 1, 500) == pytest.approx(500 * 2 ** (1 / cal.TIME_FLOOR_Q))
    assert cal.predict_ms((0.0, 1.0, 0.0, 500.0), 1, 5000) == pytest.approx(5000, rel=1e-6)


def test_nnls_clamps_to_non_negative():
    # data from a negative intercept: the unconstrained fit would return it; NNLS must not
    rows = [(1.0, x) for x in (1, 2, 3, 4, 5)]
    y = [-1.0 + 2.0 * x for x in (1, 2, 3, 4, 5)]
    c = cal.nnls(rows, y)
    assert c[0] == 0.0 and c[1] > 0
    # exact data with all-positive coefficients is recovered exactly
    rows = [(1.0, x, x * x) for x in (1, 2, 4, 8)]
    assert cal.nnls(rows, [3 + 2 * x + 0.5 * x * x for x in (1, 2, 4, 8)]) == pytest.approx([3, 2, 0.5])


def test_fit_memory_and_budget():
    pts = points()
    cal.time_schedule(pts, fake_step(), budget_s=1e9)
    fixed_bytes, bpt, _, per_sample = cal.fit_memory(pts)
    assert fixed_bytes == pytest.approx(20e9, rel=1e-3) and bpt == pytest.approx(2.2e5, rel=1e-3)
    assert per_sample < 1e-3 * bpt  # none in the data: none fitted
    cap = 141 * 2**30
    b = cal.budget_tokens(cap, 0.9, fixed_bytes, bpt)
    assert b == int((cap * 0.9 - fixed_bytes) / bpt)
    assert cal.budget_tokens(cap, 0.9, fixed_bytes, bpt, oom_tokens=100_000) == 90_000
    with pytest.raises(ValueError, match="no token budget"):
        cal.budget_tokens(10 * 2**30, 0.9, 20e9, bpt)


def test_fit_memory_above_a_floor():
    """As measured on the H200 under ZeRO-3: every micro-batch up to ~40k tokens peaks at the same floor,
    larger ones rise linearly. The slope comes from the rising points; a line through all of them would
    put the budget far beyond what fits."""
    true, floor = (22e9, 2.1e5), 28.76 * 2**30
    pts = points()
    cal.time_schedule(pts, fake_step(mem=true, floor=floor), budget_s=1e9)
    fixed, bpt, got_floor, per_sample = cal.fit_memory(pts)
    assert (fixed, bpt) == pytest.approx(true, rel=1e-3) and got_floor == pytest.approx(floor, rel=1e-6)
    rows = cal.report(pts, cal.fit_time(pts), (fixed, bpt, got_floor, per_sample))
    assert max(abs(r["mem_err"]) for r in rows if "mem_err" in r) < 1e-3
    cap = 141 * 2**30
    right = cal.budget_tokens(cap, 0.9, fixed, bpt)
    ok = [p for p in pts if p.status == "ok"]
    naive = cal.nnls([(1.0, p.tokens) for p in ok], [p.peak_bytes for p in ok], [1 / p.peak_bytes for p in ok])
    assert cal.budget_tokens(cap, 0.9, *naive) > 1.3 * right


def test_fit_memory_per_sample_term():
    """Each sample's own memory (text context): found from the grid's B = 1..32 points, so a micro-batch of
    700 images is predicted right where a tokens-only line is more than 5% under (as the sp = 2
    probe on two H200s ran out of memory, 2026-11-30), and the probe and budget count it."""
    true, floor = (14e9, 2.1e5, 2e7), 16 * 2**30
    pts = points()
    cal.time_schedule(pts, fake_step(mem=true, floor=floor, noise=0.0), budget_s=1e9)
    mem = cal.fit_memory(pts)
    assert (mem[0], mem[1], mem[3]) == pytest.approx(true, rel=1e-2)
    assert cal.sample_tokens(mem) == pytest.approx(2e7 / 2.1e5, rel=1e-2)
    big = true[0] + true[1] * 700 * 780 + true[2] * 700
    assert cal.predict_peak(mem, 700 * 780, 700) == pytest.approx(big, rel=1e-2)
    ok = [p for p in pts if p.status == "ok" and p.peak_bytes > floor * 1.02]
    line = cal.nnls([(1.0, p.tokens) for p in ok], [p.peak_bytes for p in ok], [1 / p.peak_bytes for p in ok])
    assert line[0] + line[1] * 700 * 780 < 0.95 * big  # more than the 5% the profile may be under


def test_probe_fills_this_runs_memory_and_an_oom_bounds_the_training_budget():
    """Measured on one GPU for a 2-GPU training run: the probe fills what this run can hold (its ZeRO-3
    shards are the full 16 bytes per parameter), at 0.9 of capacity by the fit; if it runs out of memory,
    the training budget is bounded by 0.9 of what it held, plus the shards the training run does not hold."""
    cap, params = 140 * 2**30, 1.4e9
    mem = (30e9, 2.2e5, 31e9, 2e7)                  # fixed, per token, floor, per sample (this run, world 1)
    train_fixed = cal.train_fixed_bytes(mem[0], params, 1, 2)
    small = cal.Point(1, (1, 480, 832), 1560, 1560)
    probe = cal.probe_point(small, cap, 0.9, mem)
    peak = cal.predict_peak(mem, probe.tokens, probe.B)
    assert 0.9 * cap - mem[1] * (1560 + cal.sample_tokens(mem)) < peak <= 0.9 * cap  # one sample short at most
    train = cal.budget_tokens(cap, 0.9, train_fixed, mem[1])
    assert train > probe.B * (1560 + cal.sample_tokens(mem)) + 16 * params / 2 / mem[1] * 0.99
    probe.status = "oom"
    after = cal.budget_after_oom(cap, 0.9, mem, train_fixed, probe)
    shards = (mem[0] - train_fixed) / mem[1]  # tokens' worth of the shards the training run does not hold
    assert after < train and after == pytest.approx(0.9 * (train - shards) + shards, rel=5e-3)


def memory_grid(mem, extra=lambda tokens: 0.0):
    """Measured grid points (1.3B-like sizes, up to 75,600 tokens) whose peaks follow mem = (fixed, per token,
    per sample) plus extra(tokens)."""
    pts = []
    for B, s in ((1, 1560), (32, 1560), (1, 75600), (16, 4680), (2, 32760)):
        p = cal.Point(B, (1, 480, 832), s, s, status="ok", ms=[1000.0], step_ms=[10.0])
        p.peak_bytes = int(mem[0] + mem[1] * p.tokens + mem[2] * B + extra(p.tokens))
        pts.append(p)
    return pts


def test_budget_probes_anchor_the_memory_fit_then_step_down_after_an_oom():
    """The grid ends at 75,600 tokens and the budget is ~480k: an anchor at half the budget runs first and
    its peak joins the memory fit, so a slope that steepens past the grid (as a device's may) moves the
    probe; a probe that runs out of memory is followed, on one rank, by one at 0.9 of what ran out, until
    one runs or time is up. Several ranks (retry=False): no second probe. One step each, no warm-up."""
    cap, mem = 140 * 2**30, (30e9, 2.2e5, 2e7)
    extra = lambda tokens: 0.15 * mem[1] * max(0.0, tokens - 80_000)  # noqa: E731 - steeper past the grid
    small = cal.Point(1, (1, 480, 832), 1560, 1560)
    calls = []

    def step(p):
        calls.append((p.role, p.B))
        peak = mem[0] + mem[1] * p.tokens + mem[2] * p.B + extra(p.tokens)
        if peak > 0.95 * cap:
            raise MemoryError("CUDA out of memory")
        return 20_000.0, 100.0, int(peak)

    t = [0.0]
    pts = memory_grid(mem, extra)
    line_only = cal.probe_point(small, cap, 0.9, cal.fit_memory(pts))
    probes = cal.budget_probes(small, pts, cap, 0.9, step, lambda: t[0], 1e9, lambda p: 20.0, (MemoryError,))
    anchor, rest = probes[0], probes[1:]
    assert anchor.role == "anchor" and anchor.status == "ok" and anchor.B == int(line_only.B * 0.5)
    assert anchor in pts and anchor.peak_bytes and "predicted peak" in anchor.note
    assert rest and rest[0].B < line_only.B  # the anchor's peak steepened the fitted line
    assert rest[-1].status == "ok" and all(p.status == "oom" for p in rest[:-1])
    assert calls == [(p.role, p.B) for p in probes]  # one call each: no warm-up
    assert all(b.B < a.B for a, b in zip(rest, rest[1:]))
    # the last probe ran at most one step of 0.9 below the last OOM (or at the first try)
    ooms = [p for p in rest if p.status == "oom"]
    if ooms:
        mem_now = cal.fit_memory(pts)
        held = ooms[-1].tokens + ooms[-1].B * cal.sample_tokens(mem_now)
        assert rest[-1].tokens + rest[-1].B * cal.sample_tokens(mem_now) <= 0.9 * held * 1.01

    def oom_past(limit):
        def f(p):
            calls.append((p.role, p.B))
            if p.tokens > limit:
                raise MemoryError("CUDA out of memory")
            return 20_000.0, 100.0, int(mem[0] + mem[1] * p.tokens + mem[2] * p.B)
        return f

    calls.clear()
    one = cal.budget_probes(small, memory_grid(mem), cap, 0.9, oom_past(300_000), lambda: t[0], 1e9,
                            lambda p: 20.0, (MemoryError,), retry=False)
    assert [(p.role, p.status) for p in one] == [("anchor", "ok"), ("probe", "oom")] and len(calls) == 2
    late = cal.budget_probes(small, memory_grid(mem), cap, 0.9, step, lambda: t[0], 10.0, lambda p: 20.0,
                             (MemoryError,))
    assert {p.status for p in late} == {"skipped"} and all("time budget" in p.note for p in late)
    huge = memory_grid(mem)
    huge.append(cal.Point(4000, (1, 480, 832), 1560, 1560, status="ok", ms=[1.0], step_ms=[1.0]))
    big = cal.budget_probes(small, huge, cap, 0.9, step, lambda: t[0], 1e9, lambda p: 20.0, (MemoryError,))
    assert [(p.role, p.status) for p in big] == [("probe", "skipped")] and "not needed" in big[0].note
    calls.clear()
    no_anchor = cal.budget_probes(small, memory_grid(mem), cap, 0.9, oom_past(10**9), lambda: t[0], 1e9,
                                  lambda p: 20.0, (MemoryError,), anchor=0)
    assert [(p.role, p.status) for p in no_anchor] == [("probe", "ok")]


def test_oom_points_are_excluded_and_recorded_as_bounds():
    pts = cal.grid_points(cal.GRID_SHAPES, [], GEO, probe_tokens=160_000)
    cal.time_schedule(pts, fake_step(noise=0.0, oom_over=60_000), budget_s=1e9, oom_types=(MemoryError,))
    oom = [p for p in pts if p.status == "oom"]
    assert oom and all(p.tokens > 60_000 and not p.ms for p in oom)
    # once a micro-batch of s tokens per sample ran out, bigger ones of the same s are skipped, not run
    for p in pts:
        if p.status == "skipped":
            assert any(q.s == p.s and q.status == "oom" and q.tokens <= p.tokens for q in oom)
    ok = [p for p in pts if p.status == "ok"]
    assert ok and all(p.tokens <= 60_000 for p in ok)
    coef = cal.fit_time(pts)  # OOM points carry no timings; the fit is still exact on the rest
    assert coef == pytest.approx((*TRUE, 0.0), rel=1e-6)
    rows = cal.report(pts, coef, cal.fit_memory(pts))
    assert {r["status"] for r in rows} >= {"ok", "oom"} and all("err" not in r for r in rows if r["status"] == "oom")
    bound = min(p.tokens for p in oom)
    assert cal.budget_tokens(141 * 2**30, 0.9, 20e9, 2.2e5, oom_tokens=bound) < bound


def test_time_budget_skips_points_and_keeps_a_fit():
    now = [0.0]

    def clock():
        return now[0]

    def step(p):
        ms = model_ms(p)
        now[0] += ms / 1000
        return ms, 10.0, None

    pts = points()
    cal.time_schedule(pts, step, budget_s=60.0, clock=clock, repeats=3)
    assert now[0] <= 60.0 * 1.05
    assert any(p.status == "skipped" for p in pts)
    assert sum(p.status == "ok" and p.B == 1 for p in pts) >= 5  # priority order: B=1 of every shape first
    assert cal.fit_time(pts)[2] == pytest.approx(TRUE[2], rel=1e-6)


def test_probe_is_one_step_without_warm_up():
    """The budget probe (warmup=0, repeats=1) runs exactly one step: it checks memory, and the grid keeps
    only that much time for it (calibrate.probe.PROBE_RESERVE_S)."""
    calls = []

    def step(p):
        calls.append(p.B)
        return 10.0, 1.0, 123

    p = cal.Point(356, (1, 480, 832), 1560, 1560, role="probe")
    cal.measure_point(p, step, time.monotonic, (), repeats=1, big_s=0.0, warmup=0)
    assert calls == [356] and p.status == "ok" and p.peak_bytes == 123 and p.ms == [10.0]
    calls.clear()
    q = cal.Point(2, (1, 480, 832), 1560, 1560)
    cal.measure_point(q, step, time.monotonic, (), repeats=3, big_s=5.0)
    assert len(calls) == 4 and len(q.ms) == 3  # one warm-up, then the repeats


def test_fit_time_needs_three_points():
    pts = points()[:2]
    for p in pts:
        p.status, p.ms = "ok", [model_ms(p)]
    with pytest.raises(ValueError, match="time fit needs 3"):
        cal.fit_time(pts)


def test_calibrate_imports_without_torch():
    """Everything but the measured run is pure: the package, its command module and the measured run's
    modules import without torch or DeepSpeed (engine imports them inside its functions)."""
    code = ("import sys, ds_adaptiveload.calibrate, ds_adaptiveload.calibrate.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]; "
            "sys.exit(f'imported {bad[:3]}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


PROFILES = sorted(f for f in os.listdir(os.path.join(ROOT, "configs", "profiles")) if f.endswith(".yaml"))


@pytest.mark.parametrize("name", PROFILES)
def test_profile_files_round_trip_through_the_one_writer(tmp_path, name):
    """Every stored profile, loaded and written again by CostProfile.to_yaml (the only profile writer),
    loads as the same profile, its comment header included; one that calibrate wrote comes back byte for
    byte (to_yaml writes what calibrate's own writer did)."""
    path = os.path.join(ROOT, "configs", "profiles", name)
    prof = CostProfile.load(path)
    out = tmp_path / name
    prof.to_yaml(out)
    assert CostProfile.load(out) == prof
    text = open(path).read()
    assert bool(prof.header) == text.startswith("#")
    if text.startswith("# Cost profile written by `python -m ds_adaptiveload calibrate`"):
        assert out.read_text() == text


class FakeStepFn:
    """engine.StepFn's interface without DeepSpeed: a ZeRO-3-like floored time, a peak with a floor, a
    per-sample term and a slope that steepens past the grid."""

    def __init__(self, *args):
        self.reserved, self.before_exit = None, None

    FLOOR = 30.8e9  # the optimizer step's peak, above a small micro-batch's fwd+bwd

    def __call__(self, p):
        self.fwd_bwd_peak = int(self.activations(p))
        peak = int(max(self.FLOOR, self.fwd_bwd_peak))
        self.reserved = peak + 2**30
        return max(1500.0, model_ms(p)), 130.0, peak

    @staticmethod
    def activations(p):
        return 23e9 + 2.24e5 * p.tokens * (1 + 0.1 * max(0, p.tokens - 80_000) / 4e5) + 2.07e7 * p.B


def test_calibration_stages_with_a_fake_engine(tmp_path, monkeypatch):
    """measure.Calibration's single-rank device path on CPU, the engine faked at calibrate.engine: the memory
    budget, anchor and probe, a budget no larger than what the probe held plus the shards the training run
    does not hold, the sp conversion, --json."""
    import argparse
    import json
    import types

    import torch

    from ds_adaptiveload.calibrate import cli, engine, measure
    from ds_adaptiveload.model import WanConfig

    cap = 140 * 2**30
    monkeypatch.setattr(engine, "init_engine", lambda cfg, ds, args: (
        None, types.SimpleNamespace(world=1, sp=1, rank=0), None, torch.device("cpu"), torch.bfloat16))
    monkeypatch.setattr(engine, "StepFn", FakeStepFn)
    monkeypatch.setattr(engine, "capacity", lambda device: cap)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    args = ap.parse_args(["--model-config", "configs/wan_1_3b.yaml", "--deepspeed_config", "sp2.json",
                          "--out", str(tmp_path / "p.yaml"), "--json", str(tmp_path / "p.json"),
                          "--packs", "0", "--no-open-blocks"])  # tests/test_calibrate_packed.py, _blocks.py
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml"))
    ds = {"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    prof = measure.measure_profile(cfg, ds, args, cal.GRID_SHAPES, cal.HELDOUT_SHAPES)
    rows = prof.fit["points"]
    assert [r["role"] for r in rows[-2:]] == ["anchor", "probe"] and {r["status"] for r in rows} == {"ok"}
    probe = rows[-1]
    # the training run (2 GPUs) may take what the probe held plus the ZeRO-3 shards it does not hold
    shards = cal.ZERO_BYTES_PER_PARAM * cfg.num_params() / 2 / prof.memory["bytes_per_token"]
    held = probe["B"] * (probe["s"] + prof.sample_tokens)
    assert held < prof.budget_tokens <= held + shards + 1
    assert prof.meta["train_world_size"] == 2 and prof.fit["sp_from_one_gpu"]["k"] == 2
    raw = json.loads((tmp_path / "p.json").read_text())
    assert len(raw["points"]) == len(rows) and raw["fit"]["budget_probe"] == prof.fit["budget_probe"]


def test_multi_rank_memory_limit_skips_points_predicted_to_run_out():
    """With several ranks an OOM cannot be recovered: points the memory fit puts over mem_limit are skipped,
    not run (the step would raise here)."""
    limit = 20e9 + 2.2e5 * 100_000  # the fake step's peak at 100k tokens
    pts = cal.grid_points(cal.GRID_SHAPES, [], GEO, probe_tokens=160_000)
    step = fake_step(noise=0.0, oom_over=100_000)
    cal.time_schedule(pts, step, budget_s=1e9, oom_types=(), mem_limit=limit)  # no oom type: an OOM would raise
    over = [p for p in pts if p.tokens > 100_000]
    assert over and all(p.status == "skipped" and "predicted peak" in p.note for p in over)
    assert all(p.status == "ok" for p in pts if p.tokens <= 100_000)
    # one rank (mem_limit None) finds the bound by running out of memory instead
    pts = cal.grid_points(cal.GRID_SHAPES, [], GEO, probe_tokens=160_000)
    cal.time_schedule(pts, step, budget_s=1e9, oom_types=(MemoryError,))
    assert any(p.status == "oom" for p in pts)


def test_time_budget_with_a_large_fixed_cost_measures_what_fits():
    """ZeRO-3-like: 1.2 s per call whatever the size. A seconds-per-work guess from the smallest point would
    skip every larger point; the budget here covers them all with room to spare."""
    now = [0.0]

    def clock():
        return now[0]

    def step(p):
        ms = 1200.0 + model_ms(p) / 1000
        now[0] += ms / 1000
        return ms, 10.0, None

    pts = points()
    need = sum(1.2 * (1 + 3) for _ in pts) + 2 * 1.2  # every point: warm-up + 3 repeats, 2 warm-ups first
    cal.time_schedule(pts, step, budget_s=need * 1.3, clock=clock, repeats=3)
    assert all(p.status == "ok" for p in pts), [(p.B, p.shape, p.status) for p in pts]
    # and a tight budget still stops in time
    now[0] = 0.0
    pts = points()
    cal.time_schedule(pts, step, budget_s=need / 3, clock=clock, repeats=3)
    assert now[0] <= need / 3 * 1.05 + 1.2 * 4 and any(p.status == "skipped" for p in pts)


def test_sp_terms_convert_one_gpu_terms_to_per_gpu_tokens():
    from ds_adaptiveload.model import WanConfig

    cfg = WanConfig.from_yaml("configs/wan_1_3b.yaml")
    assert cal.sp_terms(0.01, 1e-6, cfg, 1) == (0.01, 1e-6, 0.0)
    pt, pt2, a2a = cal.sp_terms(0.01, 1e-6, cfg, 2, checkpoint_blocks=True, link_gbs=200.0)
    # Ulysses: attention on S^2/k per GPU = k * s^2; q, k, v, out cross the link (k-1)/k, 3 passes with recompute
    assert pt2 == pytest.approx(2e-6) and a2a == pytest.approx(4 * 1536 * 2 * 30 * 3 * 0.5 / 200e6)
    assert pt == pytest.approx(0.01 + a2a)
    assert cal.sp_terms(0.01, 1e-6, cfg, 4, link_gbs=200.0)[2] == pytest.approx(a2a * 1.5)  # (k-1)/k: 3/4 vs 1/2


def fake_calibration(tmp_path, monkeypatch, ds, *flags, step_fn=None):
    """measure.measure_profile of the 1.3B config on CPU, the engine faked at calibrate.engine (one rank, a 140 GiB
    device, step_fn or FakeStepFn for StepFn), --packs 0 and `flags` (after it: a later flag overrides)."""
    import argparse
    import types

    import torch

    from ds_adaptiveload.calibrate import cli, engine, measure
    from ds_adaptiveload.model import WanConfig

    monkeypatch.setattr(engine, "init_engine", lambda cfg, ds, args: (
        None, types.SimpleNamespace(world=1, sp=1, rank=0), None, torch.device("cpu"), torch.bfloat16))
    monkeypatch.setattr(engine, "StepFn", step_fn or FakeStepFn)
    monkeypatch.setattr(engine, "capacity", lambda device: 140 * 2**30)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    args = ap.parse_args(["--model-config", "configs/wan_1_3b.yaml", "--deepspeed_config", "ds.json", "--out",
                          str(tmp_path / "p.yaml"), "--packs", "0", *flags])
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml"))
    return measure.measure_profile(cfg, ds, args, cal.GRID_SHAPES, cal.HELDOUT_SHAPES)


@pytest.mark.parametrize("stage,sharded", [(2, 14), (3, 16)])
def test_fixed_bytes_rescale_only_what_the_zero_stage_shards(tmp_path, monkeypatch, stage, sharded):
    """A one-GPU calibration for a 4-GPU run: ZeRO-3 shards all 16 bytes per parameter, ZeRO-2 the 14 of grads and
    optimizer (its bf16 weights stay whole on every rank), so ZeRO-2's training fixed bytes come out 2 bytes per
    parameter x 3/4 above ZeRO-3's from the same measurement."""
    from ds_adaptiveload.model import WanConfig

    prof = fake_calibration(tmp_path, monkeypatch, {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}},
                            "--no-open-blocks", "--train-world-size", "4")
    note = prof.fit["memory"]
    assert note["zero_bytes_per_param"] == sharded == cal.ZERO_SHARDED_BYTES[stage]
    params = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml")).num_params()
    assert prof.memory["fixed_bytes"] == pytest.approx(note["fixed_bytes_measured"] - sharded * params * 3 / 4, abs=2)


def test_compile_blocks_compiles_the_model_before_the_engine(monkeypatch):
    """--compile-blocks KIND: calibration measures the blocks training runs (compiled regions, say), applied before
    deepspeed.initialize as the trainer applies them; the profile's meta says which. The engine is faked here."""
    import argparse
    import types

    import torch

    from ds_adaptiveload.calibrate import cli, engine
    from ds_adaptiveload.calibrate.result import run_meta
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.model.compile import uncompile_blocks
    from ds_adaptiveload.model.wan import RMSNorm
    from ds_adaptiveload.train import engine as eng

    seen = {}

    def build(model, ds, mpu, compile=False):
        seen["norm_forwards"] = ["forward" in m.__dict__ for m in model.modules() if type(m) is RMSNorm]
        uncompile_blocks(model)
        return types.SimpleNamespace(bfloat16_enabled=lambda: False, fp16_enabled=lambda: False)

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(master_port()))):  # init_engine's single_process_env sets what is unset: restored after
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(eng, "init_distributed", lambda: (types.SimpleNamespace(device_name=lambda: "cpu"), 0, 1))
    monkeypatch.setattr(eng, "pick_device", lambda accel, rank, threads=True: torch.device("cpu"))
    monkeypatch.setattr(eng, "build_engine", build)
    ap = argparse.ArgumentParser()
    cli.add_arguments(ap)
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    for argv, meta in (([], "none"), (["--compile-blocks", "regions"], "regions"), (["--compile-blocks"], "auto")):
        args = ap.parse_args(["--model-config", "configs/wan_tiny.yaml", "--deepspeed_config", "x.json",
                              "--out", "p.yaml", *argv])
        engine.init_engine(cfg, {"zero_optimization": {"stage": 2}}, args)
        compiled = meta != "none"
        assert seen["norm_forwards"] and all(f == compiled for f in seen["norm_forwards"]), argv
        assert run_meta(cfg, {}, args, 1, 1)["compile_blocks"] == meta
