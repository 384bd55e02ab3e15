"""train/build.py: under ZeRO-3 the model is partitioned as it is built (each rank holds ceil(numel / 2)
elements of every parameter, nothing else) and its gathered weights equal an unpartitioned WanModel of the
same seed, i.e. Wan's init_weights survives zero.Init. Two CPU ranks through the deepspeed launcher (~20 s)."""
import json
import os
import subprocess

import pytest

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig
from tests.launcher import DEEPSPEED, launcher_env, master_port, needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@needs_launcher
def test_zero3_build_is_partitioned_at_construction_and_keeps_wan_init(tmp_path):
    env = launcher_env(PYTHONPATH=ROOT)
    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(master_port()), "tests/zero_build_worker.py",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert doc["world"] == 2 and all(doc["leaf_blocks"])
        rows = doc["rows"]
        assert len(rows) > 20
        for name, r in rows.items():
            assert r["local_numel"] == 0, name               # no full copy left on the rank
            assert r["partition_numel"] == r["expected_partition"], name
            assert r["max_abs_diff"] == 0.0, name            # the very weights of the unpartitioned build
        # Wan's init, not torch's defaults: xavier linears, zero bias, N(0, 0.02) text embedding, zero head
        assert rows["head.head.weight"]["std"] == 0.0
        assert abs(rows["text_embedding.0.weight"]["std"] - 0.02) < 2e-3
        assert rows["blocks.0.self_attn.q.bias"]["std"] == 0.0


def test_bad_arguments_are_user_errors():
    from ds_adaptiveload.train.build import build_model

    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    with pytest.raises(UserError, match="model_cfg"):
        build_model({"dim": 8}, {})
    with pytest.raises(UserError, match="ds_cfg"):
        build_model(cfg, "ds.json")
    with pytest.raises(UserError, match="leaf_blocks"):
        build_model(cfg, {"zero_optimization": {"stage": 2}}, leaf_blocks=True)
    m = build_model(cfg, {"zero_optimization": {"stage": 2}}, seed=1)
    assert not any(hasattr(p, "ds_tensor") for p in m.parameters())
