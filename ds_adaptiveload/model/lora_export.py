"""LoRA checkpoints out: the adapters alone, in the keys diffusers' WanPipeline.load_lora_weights reads (lora-diffusers)
or in the original Wan 2.1 names that ComfyUI reads (lora-wan), or the base with the adapters merged in (--merge).

A LoRA run's checkpoint names an adapted projection X's weights X.base_layer.weight (and .bias) and its adapters
X.lora_A.default.weight [r, in] and X.lora_B.default.weight [out, r] (peft's names, model/lora.py). The run's scale
alpha / r is read from the checkpoint's adaptive_load.json and folded into B, so a loader that applies scale 1 (no
alpha key: diffusers' and ComfyUI's default) computes W x + B A x with the trained scale.
"""
import json
import os

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.convert import to_diffusers

LORA_FORMATS = ("lora-diffusers", "lora-wan")
FILES = {"lora-diffusers": "pytorch_lora_weights.safetensors", "lora-wan": "wan_lora.safetensors"}


def is_lora_checkpoint(weights: dict) -> bool:
    return any(".lora_A." in k for k in weights)


def scale_of(ckpt_dir: str, tag: str, weights: dict) -> float:
    """alpha / rank of the run (its adaptive_load.json's lora section; alpha null: 1)."""
    from ds_adaptiveload.train.checkpoint import LAYOUT_FILE

    path = os.path.join(ckpt_dir, tag, LAYOUT_FILE)
    try:
        with open(path) as f:
            lora = json.load(f).get("lora")
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: the run's LoRA settings cannot be read ({e})") from None
    if not isinstance(lora, dict) or not lora.get("rank"):
        raise UserError(f"{path}: holds no lora section, but the checkpoint has adapters")
    return (lora.get("alpha") or lora["rank"]) / lora["rank"]


def split(weights: dict):
    """(base weights in our names, {module: (A, B)}) of a LoRA checkpoint's state dict."""
    base, adapters = {}, {}
    for name, t in weights.items():
        if ".lora_A." in name or ".lora_B." in name:
            module, rest = name.split(".lora_A." if ".lora_A." in name else ".lora_B.", 1)
            pair = adapters.setdefault(module, [None, None])
            pair[0 if ".lora_A." in name else 1] = t
        else:
            base[name.replace(".base_layer.", ".")] = t
    bad = [m for m, (a, b) in adapters.items() if a is None or b is None]
    if bad:
        raise UserError(f"the checkpoint's adapters are incomplete (no A or no B for {bad[:3]})")
    return base, {m: tuple(ab) for m, ab in adapters.items()}


def merged(weights: dict, scale: float) -> dict:
    """The base with W + scale * B A for every adapted projection (fp32), in our names."""
    base, adapters = split(weights)
    for module, (a, b) in adapters.items():
        w = base[module + ".weight"].contiguous().float()
        base[module + ".weight"] = w + scale * (b.contiguous().float() @ a.contiguous().float())
    return base


def adapter_weights(weights: dict, scale: float, fmt: str) -> dict:
    """The adapters as `fmt` names them: lora-diffusers transformer.<diffusers module>.lora_A.weight, lora-wan
    diffusion_model.<Wan module>.lora_A.weight; B scaled by alpha / r."""
    _, adapters = split(weights)
    out = {}
    for module, (a, b) in adapters.items():
        if fmt == "lora-diffusers":
            name = "transformer." + next(iter(to_diffusers({module + ".weight": None})))[:-len(".weight")]
        else:
            name = "diffusion_model." + module
        out[name + ".lora_A.weight"] = a.contiguous().float()
        out[name + ".lora_B.weight"] = b.contiguous().float() * scale
    return out


def write(weights: dict, scale: float, fmt: str, out: str, dtype: str) -> list:
    """The adapters of `weights` in `fmt` as one safetensors file in folder `out`; returns the files written."""
    import torch
    from safetensors.torch import save_file

    from ds_adaptiveload.model.export import DTYPES

    tensors = {k: v.to(getattr(torch, DTYPES[dtype])).contiguous()
               for k, v in adapter_weights(weights, scale, fmt).items()}
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, FILES[fmt]), metadata={"format": "pt"})
    return [FILES[fmt]]
