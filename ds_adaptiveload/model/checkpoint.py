"""Load / save Wan 2.1 weights as safetensors: a single file, a sharded index, or a directory holding
either, in the original Wan key names or diffusers' (converted on the fly)."""
import json
from pathlib import Path

import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.convert import to_diffusers


def resolve_files(path) -> list[Path]:
    """The .safetensors files of a file, an index .json or a folder (its one index, else every .safetensors)."""
    p = Path(path)
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise UserError(f"{p}: several safetensors index files ({[i.name for i in indexes]}); pass one")
        if indexes:
            return resolve_files(indexes[0])
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise UserError(f"{p}: no .safetensors file or index in this directory")
        return files
    if not p.exists():
        raise UserError(f"{p}: checkpoint not found")
    if p.name.endswith(".json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{p}: not a safetensors index with a weight_map ({e})") from None
        files = [p.parent / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.exists():
                raise UserError(f"{p}: shard {f.name} listed in the index is missing")
        return files
    if p.suffix != ".safetensors":
        raise UserError(f"{p}: expected a .safetensors file, an index .json or a directory")
    return [p]


def load_wan_checkpoint(model: torch.nn.Module, path_or_dir, strict: bool = True) -> torch.nn.Module:
    """Copy safetensors weights into `model` (a WanModel) in place and return it.

    Accepts original Wan 2.1 keys (optionally prefixed `model.diffusion_model.`) or diffusers
    WanTransformer3DModel keys. Every key and shape is checked before anything is copied; a problem
    raises UserError naming the key and file. Tensors are cast to the parameter dtype. strict=False
    tolerates missing parameters (unexpected keys and bad shapes are always errors). Load before
    deepspeed.initialize (ZeRO-3 partitions parameters: each rank reads only its partition, init_from.load)."""
    from ds_adaptiveload.model import init_from

    src = init_from.open_source(path_or_dir)
    shapes = init_from.param_shapes(model)
    init_from.check_keys(src, shapes if strict else {n: s for n, s in shapes.items() if n in src.tensors})
    init_from.load(src, model)
    return model


def save_wan_checkpoint(model_or_sd, path, diffusers: bool = False) -> None:
    """Write a model's (or a state dict's) weights to one .safetensors file, in Wan or diffusers keys."""
    from safetensors.torch import save_file

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, torch.nn.Module) else dict(model_or_sd)
    if diffusers:
        sd = to_diffusers(sd)
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
