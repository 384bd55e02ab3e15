"""The shipped cost profiles and the budget that follows the GPU: profile.for_device, profile "auto", `plan
--device-memory-gib` and the shipped-name look-up (no GPU: capacities are passed in)."""
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ds_adaptiveload import shipped
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.schedule.memory import blocks_to_checkpoint
from ds_adaptiveload.schedule.profile import CostProfile, closest_profile, for_device
from ds_adaptiveload.train.config import AdaptiveLoadConfig
from ds_adaptiveload.train.setup import profile_for_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.path.join(ROOT, "configs", "profiles")
H100 = ("NVIDIA H100 80GB HBM3", 85017493504)  # torch's name and total_memory on the H100 of the H100 profile
H200 = ("NVIDIA H200", 150109880320)
WAN_1_3B = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml"))
WAN_TINY = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))


def load(name):
    return CostProfile.load(os.path.join(PROFILES, f"{name}.yaml"))


def test_an_h200_profile_moved_to_the_h100s_capacity_predicts_the_h100s_calibrated_budget():
    """The budget is linear in the capacity: the H200 ZeRO-2 profile moved to an 80 GB H100 lands within 2% of the
    budget that calibrate measured on that H100 (313,403 tokens), where the H200's own is twice that."""
    h200, h100 = load("h200-wan1.3b-zero2"), load("h100-wan1.3b-zero2")
    moved, (line,) = for_device(h200, H100[1], H100[0], "h200.yaml")
    assert h200.budget_tokens > 2 * h100.budget_tokens  # the OOM of issue 54: the H200's budget on an H100
    assert moved.budget_tokens == pytest.approx(h100.budget_tokens, rel=0.02)
    assert moved.memory["capacity_bytes"] == H100[1] and moved.memory["budget_tokens"] == moved.budget_tokens
    assert moved.meta["device"] == H100[0] and moved.meta["rescaled_from"]["capacity_bytes"] == H200[1]
    assert (moved.per_token_ms, moved.floor_ms) == (h200.per_token_ms, h200.floor_ms)  # the time model is kept
    assert "649,333 -> " in line and "NVIDIA H200" in line and "absolute predicted times" in line
    # the checkpoint plan follows: a micro-batch of 100,000 tokens keeps fewer blocks open on the smaller GPU, about
    # as many as the H100's own profile says
    k_h200, k_h100 = (blocks_to_checkpoint(100_000, 2, p.memory, 30) for p in (h200, moved))
    assert k_h200 < k_h100 < 30
    assert abs(k_h100 - blocks_to_checkpoint(100_000, 2, h100.memory, 30)) <= 2


def test_for_device_leaves_a_matching_or_unknown_gpu_alone():
    h100 = load("h100-wan1.3b-zero2")
    assert for_device(h100, H100[1], H100[0]) == (h100, [])
    assert for_device(h100, H100[1] + 2**20, H100[0]) == (h100, [])  # a few MiB apart: the same GPU
    assert for_device(h100, None, None) == (h100, [])  # a CPU run
    same, (warn,) = for_device(h100, H100[1], "NVIDIA H100 PCIe")  # same memory, another GPU: times only
    assert same is h100 and "measured on NVIDIA H100 80GB HBM3" in warn
    tiny = load("tiny-cpu")  # no capacity_bytes: nothing to move with, its times are the CPU's
    kept, (warn,) = for_device(tiny, H100[1], H100[0])
    assert kept is tiny and "its times were measured on cpu" in warn
    grown, _ = for_device(h100, 2 * H100[1], "big GPU")
    assert grown.budget_tokens > h100.budget_tokens and for_device(grown, H100[1], H100[0])[0].budget_tokens == \
        pytest.approx(h100.budget_tokens, abs=1)


def test_for_device_refuses_a_gpu_with_no_memory_left_for_tokens():
    with pytest.raises(UserError, match=r"p.yaml: small GPU has 16.0 GiB, which .* leaves no memory for tokens"):
        for_device(load("h100-wan1.3b-zero2"), 16 * 2**30, "small GPU", "p.yaml")
    with pytest.raises(UserError, match="capacity must be a number > 0"):
        for_device(load("h100-wan1.3b-zero2"), 0, "x")


