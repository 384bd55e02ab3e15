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


# ---------------------------------------------------------------------------------------------------- export


def train_tiny(out, stage, *extra, steps=2, adaptive_load=None):
    """The tiny model trained `steps` steps on 2 CPU ranks under ZeRO-`stage` (checkpoint at the end)."""
    from ds_adaptiveload.train.config import derive_ds_config
    from tests.test_train import check, launch

    keys = {"profile": os.path.join(ROOT, "configs/profiles/tiny-cpu.yaml"), **(adaptive_load or {})}
    cfg = derive_ds_config(os.path.join(ROOT, "configs", "ds_tiny_cpu.json"), zero_stage=stage, adaptive_load=keys,
                           monitor_path=str(out / "monitor"))
    os.makedirs(out, exist_ok=True)
    (out / "ds.json").write_text(json.dumps(cfg))
    proc = launch(out, "--synthetic", "--synthetic-num", "16", "--max-steps", str(steps), *extra,
                  config=out / "ds.json", timeout=900)
    check(proc)
    return proc


def export(*args):
    return subprocess.run([sys.executable, "-m", "ds_adaptiveload", "export", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def trained(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"zero{request.param}")
    train_tiny(out, request.param)
    return out, request.param


@pytest.mark.slow
@needs_launcher
def test_export_to_diffusers_and_wan_matches_our_model_and_loads_back(trained, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, stage = trained
    ckpt = out / "checkpoints"
    weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))  # DeepSpeed's own reading of the checkpoint
    cfg = tiny()
    ours = WanModel(cfg).eval()
    ours.load_state_dict(weights)
    for fmt in ("diffusers", "wan"):
        proc = export("--checkpoint", ckpt, "--format", fmt, "--out", tmp_path / fmt, "--dtype", "fp32",
                      "--max-shard-size", "300KB")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / fmt / "diffusion_pytorch_model.safetensors.index.json").exists()
        back = load_into_fresh(tmp_path / fmt).state_dict()  # the round trip through --init-from
        assert all(torch.equal(back[k], v) for k, v in weights.items())
    ref = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "diffusers").eval()
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 16, 2, 8, 12, generator=g), torch.rand(2, generator=g) * 1000
    ctx = torch.randn(2, cfg.text_len, cfg.text_dim, generator=g)
    with torch.no_grad():
        y, y_ref = ours(x, t, ctx), ref(x, t, ctx, return_dict=False)[0]
    assert ((y - y_ref).norm() / y_ref.norm()).item() <= 1e-5
    assert (y - ours.__class__(cfg)(x, t, ctx)).abs().max() > 0  # trained weights, not a fresh init
    wan_cfg = json.loads((tmp_path / "wan" / "config.json").read_text())
    assert wan_cfg["model_type"] == "t2v" and wan_cfg["dim"] == cfg.dim and wan_cfg["num_layers"] == cfg.num_layers
    proc = export("--checkpoint", ckpt, "--format", "diffusers", "--out", tmp_path / "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "diffusion_pytorch_model.safetensors"), "pt") as h:
        assert {h.get_tensor(k).dtype for k in h.keys()} == {torch.bfloat16}


@pytest.mark.slow
@needs_launcher
def test_a_run_started_with_init_from_an_export_starts_from_its_weights(trained, tmp_path):
    from safetensors.torch import load_file

    out, stage = trained
    if stage != 3:
        pytest.skip("one trainer launch is enough: ZeRO-3, where ranks read partitions")
    proc = export("--checkpoint", out / "checkpoints", "--format", "diffusers", "--out", tmp_path / "x", "--dtype",
                  "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dump = tmp_path / "dump.pt"
    train_tiny(tmp_path / "run", 3, "--init-from", tmp_path / "x", "--dump-grads", dump, "--no-final-save", steps=1)
    from ds_adaptiveload.model.convert import from_diffusers

    want = from_diffusers(load_file(str(tmp_path / "x" / "diffusion_pytorch_model.safetensors")))
    got = torch.load(dump)["params"]  # before the first update
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_export_errors_name_the_flag(tmp_path):
    proc = export("--checkpoint", tmp_path / "nope", "--format", "diffusers", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "error: --checkpoint" in proc.stderr and "not a folder" in proc.stderr
    (tmp_path / "c").mkdir()
    proc = export("--checkpoint", tmp_path / "c", "--format", "wan", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "no 'latest' file" in proc.stderr
    proc = export("--checkpoint", tmp_path / "c", "--tag", "global_step9", "--format", "wan", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "no checkpoint 'global_step9'" in proc.stderr
