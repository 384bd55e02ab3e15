"""calibrate's packed validation: the pack builder (deterministic, mixed, within budget, each recipe as meant),
predictions through the planner's own costing, the time budget, the verdicts, and the stage end to end
(a faked engine with device memory, and the real loop on CPU with the tiny model)."""
import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from ds_adaptiveload import calibrate as cal
from ds_adaptiveload.calibrate import packs as pk
from ds_adaptiveload.schedule.geometry import Geometry, per_gpu_tokens
from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.schedule.policies.packed import PackedCtx
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan, pack_cost
from ds_adaptiveload.schedule.profile import CostProfile, smooth_max
from tests.launcher import master_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEO = Geometry()
H200 = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")


def h200_packs(seed=0, sp=1, n=6):
    prof = CostProfile.load(H200)
    target = 0.75 * prof.mem_tokens(75600)  # what Calibration.validate_packs takes on the H200 grid
    return prof, target, cal.build_packs(cal.GRID_SHAPES, GEO, n, target, sp=sp, sample_tokens=prof.sample_tokens,
                                         seed=seed)


def mem_of(pack, prof):
    return sum(prof.mem_tokens(s) for s in pack.s)


@pytest.mark.parametrize("sp", [1, 2])
def test_packs_are_deterministic_mixed_and_within_the_target(sp):
    prof, target, packs = h200_packs(sp=sp)
    assert [p.shapes for p in packs] == [p.shapes for p in h200_packs(sp=sp)[2]]  # same seed, same packs
    assert [p.recipe for p in packs] == list(pk.RECIPES)
    assert any([p.shapes for p in h200_packs(seed=s, sp=sp)[2]] != [p.shapes for p in packs] for s in (1, 2, 3))
    grid = set(cal.GRID_SHAPES)
    for p in packs:
        assert len(set(p.shapes)) >= 2 and set(p.shapes) <= grid, p
        assert p.shapes == sorted(p.shapes)  # one shape's samples contiguous, as the planner orders them
        assert p.S == [GEO.tokens(*sh) for sh in p.shapes] and p.s == [per_gpu_tokens(S, sp) for S in p.S]
        assert p.tokens == sum(p.s) and p.B == len(p.shapes)
        # within the target (the budget's headroom), and not far below it: a pack is a real micro-batch
        assert 0.6 * target <= mem_of(p, prof) <= target, (p.recipe, mem_of(p, prof), target)
        assert math.isclose(pack_cost(prof, p.shapes, sp)[1], mem_of(p, prof))


def test_each_recipe_holds_the_samples_it_is_meant_to():
    prof, target, packs = h200_packs()
    by = {p.recipe: p for p in packs}

    def split(p):
        images = [s for sh, s in zip(p.shapes, p.s) if sh[0] == 1]
        clips = sorted(s for sh, s in zip(p.shapes, p.s) if sh[0] > 1)
        return images, clips

    images, clips = split(by["long+short+images"])
    assert clips[-1] > 0.15 * target >= clips[-2] and clips[-1] + prof.sample_tokens <= 0.5 * target
    assert len(clips) in (3, 4) and len(images) > len(clips)  # one long, 2-3 short, many images
    images, clips = split(by["image-heavy"])
    assert len(clips) == 1 and sum(images) >= 0.75 * by["image-heavy"].tokens
    images, clips = split(by["two-clip"])
    assert not images and len(clips) == 2 and len(set(by["two-clip"].shapes)) == 2
    assert clips == [18720, 32760]  # the most even pair of clips that fits (45 + 81 frames at 480p)
    images, clips = split(by["long+images"])
    assert len(clips) == 1 and clips[0] == 32760 and len(images) >= 10  # the longest clip in 70% of the target
    images, clips = split(by["mixed-clips"])
    assert not images and len(set(clips)) >= 2
    assert len(set(by["every-shape"].shapes)) >= 4


def test_one_shape_sets_and_small_targets_give_no_packs():
    assert cal.build_packs([(1, 480, 832)], GEO, 6, 1e6) == []
    assert cal.build_packs(cal.GRID_SHAPES, GEO, 6, 1000) == []  # no sample fits
    assert cal.build_packs(cal.GRID_SHAPES, GEO, 0, 1e5) == []
    only_images = cal.build_packs([(1, 480, 832), (1, 720, 1280)], GEO, 6, 20000)
    assert only_images and all(len(set(p.shapes)) == 2 for p in only_images)
    assert len({tuple(p.shapes) for p in only_images}) == len(only_images)  # no pack twice