def test_the_trainer_and_loader_move_the_profile_to_their_gpu():
    """train/setup.profile_for_run, which the trainer and get_dataloader_and_lr_scheduler call with gpu_of(device)."""
    dims = SimpleNamespace(world=1, sp=1)
    h200 = load("h200-wan1.3b-zero2")
    moved, lines = profile_for_run(h200, 2, dims, "p.yaml", H100)
    assert moved.budget_tokens == for_device(h200, H100[1], H100[0])[0].budget_tokens and len(lines) == 1
    two, lines = profile_for_run(h200, 2, SimpleNamespace(world=2, sp=1), "p.yaml", H100)  # ZeRO move, then GPU
    assert len(lines) == 2 and two.budget_tokens > moved.budget_tokens
    assert two.meta["rescaled_from"]["train_world_size"] == 1 and two.meta["rescaled_from"]["device"] == H200[0]
    assert profile_for_run(h200, 2, dims, "p.yaml", None) == (h200, [])


def test_shipped_profiles_are_one_calibrated_profile_per_gpu_model_stage_and_sp():
    names = shipped.profile_names()
    assert {"h100-wan1.3b-zero2", "h200-wan1.3b-zero2", "h200-wan1.3b-zero3", "tiny-cpu"} <= set(names)
    seen = {}
    for name in names:
        prof = load(name)
        meta, model = prof.meta, prof.meta.get("model")
        key = (meta.get("device"), tuple(model.get(k) for k in ("dim", "num_layers")), meta.get("zero_stage"),
               meta.get("sp", 1))
        assert key not in seen, f"{name} and {seen.get(key)} were measured for the same run"
        seen[key] = name
        if name != "tiny-cpu":  # the CPU profile is rough by design; every GPU one was written by calibrate
            assert meta["estimated"] is False and prof.header.startswith("Cost profile written by `python -m "
                                                                          "ds_adaptiveload calibrate`"), name
            assert prof.memory["capacity_bytes"] and prof.memory["bytes_per_token"], name


@pytest.mark.parametrize("model, gpu, stage, sp, want, exact", [
    (WAN_1_3B, H100, 2, 1, "h100-wan1.3b-zero2", True),
    (WAN_1_3B, H200, 2, 1, "h200-wan1.3b-zero2", True),
    (WAN_1_3B, H200, 3, 1, "h200-wan1.3b-zero3", True),
    (WAN_1_3B, H200, 3, 2, "h200-wan1.3b-zero3-sp2", True),
    (WAN_1_3B, ("NVIDIA A100-SXM4-80GB", 85 * 10**9), 2, 1, "h100-wan1.3b-zero2", False),  # nearest capacity
    # the stage before the GPU; among ZeRO-3 profiles the nearest capacity (an H100 one, once it ships)
    (WAN_1_3B, ("NVIDIA A100-SXM4-40GB", 42 * 10**9), 3, 1, ("h100-wan1.3b-zero3", "h200-wan1.3b-zero3"), False),
    (WAN_TINY, None, 3, 1, "tiny-cpu", True),
    (WAN_TINY, None, 2, 1, "tiny-cpu", False),
])
def test_auto_picks_the_profile_of_this_model_gpu_stage_and_sp(model, gpu, stage, sp, want, exact):
    names = shipped.profile_names()
    want = next(w for w in ((want,) if isinstance(want, str) else want) if w in names)  # the first that ships
    profiles = {n: load(n) for n in names}
    dims = {k: getattr(model, k) for k in ("dim", "ffn_dim", "num_heads", "num_layers")}
    device, capacity = gpu or ("cpu", None)
    assert closest_profile(profiles, dims, device, capacity, stage, sp) == (want, exact)
    path, (line,) = AdaptiveLoadConfig(profile="auto").profile_path("ds.json", model, stage, sp, gpu)
    assert path == os.path.join(str(shipped.root()), "profiles", f"{want}.yaml")
    assert ("measured for this run" in line) == exact and ("using the closest" in line) != exact


