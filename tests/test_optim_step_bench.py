"""bench/model/optim_step.py on CPU: the variants' optimizer settings, the agreement of their master-weight
changes, and a short smoke run of two variants through the tiny model's engine."""
import json
import os
import subprocess
import sys

import pytest

from tests.launcher import needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "model"))
import optim_step  # noqa: E402


def test_variants_set_only_their_keys():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}}, "bf16": {}}
    foreach = optim_step.with_variant(ds, "foreach")["optimizer"]["params"]
    assert foreach == {"lr": 1e-4, "torch_adam": True}
    assert optim_step.with_variant(ds, "torch-fused")["optimizer"]["params"]["fused"] is True
    assert optim_step.with_variant(ds, "ds-fused")["optimizer"]["params"] == {"lr": 1e-4, "torch_adam": False}
    assert ds["optimizer"]["params"]["fused"] is True  # the caller's config is left alone


def test_agreement_is_relative_to_the_first_variant():
    results = [{"fingerprint": {"delta_norm": 2.0, "projections": [1.0, -1.0, 0.5, 0.0]}},
               {"fingerprint": {"delta_norm": 2.2, "projections": [1.0, -0.6, 0.5, 0.0]}},
               {"rc": 1}]
    optim_step.agreement(results)
    assert results[0]["vs_first"] == {"delta_norm_rel": 0.0, "projection_rel_max": 0.0}
    assert results[1]["vs_first"]["delta_norm_rel"] == pytest.approx(0.1)
    assert results[1]["vs_first"]["projection_rel_max"] == pytest.approx(0.2)
    assert "vs_first" not in results[2]


@needs_launcher
def test_smoke_foreach_and_fused_agree(tmp_path):
    env = {**os.environ, "OPTIM_SMOKE": "1"}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "model", "optim_step.py"), "--out", str(tmp_path),
                        "--warmup", "1", "--steps", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(tmp_path / "optim-step-ds_tiny_cpu.json") as f:
        results = json.load(f)["results"]
    assert [r["variant"] for r in results] == ["foreach", "torch-fused"]
    assert [r["flags"].get("fused") for r in results] == [None, True]
    for r in results:
        assert len(r["step_ms"]) == 2 and r["fingerprint"]["delta_norm"] > 0
        assert r["vs_first"]["projection_rel_max"] < 1e-4, r["vs_first"]


def test_ds_fused_gets_the_arch_list_without_suffixes(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0a+PTX")
    assert optim_step.child_env("ds-fused") == {"TORCH_CUDA_ARCH_LIST": "8.0;9.0 10.0+PTX"}
    assert optim_step.child_env("torch-fused") is None
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert optim_step.child_env("ds-fused") is None


def test_unknown_variant_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        optim_step.main(["--out", str(tmp_path), "--variants", "foreach,adafactor"])
    assert "--variants: unknown ['adafactor']" in capsys.readouterr().err
