"""Load / save Wan 2.1 weights as safetensors: a single file, a sharded index, or a directory holding
either, in the original Wan key names or diffusers' (converted on the fly)."""
import json
from pathlib import Path

import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.convert import from_diffusers, to_diffusers

_PREFIXES = ("model.diffusion_model.",)  # ComfyUI-style single-file exports


def _resolve_files(path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise UserError(f"{p}: several safetensors index files ({[i.name for i in indexes]}); pass one")
        if indexes:
            return _resolve_files(indexes[0])
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
    deepspeed.initialize (ZeRO-3 partitions parameters)."""
    from safetensors import safe_open

    files = _resolve_files(path_or_dir)
    headers = []  # (file, {stored_key: shape})
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                headers.append((f, {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}))
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise UserError(f"{f}: cannot read safetensors header ({e})") from None

    stored = [k for _, keys in headers for k in keys]
    strip = {k: next((k[len(p):] for p in _PREFIXES if k.startswith(p)), k) for k in stored}
    diffusers_fmt = any(k.startswith(("condition_embedder.", "proj_out.")) for k in strip.values())
    names = {}  # stored key -> our key
    for f, keys in headers:
        for k in keys:
            try:
                names[k] = next(iter(from_diffusers({strip[k]: None}))) if diffusers_fmt else strip[k]
            except UserError as e:
                raise UserError(f"{f}: {e}") from None

    expected = model.state_dict()
    seen = set()
    for f, keys in headers:
        for k, shape in keys.items():
            ours = names[k]
            if ours not in expected:
                raise UserError(f"{f}: unexpected key {k!r} (no parameter {ours!r} in this model config)")
            if ours in seen:
                raise UserError(f"{f}: key {k!r} appears twice in the checkpoint")
            seen.add(ours)
            want = tuple(expected[ours].shape)
            if shape != want:
                raise UserError(f"{f}: key {k!r} has shape {list(shape)}, the model expects {list(want)} "
                                "(wrong model config?)")
    missing = [k for k in expected if k not in seen]
    if missing and strict:
        raise UserError(f"{files[0] if len(files) == 1 else Path(path_or_dir)}: {len(missing)} parameter(s) "
                        f"missing from the checkpoint, e.g. {missing[:5]}")

    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    with torch.no_grad():
        for f, keys in headers:
            with safe_open(str(f), framework="pt") as h:
                for k in keys:
                    params[names[k]].copy_(h.get_tensor(k))
    return model


def save_wan_checkpoint(model_or_sd, path, diffusers: bool = False) -> None:
    """Write a model's (or a state dict's) weights to one .safetensors file, in Wan or diffusers keys."""
    from safetensors.torch import save_file

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, torch.nn.Module) else dict(model_or_sd)
    if diffusers:
        sd = to_diffusers(sd)
    save_file({k: v.detach().contiguous().cpu() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