def test_auto_names_what_it_cannot_match():
    big = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_14b.yaml"))
    with pytest.raises(UserError, match=r"no shipped profile was measured for this model \(dim 5120.*calibrate"):
        AdaptiveLoadConfig(profile="auto").profile_path("ds.json", big, 3, 1, H100)
    with pytest.raises(UserError, match="not a WanModel"):
        AdaptiveLoadConfig(profile="auto").profile_path("ds.json", None, 3, 1, H100)
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.profile \"auto\" is chosen by the trainer.*"
                                        r"shipped: h100-wan1.3b-zero2"):
        AdaptiveLoadConfig(profile="auto").resolve_profile("ds.json")


def test_profiles_and_configs_resolve_from_the_working_folder_then_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    want = os.path.join(str(shipped.root()), "profiles", "h100-wan1.3b-zero2.yaml")
    for name in ("h100-wan1.3b-zero2", "h100-wan1.3b-zero2.yaml", "configs/profiles/h100-wan1.3b-zero2.yaml"):
        assert AdaptiveLoadConfig(profile=name).resolve_profile(None) == want
    assert shipped.find("configs/ds_zero2_bf16.json") == os.path.join(str(shipped.root()), "ds_zero2_bf16.json")
    (tmp_path / "h100-wan1.3b-zero2.yaml").write_text("x")  # the working folder's file first
    assert AdaptiveLoadConfig(profile="h100-wan1.3b-zero2.yaml").resolve_profile(None) == "h100-wan1.3b-zero2.yaml"
    with pytest.raises(UserError, match=r"ds.json: adaptive_load.profile 'nope' not found in the working directory"
                                        r", next to ds.json or among the shipped configs"):
        AdaptiveLoadConfig(profile="nope").resolve_profile("ds.json")


def plan(*args):
    return subprocess.run([sys.executable, "-m", "ds_adaptiveload", "plan", "--mix", "video-heavy:300",
                           "--world-size", "1", "--json", *args], capture_output=True, text=True, timeout=300)


def test_plan_device_memory_gib_plans_with_the_budget_of_that_gpu(tmp_path):
    """`plan --device-memory-gib` moves the budget as the trainer does, says so, and --json reports the budget and
    capacity it planned with. Run from an empty folder: the profile is named by its shipped name."""
    own = plan("--profile", "h200-wan1.3b-zero2", "--policy", "packed")
    assert own.returncode == 0, own.stderr
    there = subprocess.run([sys.executable, "-m", "ds_adaptiveload", "plan", "--mix", "video-heavy:300",
                            "--world-size", "1", "--json", "--profile", "h200-wan1.3b-zero2", "--policy", "packed",
                            "--device-memory-gib", str(H100[1] / 2**30)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert there.returncode == 0, there.stderr
    a, b = (json.loads(p.stdout.splitlines()[-1]) for p in (own, there))
    want = for_device(load("h200-wan1.3b-zero2"), H100[1])[0].budget_tokens
    assert (a["budget_tokens"], a["capacity_bytes"]) == (649333, H200[1])
    assert (b["budget_tokens"], b["capacity_bytes"]) == (want, H100[1])
    assert b["steps"] > a["steps"]  # smaller micro-batches: more of them
    assert "memory moved from NVIDIA H200 (139.8 GiB) to this GPU (79.2 GiB): budget 649,333 -> " in there.stdout  # an info line
    bad = plan("--profile", "h200-wan1.3b-zero2", "--device-memory-gib", "-1")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --device-memory-gib must be a positive number of " \
                                                         "GiB, got -1.0"
    none = plan("--profile", "tiny-cpu", "--device-memory-gib", "80", "--mix", "tiny:50")
    assert none.returncode == 0 and "--device-memory-gib leaves it as written" in none.stdout
    assert json.loads(none.stdout.splitlines()[-1])["capacity_bytes"] is None


def test_a_profile_without_meta_model_is_never_picked():
    tiny = load("tiny-cpu")
    bare = dataclasses.replace(tiny, meta={"device": "cpu", "zero_stage": 3})
    dims = {k: getattr(WAN_TINY, k) for k in ("dim", "ffn_dim", "num_heads", "num_layers")}
    assert closest_profile({"bare": bare}, dims, "cpu", None, 3, 1) == (None, False)
    assert closest_profile({"bare": bare, "tiny": tiny}, dims, "cpu", None, 3, 1) == ("tiny", True)