def test_prediction_is_the_planners_packed_costing():
    """A hand-built pack is predicted as the packed planner costs the same micro-batch: PackedCtx.mb_ms and the
    plan's own per-rank prediction; attention is per sample (far below one sequence of all the tokens); memory
    is schedule.memory's peak at the fixed bytes given, above the floor."""
    prof = CostProfile.load(H200)
    shapes = [(1, 480, 832)] * 3 + [(81, 480, 832)]
    full = [GEO.tokens(*sh) for sh in shapes]
    pack = pk.Pack(shapes, full, full, "hand")
    row = cal.pack_rows([pack], prof)[0]
    ctx = PackedCtx(prof, PlanConfig("packed"), full, full, shapes, {})
    assert row["pred_ms"] == round(ctx.mb_ms([0, 1, 2, 3]), 3) == round(prof.packed_ms([1560] * 3 + [32760]), 3)
    plan = make_plan([Sample(f"s{i}", *sh) for i, sh in enumerate(shapes)], prof, PlanConfig("packed"))
    assert [sorted(mb) for mb in plan.steps[0][0]] == [[0, 1, 2, 3]]  # one slot: the planner packs them together
    assert plan.pred_ms[0][0] == pytest.approx(prof.step_fixed_ms + row["pred_ms"], abs=1e-3)
    assert row["pred_ms"] < 0.9 * prof.micro_ms(1, sum(full))  # (sum S_i)^2 would be ~480 ms more
    # sp = 2: the planner's per-GPU tokens
    half = [per_gpu_tokens(S, 2) for S in full]
    assert pack_cost(prof, shapes, 2)[0] == prof.packed_ms(half)
    mem = {"fixed_bytes": 23e9, "bytes_per_token": 224e3, "bytes_per_sample": 20.7e6}
    row = cal.pack_rows([pack], prof, memory=mem, floor_bytes=30e9, num_layers=30)[0]
    assert row["pred_bytes"] == int(23e9 + 224e3 * sum(full) + 20.7e6 * 4)
    assert cal.pack_rows([pack], prof, memory=mem, floor_bytes=40e9, num_layers=30)[0]["pred_bytes"] == int(40e9)
    pack.status, pack.ms, pack.step_ms, pack.peak_bytes = "ok", [1000.0, 1100.0, 900.0], [100.0], int(32e9)
    row = cal.pack_rows([pack], prof, memory=mem, floor_bytes=30e9, num_layers=30)[0]
    assert row["ms"] == 1000.0 and row["err"] == round(row["pred_ms"] / 1000 - 1, 4)
    assert row["mem_err"] == round(row["pred_bytes"] / 32e9 - 1, 4) and row["shapes"] == "1x480x832*3 + 81x480x832"


def test_measure_packs_within_the_time_budget_and_oom():
    """One warm-up then the timed steps; a pack whose predicted seconds do not fit before the deadline is
    skipped with a note; an out-of-memory pack is recorded; mem_ok false skips."""
    _, _, packs = h200_packs()
    now = [0.0]
    calls = []

    def step(p):
        calls.append(p.recipe)
        if p.recipe == "two-clip":
            raise MemoryError("CUDA out of memory (fake)")
        now[0] += 4.0
        return 3000.0, 100.0, int(4e10)

    cal.measure_packs(packs, step, lambda: now[0], deadline=22.0, pred_s=lambda p: 9.0, oom_types=(MemoryError,),
                      repeats=3, mem_ok=lambda p: p.recipe != "image-heavy")
    st = [(p.recipe, p.status) for p in packs]
    assert st[:4] == [("long+short+images", "ok"), ("image-heavy", "skipped"), ("two-clip", "oom"),
                      ("long+images", "ok")]
    assert all(s == "skipped" for _, s in st[4:]) and "time budget" in packs[-1].note
    assert "memory limit" in packs[1].note
    assert len(packs[0].ms) == 1 and packs[0].peak_bytes == int(4e10)  # 3 s steps over PACK_BIG_S: one timed
    assert calls.count("long+short+images") == 2
    # pack_seconds: a warm-up and the timed steps, each with its optimizer step, x 1.2
    assert pk.pack_seconds(3000, 100, 3) == pytest.approx(1.2 * 2 * 3.1)
    assert pk.pack_seconds(1000, 100, 3) == pytest.approx(1.2 * 4 * 1.1)


