"""Export of a LoRA run (model/lora_export.py): a tiny LoRA run on 2 CPU ranks (ZeRO-2 and ZeRO-3), its adapters
exported as lora-diffusers and loaded into diffusers' WanTransformer3DModel over the same base give our model's
outputs (fp32, 1e-5); lora-wan names the original Wan keys; --merge writes the merged model that diffusers loads."""
import json
import os

import pytest
import torch

from ds_adaptiveload.model import WanConfig, WanModel
from tests.launcher import needs_launcher
from tests.test_init_export import export, train_tiny

pytest.importorskip("peft")
from ds_adaptiveload.model.lora import apply_lora  # noqa: E402
from ds_adaptiveload.train.config import LoraSettings  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "ffn", "head"]}


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def lora_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"lora-zero{request.param}")
    # lr 1e-2 without warm-up: after 3 steps every B is well away from zero
    train_tiny(out, request.param, steps=3, adaptive_load={"lora": LORA})
    return out


def ours_from(ckpt):
    """Our LoRA model with the checkpoint's weights (DeepSpeed's own reading of it)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    model = apply_lora(WanModel(TINY), LoraSettings(**LORA)).eval()
    model.load_state_dict(weights)
    return model, weights


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 16, 2, 8, 12, generator=g), torch.rand(2, generator=g) * 1000,
            torch.randn(2, TINY.text_len, TINY.text_dim, generator=g))


@pytest.mark.slow
@needs_launcher
def test_lora_exports_load_in_diffusers_and_match_our_model(lora_run, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import load_file

    from ds_adaptiveload.model.convert import diffusers_config, to_diffusers

    ckpt = lora_run / "checkpoints"
    ours, weights = ours_from(ckpt)
    x, t, ctx = _inputs()
    with torch.no_grad():
        y = ours(x, t, ctx)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in weights.items() if "blocks.0." in k)
    # adapters alone, over the same base in diffusers
    proc = export("--checkpoint", ckpt, "--format", "lora-diffusers", "--out", tmp_path / "ld", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = {k.replace(".base_layer.", "."): v for k, v in weights.items() if ".lora_" not in k}
    ref = diffusers.WanTransformer3DModel(**diffusers_config(TINY))
    ref.load_state_dict(to_diffusers(base))
    sd = load_file(str(tmp_path / "ld" / "pytorch_lora_weights.safetensors"))
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in sd and "transformer.proj_out.lora_B.weight" in sd
    ref.load_lora_adapter(sd, prefix="transformer")
    with torch.no_grad():
        y_ref = ref.eval()(x, t, ctx, return_dict=False)[0]
    assert ((y - y_ref).norm() / y_ref.norm()).item() <= 1e-5
    # merged into the base, as a diffusers folder
    proc = export("--checkpoint", ckpt, "--format", "diffusers", "--merge", "--out", tmp_path / "m", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        y_merged = merged(x, t, ctx, return_dict=False)[0]
    assert ((y - y_merged).norm() / y_merged.norm()).item() <= 1e-5
    # the original Wan names (ComfyUI), B scaled by alpha / r = 2
    proc = export("--checkpoint", ckpt, "--format", "lora-wan", "--out", tmp_path / "lw", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    wan = load_file(str(tmp_path / "lw" / "wan_lora.safetensors"))
    b = weights["blocks.1.ffn.2.lora_B.default.weight"]
    assert torch.equal(wan["diffusion_model.blocks.1.ffn.2.lora_B.weight"], b * 2.0)
    assert len(wan) == len(sd) == sum(".lora_" in k for k in weights)


@pytest.mark.slow
@needs_launcher
def test_lora_export_errors(lora_run, tmp_path):
    ckpt = lora_run / "checkpoints"
    proc = export("--checkpoint", ckpt, "--format", "diffusers", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "holds LoRA adapters; give --merge" in proc.stderr
    proc = export("--checkpoint", ckpt, "--format", "lora-wan", "--merge", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "--merge writes the merged model in --format diffusers or wan" in proc.stderr
    layout = json.loads((ckpt / "global_step3" / "adaptive_load.json").read_text())
    assert layout["lora"]["alpha"] == 8.0
