"""--init-from (model/init_from.py) and `export` (model/export.py, export_cli.py): pretrained folders in both layouts
checked against the model config and loaded, each ZeRO-3 rank reading only its partitions (2 CPU ranks), and a
tiny model trained 2 steps on 2 CPU ranks under ZeRO-2 and ZeRO-3 exported, loaded by diffusers, matched against our
model and loaded back with --init-from."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel, init_from
from ds_adaptiveload.model.export import write
from tests.launcher import DEEPSPEED, launcher_env, master_port, needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "wan_tiny.yaml")


def tiny():
    return WanConfig.from_yaml(TINY)


def random_weights(cfg, seed=0):
    """A state dict with every parameter random (Wan's init zeroes the head and biases: equal by accident)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WanModel(cfg).state_dict().items()}
    return {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}


def load_into_fresh(path, cfg=None):
    cfg = cfg or tiny()
    model = WanModel(cfg)
    src = init_from.prepare(str(path), model, cfg, "--model-config wan_tiny.yaml")
    init_from.load(src, model)
    return model


# ---------------------------------------------------------------------------------------------------- --init-from


@pytest.mark.parametrize("fmt", ["wan", "diffusers"])
def test_init_from_loads_both_layouts_sharded_or_not(tmp_path, fmt):
    cfg, sd = tiny(), random_weights(tiny(), 1)
    for shard in ("5GB", "200KB"):
        out = tmp_path / f"{fmt}-{shard}"
        files = write(sd, cfg, fmt, str(out), "fp32", shard)
        assert (len(files) > 1) == (shard == "200KB")
        assert (out / "diffusion_pytorch_model.safetensors.index.json").exists() == (len(files) > 1)
        got = load_into_fresh(out).state_dict()
        assert set(got) == set(sd)
        for k, v in sd.items():
            assert torch.equal(got[k], v), k


def test_init_from_reads_a_diffusers_save_pretrained_folder(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from ds_adaptiveload.model.convert import diffusers_config, to_diffusers

    cfg, sd = tiny(), random_weights(tiny(), 2)
    ref = diffusers.WanTransformer3DModel(**diffusers_config(cfg))
    ref.load_state_dict(to_diffusers(sd))
    ref.save_pretrained(tmp_path / "transformer")
    got = load_into_fresh(tmp_path / "transformer").state_dict()
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_init_from_config_mismatch_names_the_field(tmp_path):
    cfg, sd = tiny(), random_weights(tiny(), 3)
    write(sd, cfg, "wan", str(tmp_path / "w"), "fp32")
    doc = json.loads((tmp_path / "w" / "config.json").read_text())
    (tmp_path / "w" / "config.json").write_text(json.dumps({**doc, "num_layers": 30}))
    with pytest.raises(UserError, match=r"w/config.json: num_layers is 30 there, 2 in --model-config"):
        load_into_fresh(tmp_path / "w")
    write(sd, cfg, "diffusers", str(tmp_path / "d"), "fp32")
    doc = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**doc, "attention_head_dim": 32}))
    with pytest.raises(UserError, match=r"d/config.json: dim is 64 there, 128 in"):
        load_into_fresh(tmp_path / "d")
    (tmp_path / "d" / "config.json").unlink()
    with pytest.raises(UserError, match=r"--init-from .*d: no .*config.json"):
        load_into_fresh(tmp_path / "d")


def test_init_from_names_missing_extra_and_misshapen_keys(tmp_path):
    from safetensors.torch import save_file

    cfg, sd = tiny(), random_weights(tiny(), 4)
    write(sd, cfg, "wan", str(tmp_path / "w"), "fp32")
    f = tmp_path / "w" / "diffusion_pytorch_model.safetensors"
    bad = {k: v for k, v in sd.items() if k != "head.modulation"}
    bad["blocks.1.ffn.0.weight"] = torch.zeros(3, 128)
    bad["blocks.0.self_attn.qq.weight"] = torch.zeros(2)
    save_file(bad, str(f))
    with pytest.raises(UserError) as e:
        load_into_fresh(tmp_path / "w")
    msg = str(e.value)
    assert msg.startswith("--init-from ") and "\n" not in msg
    assert "1 missing: head.modulation" in msg
    assert "1 not in the model: blocks.0.self_attn.qq.weight" in msg
    assert "blocks.1.ffn.0.weight [3, 128] (the model has [256, 128])" in msg


@pytest.mark.slow
@needs_launcher
def test_zero3_ranks_read_only_their_partitions(tmp_path):
    cfg, sd = tiny(), random_weights(tiny(), 5)
    write(sd, cfg, "diffusers", str(tmp_path / "src"), "fp32", "300KB")
    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(master_port()),
                           "tests/init_from_worker.py", str(tmp_path / "src"), str(tmp_path)],
                          cwd=ROOT, env=launcher_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert doc["world"] == 2
        assert len(doc["max_abs_diff"]) == len(sd)
        assert all(d == 0.0 for d in doc["max_abs_diff"].values()), doc["max_abs_diff"]  # the file's values
        full = doc["full_bytes"]
        # Half the model plus the rows a partition boundary cuts, never one full copy.
        assert doc["partition_bytes"] <= full / 2 + 4 * 2 * len(sd)
        assert doc["bytes_read"] < 0.6 * full, (doc["bytes_read"], full)
        assert doc["peak_tensor_bytes"] + doc["partition_bytes"] < full


def test_init_from_with_resume_is_an_exit_2_error(tmp_path):
    proc = subprocess.run([sys.executable, "launch/train_wan.py", "--deepspeed_config", "configs/ds_tiny_cpu.json",
                           "--model-config", TINY, "--synthetic", "--max-steps", "1", "--init-from", str(tmp_path),
                           "--resume", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--init-from starts a new run" in proc.stderr
