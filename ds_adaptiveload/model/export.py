"""Training checkpoints out to formats other tools load: a DeepSpeed checkpoint folder (ZeRO-0 to 3, or its EMA)
read as one state dict in our (original Wan 2.1) names, then written by a registered Format as safetensors, sharded
with an index above a size limit, beside its config.json.

A format is one Format entry in FORMATS: how keys are named, what config.json holds and what the files are called;
the reading, dtype cast and sharding are shared.
"""
import json
import os
from dataclasses import dataclass
from typing import Callable

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.model.convert import diffusers_config, to_diffusers

MODEL_CONFIG_FILE = "model_config.json"  # the run's WanConfig, written into every checkpoint folder
EMA_PREFIX = "ema_rank"  # ema_rank{r}.pt: rank r's EMA partitions (train/ema.py)
WEIGHTS_NAME = "diffusion_pytorch_model"  # the file stem of both Wan 2.1 releases (original and diffusers)


@dataclass(frozen=True)
class Format:
    """How one output format names keys and describes the model."""
    rename: Callable[[dict], dict]
    """our state dict -> the format's (same tensors)"""
    config: Callable[[WanConfig], dict]
    """config.json's content"""
    stem: str = WEIGHTS_NAME
    """safetensors file name: STEM.safetensors, or STEM-0000i-of-0000n.safetensors + STEM.safetensors.index.json"""


def wan_config(cfg: WanConfig) -> dict:
    """config.json of the original Wan 2.1 release (Wan-AI/Wan2.1-T2V-*), which the Wan repository reads."""
    return {"_class_name": "WanModel", "model_type": "t2v", **cfg.to_dict()}


def diffusers_config_json(cfg: WanConfig) -> dict:
    """config.json that diffusers' WanTransformer3DModel.from_pretrained reads."""
    try:
        from importlib.metadata import version

        ver = version("diffusers")
    except Exception:  # diffusers need not be installed to write its format
        ver = "0.33.0"
    c = diffusers_config(cfg)
    c["patch_size"] = list(c["patch_size"])
    return {"_class_name": "WanTransformer3DModel", "_diffusers_version": ver, **c}


FORMATS = {
    "diffusers": Format(to_diffusers, diffusers_config_json),
    "wan": Format(dict, wan_config),
}
"""--format choices of `export`; a new format is one entry."""


# ---------------------------------------------------------------------------------------------------- reading


def checkpoint_tag(ckpt_dir: str, tag=None) -> str:
    """The tag folder to export: `tag`, else the one `latest` names; both checked to exist."""
    from ds_adaptiveload.train.checkpoint import latest_tag

    if not os.path.isdir(ckpt_dir):
        raise UserError(f"--checkpoint {ckpt_dir}: not a folder")
    if tag is None:
        return latest_tag(ckpt_dir, "--checkpoint")
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        have = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("global_step"))
        raise UserError(f"--checkpoint {ckpt_dir}: no checkpoint {tag!r} (there: {', '.join(have) or 'none'})")
    return tag


def model_config(ckpt_dir: str, tag: str, override=None) -> WanConfig:
    """The checkpoint's WanConfig (its model_config.json), or `override` (--model-config) where given."""
    if override:
        return WanConfig.from_yaml(override)
    path = os.path.join(ckpt_dir, tag, MODEL_CONFIG_FILE)
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing (a checkpoint written before it was saved); give --model-config")
    with open(path) as f:
        return WanConfig.from_dict(json.load(f), source=path)


def _clean(name: str) -> str:
    """A parameter name without the wrappers torch.compile puts in module paths."""
    return name.replace("_orig_mod.", "")


def read_weights(ckpt_dir: str, tag: str, trust: bool = False) -> dict:
    """name -> fp32 tensor, or a DeepSpeed lazy tensor that .contiguous() materialises (ZeRO-1/2/3: DeepSpeed's
    zero_to_fp32 in lazy mode, so the full state dict is never held twice); ZeRO-0: the module state. DeepSpeed's
    reader unpickles fully, so the folder's files are first checked to need nothing but tensors and the few
    DeepSpeed types a checkpoint holds (train/ckpt_safe.py), unless `trust`."""
    import glob

    import torch

    from ds_adaptiveload.train.ckpt_safe import check_folder, safe_globals

    folder = os.path.join(ckpt_dir, tag)
    check_folder(folder, trust)
    if glob.glob(os.path.join(folder, "*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag, lazy_mode=True)
    else:
        path = os.path.join(folder, "mp_rank_00_model_states.pt")
        if not os.path.isfile(path):
            raise UserError(f"{folder}: neither ZeRO optimizer states nor mp_rank_00_model_states.pt: not a "
                            f"DeepSpeed checkpoint")
        with torch.serialization.safe_globals(safe_globals()):
            sd = torch.load(path, map_location="cpu", weights_only=not trust)["module"]
    return {_clean(k): v for k, v in sd.items()}


def read_ema(ckpt_dir: str, tag: str, cfg: WanConfig) -> dict:
    """name -> fp32 tensor of the EMA weights: every rank's partitions joined (train/ema.py writes them)."""
    import glob

    import torch

    files = sorted(glob.glob(os.path.join(ckpt_dir, tag, EMA_PREFIX + "*.pt")),
                   key=lambda f: int(os.path.basename(f)[len(EMA_PREFIX):-3]))
    if not files:
        raise UserError(f"--ema: {os.path.join(ckpt_dir, tag)} holds no EMA (the run had no "
                        f"adaptive_load.ema_decay)")
    parts = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    out = {}
    for name, shape in parts[0]["shapes"].items():
        flat = torch.cat([p["ema"][name] for p in parts])  # rank order: ZeRO-3's partitions of the flat tensor
        numel = int(torch.Size(shape).numel())
        out[_clean(name)] = flat[:numel].view(shape)
    return out


# ---------------------------------------------------------------------------------------------------- writing


DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def write(weights: dict, cfg: WanConfig, fmt: str, out: str, dtype: str = "bf16",
          max_shard_size="5GB") -> list:
    """Write `weights` (our names; tensors or lazy tensors) in format `fmt` into folder `out`: config.json and
    safetensors, one shard materialised at a time. Returns the files written."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    form = FORMATS[fmt]
    torch_dtype = getattr(torch, DTYPES[dtype])
    named = form.rename(weights)
    # Sizes only: the split is planned on empty tensors of the output dtype, then each shard is read in turn.
    plan = split_torch_state_dict_into_shards(
        {k: torch.empty(tuple(v.shape), dtype=torch_dtype, device="meta") for k, v in named.items()},
        filename_pattern=form.stem + "{suffix}.safetensors", max_shard_size=max_shard_size)
    os.makedirs(out, exist_ok=True)
    written = []
    for filename, keys in plan.filename_to_tensors.items():
        shard = {k: named[k].contiguous().to(torch_dtype).contiguous() for k in keys}
        save_file(shard, os.path.join(out, filename), metadata={"format": "pt"})
        written.append(filename)
        del shard
    if plan.is_sharded:
        index = {"metadata": {**plan.metadata}, "weight_map": plan.tensor_to_filename}
        _write_json(os.path.join(out, form.stem + ".safetensors.index.json"), index)
    _write_json(os.path.join(out, "config.json"), form.config(cfg))
    return written


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