def test_verdicts_against_ten_and_five_percent():
    rows = [{"status": "ok", "err": e, "mem_err": m} for e, m in ((0.05, 0.01), (-0.12, -0.02), (0.08, 0.06))]
    s = cal.packed_summary(rows, seed=0)
    assert s["time"] == {"n": 3, "median_abs_rel_err": 0.08, "worst_abs_rel_err": 0.12, "threshold": 0.1,
                         "pass": True}
    assert s["memory"]["median_abs_rel_err"] == 0.02 and s["memory"]["pass"] is True and s["pass"] is True
    rows[0]["err"] = rows[2]["err"] = 0.11
    assert cal.packed_summary(rows)["time"]["pass"] is False and cal.packed_summary(rows)["pass"] is False
    for r in rows:
        del r["mem_err"]
    s = cal.packed_summary(rows + [{"status": "skipped"}])
    assert s["memory"] == {"n": 0, "threshold": 0.05, "pass": None} and s["pass"] is False
    assert s["n_built"] == 4 and s["n_measured"] == 3


class PackedFakeStep:
    """engine.StepFn's interface without DeepSpeed: the packed time model (per-sample attention, a floor) and
    memory (floor, per token, per sample). quadratic='concat' costs a pack's attention as one sequence of all
    its tokens, as a packed forward that attended across samples would."""
    TIME = (60.0, 0.038, 1.5e-6, 1500.0)
    MEM = (23e9, 2.24e5, 2.07e7, 30.9e9)
    quadratic = "per-sample"

    def __init__(self, *args):
        self.reserved, self.before_exit = None, None

    def __call__(self, p):
        s = p.s if isinstance(p.s, list) else [p.s] * p.B
        fixed, a, b, floor = self.TIME
        packed = isinstance(p.s, list)  # a Pack (grid points are one-shape: per-sample attention either way)
        sq = sum(s) ** 2 if self.quadratic == "concat" and packed else sum(v * v for v in s)
        peak = int(max(self.MEM[3], self.MEM[0] + self.MEM[1] * sum(s) + self.MEM[2] * len(s)))
        return smooth_max(floor, fixed + a * sum(s) + b * sq, 8), 130.0, peak


