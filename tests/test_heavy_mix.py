"""packed's heavy_mix (PlanConfig, adaptive_load.heavy_mix, plan --heavy-mix): heavy rounds that leave slots to
light samples, for steps closer to the data's composition at some balance."""
import dataclasses
import json
import random

import pytest

from ds_adaptiveload.cli import main
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule import planner
from ds_adaptiveload.schedule.bound import check_plan
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.policies import packed, packed_stream
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.train.config import AdaptiveLoadConfig

CALIBRATED = "configs/profiles/h200-wan1.3b-zero3.yaml"
ONE_CLIP = 75693  # memory for one 81x720x1280 clip: its samples are heavy and come in runs


@pytest.fixture(scope="module")
def case():
    profile = dataclasses.replace(CostProfile.load(CALIBRATED), budget_tokens=ONE_CLIP)
    return make_mix("video-heavy", 3000, seed=5), profile


def plan(case, ranks=16, **kw):
    samples, profile = case
    return make_plan(samples, profile, PlanConfig("packed", ranks, lockstep=True, **kw))


def test_zero_is_the_default_plan(case):
    """heavy_mix 0 is today's plan (tests/test_plan_digests.py holds the grid; here the explicit 0 and 0.0)."""
    assert plan(case).steps == plan(case, heavy_mix=0).steps == plan(case, heavy_mix=0.0).steps


@pytest.mark.parametrize("ranks", [8, 16])
def test_heavy_mix_lowers_mix_tv_and_plans_check(case, ranks):
    """heavy_mix 0.1: every sample once, G micro-batches per rank, within memory (check_plan); the same plan twice;
    steps closer to the data's mix than at 0, at no less idle (the price)."""
    base, mixed = plan(case, ranks), plan(case, ranks, heavy_mix=0.1)
    check_plan(mixed, case[1])
    assert mixed.steps == plan(case, ranks, heavy_mix=0.1).steps
    assert mixed.steps != base.steps
    b, m = base.summary(), mixed.summary()
    assert m["samples_planned"] == b["samples_planned"] == len(case[0])
    assert m["mix_tv"] < b["mix_tv"]
    assert m["idle_fraction"] >= b["idle_fraction"]


def test_heavy_runs_are_shorter_and_light_runs_are_not(case):
    """epoch_stream with heavy_run: heavy runs of that length (only the last one shorter), light runs (replicate)
    still of `run`."""
    samples, profile = case
    cfg = PlanConfig("packed", 16, lockstep=True, replicate=True)
    tokens = [Geometry().tokens(s.frames, s.height, s.width) for s in samples]
    ctx = packed.PackedCtx(profile, cfg, tokens, list(tokens), [(s.frames, s.height, s.width) for s in samples], {})
    keep = list(range(len(samples)))
    _, heavy = packed._target(keep, ctx, packed.PACK_FILL)
    order, runs, cont = packed_stream.epoch_stream(keep, ctx, random.Random(0), heavy, 16, True, heavy_run=14)
    assert sum(runs.values()) == sum(heavy[i] for i in keep) > 14
    assert max(runs.values()) == 14 and sum(n < 14 for n in runs.values()) == 1
    light_runs = [0]
    for p, i in enumerate(order):
        if not heavy[i]:
            light_runs[-1:] = [light_runs[-1] + 1] if cont[p] else [light_runs[-1], 1]
    light_runs = light_runs[1:]
    assert max(light_runs) == 16 and sum(n < 16 for n in light_runs) == 1


@pytest.mark.parametrize("value", [-0.1, 1.0, "0.1", True])
def test_bad_values_name_the_key(value):
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.heavy_mix must be a number in \[0, 1\)"):
        AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "heavy_mix": value}, "ds.json")
    with pytest.raises(UserError, match=r"heavy-mix must be a number in \[0, 1\)"):
        PlanConfig("packed", 8, heavy_mix=value)


def test_other_policies_refuse_it():
    with pytest.raises(UserError, match=r"adaptive_load.heavy_mix.*applies to the packed policy only"):
        AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "policy": "balanced", "heavy_mix": 0.1}, "ds.json")
    with pytest.raises(UserError, match="heavy-mix applies to the packed policy only"):
        PlanConfig("balanced", 8, heavy_mix=0.1)
    assert AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "policy": "balanced"}, "ds.json").heavy_mix == 0


def test_key_reaches_the_plan_config_and_layout_only_when_set():
    """heavy_mix reaches PlanConfig; at 0 it is not in the checkpoint layout (older checkpoints resume), set it is."""
    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "heavy_mix": 0.05}, "ds.json")
    assert al.plan_config(8).heavy_mix == 0.05 and al.layout_keys()["heavy_mix"] == 0.05
    assert "heavy_mix" not in al.model_copy(update={"heavy_mix": 0.0}).layout_keys()


@pytest.fixture
def manifest(tmp_path):
    from ds_adaptiveload.schedule.manifest import write_manifest

    path = tmp_path / "m.jsonl"
    write_manifest(path, make_mix("video-heavy", 600, seed=3))
    return str(path)


def test_plan_flag(manifest, capsys):
    """plan --heavy-mix reaches the packed plan (lower mix_tv); a bad value exits 2 naming the flag."""
    def run(*extra):
        rc = main(["plan", "--manifest", manifest, "--profile", "tests/data/h200-wan1.3b-blocks.yaml", "--world-size", "8", "--lockstep",
                   "--json", *extra])
        return rc, capsys.readouterr()
    rc, out = run()
    base = json.loads(out.out.strip().splitlines()[-1])
    rc_m, out_m = run("--heavy-mix", "0.2")
    assert rc == rc_m == 0
    assert json.loads(out_m.out.strip().splitlines()[-1])["mix_tv"] < base["mix_tv"]
    for bad in ("-0.1", "1.0", "lots"):
        rc, out = run("--heavy-mix", bad)
        assert rc == 2 and "--heavy-mix" in out.err, (bad, out.err)
    assert planner.PlanConfig.__dataclass_fields__["heavy_mix"].default == 0.0