def fake_calibration(tmp_path, monkeypatch, quadratic, *flags, sp=1):
    """tests/test_calibrate.fake_calibration with PackedFakeStep (`quadratic`), ZeRO-3 at `sp`, the packed stage at
    its default size and without the open-block stage (tests/test_calibrate_blocks.py), and --json."""
    from tests.test_calibrate import fake_calibration as faked_engine_calibration

    monkeypatch.setattr(PackedFakeStep, "quadratic", quadratic)
    ds = {"sequence_parallel_size": sp, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    return faked_engine_calibration(tmp_path, monkeypatch, ds, "--json", str(tmp_path / "p.json"), "--no-open-blocks",
                                    "--packs", str(cal.PACKS), *flags, step_fn=PackedFakeStep)


@pytest.mark.parametrize("sp", [1, 2])
def test_packed_stage_on_a_faked_device(tmp_path, monkeypatch, capsys, sp):
    """measure.Calibration with device memory (faked): the packs run after the probes, within the headroom of
    this run's budget, are predicted within a hair of a step that follows the model (time and memory pass),
    and --json holds fit.packed and the raw packs. The profile is for a 2-GPU run (fewer ZeRO-3 shards, and
    with sp = 2 measured on one GPU, per-GPU terms): this run's packs are predicted at this run's fixed bytes
    and measured terms, else memory (~11 GB of shards) and time (per_token_sq x 2) would miss."""
    prof = fake_calibration(tmp_path, monkeypatch, "per-sample", "--train-world-size", "2", sp=sp)
    assert prof.memory["fixed_bytes"] < prof.fit["memory"]["fixed_bytes_measured"] - 10e9
    assert (prof.fit.get("sp_from_one_gpu") is not None) == (sp == 2)
    sec = prof.fit["packed"]
    assert sec["n_built"] == 6 and sec["n_measured"] == 6, sec
    assert sec["time"]["pass"] is True and sec["time"]["median_abs_rel_err"] < 0.02
    assert sec["memory"]["pass"] is True and sec["memory"]["median_abs_rel_err"] < 0.005 and sec["pass"] is True
    assert sec["target_mem_tokens"] <= pk.PACK_HEADROOM * sec["budget_tokens_here"]
    assert all(r["mem_tokens"] <= sec["target_mem_tokens"] + 1e-6 for r in sec["packs"])
    assert {r["recipe"] for r in sec["packs"]} == set(pk.RECIPES)
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["fit"]["packed"]["time"] == sec["time"] and len(raw["packs"]) == 6
    assert raw["packs"][0]["role"] == "packed" and raw["packs"][0]["status"] == "ok"
    out = capsys.readouterr().out
    assert "packed time: median |err|" in out and "PASS (<= 10%)" in out and "PASS (<= 5%)" in out
    assert ("measured terms" in sec["predicted_by"]) == (sp == 2)


def test_packed_stage_catches_attention_across_samples_and_can_be_skipped(tmp_path, monkeypatch, capsys):
    """Packs that cost (sum S_i)^2 (attention over the concatenation) are not what the planner predicts: the
    time verdict fails. --packs 0 runs none and keeps no time for them."""
    sec = fake_calibration(tmp_path, monkeypatch, "concat").fit["packed"]
    assert sec["time"]["pass"] is False and sec["time"]["median_abs_rel_err"] > 0.2 and sec["pass"] is False
    assert "FAIL (<= 10%)" in capsys.readouterr().out
    prof = fake_calibration(tmp_path, monkeypatch, "per-sample", "--packs", "0")
    assert prof.fit["packed"] == {"note": "not run (--packs 0)"}
    assert json.loads((tmp_path / "p.json").read_text())["packs"] == []


def test_cpu_calibration_with_packs_tiny_model(tmp_path):
    """The real loop on CPU (ZeRO-3 on one gloo process, the tiny model): the packs run through the packed
    forward of micro_step and fit.packed lands in the YAML and the --json, predicted by the profile written."""
    out, raw = tmp_path / "tiny.yaml", tmp_path / "tiny.json"
    env = dict(os.environ, MASTER_PORT=str(master_port()), OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, "-m", "ds_adaptiveload", "calibrate", "--model-config", "configs/wan_tiny.yaml",
         "--deepspeed_config", "configs/ds_tiny_cpu.json", "--out", str(out), "--json", str(raw),
         # tokens enough to outgrow the CPU's ~100 ms step overhead (see test_cpu_measuring_loop_with_tiny_model)
         "--shapes", "1x256x256,5x256x256,9x256x256,17x256x384", "--heldout", "13x256x256", "--batches", "1,2,4",
         "--probe-tokens", "3072", "--repeats", "1", "--time-budget", "240", "--packs", "4", "--seed", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    prof = CostProfile.load(out)
    sec = yaml.safe_load(out.read_text())["fit"]["packed"]
    assert json.loads(raw.read_text())["fit"]["packed"] == sec
    assert sec["seed"] == 3 and 2 <= sec["n_built"] <= 4 and sec["n_measured"] == sec["n_built"]
    assert sec["time"]["n"] == sec["n_built"] and sec["time"]["pass"] in (True, False)
    assert sec["memory"] == {"n": 0, "threshold": 0.05, "pass": None}  # CPU: no peak memory
    for r in sec["packs"]:
        shapes = [tuple(int(v) for v in part.split("*")[0].split("x")) for part in r["shapes"].split(" + ")]
        counts = [int(part.split("*")[1]) if "*" in part else 1 for part in r["shapes"].split(" + ")]
        assert len(shapes) >= 2 and sum(counts) == r["n"] and r["ms"] > 0 and r["mem_tokens"] <= 0.75 * 3072
        assert r["pred_ms"] == round(pack_cost(prof, [sh for sh, c in zip(shapes, counts) for _ in range(c)])[0], 3)
    assert "packed time: median |err|" in proc.stdout
