"""--init-from: pretrained Wan 2.1 weights (the original release's folder or a diffusers `transformer/` folder) read
into a WanModel before deepspeed.initialize, one tensor at a time; under ZeRO-3 each rank reads only the slice of each
tensor that its partition holds, so a 14B model never needs one full copy per rank.

Both layouts hold `config.json` beside `diffusion_pytorch_model*.safetensors` (sharded with an index for 14B); the
folder's config is checked against the run's WanConfig before any weight is read.
"""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.checkpoint import resolve_files
from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.model.convert import from_diffusers

_PREFIXES = ("model.diffusion_model.",)  # ComfyUI-style single-file exports


def wan_config_fields(cfg: dict, source: str) -> dict:
    """WanConfig fields that a config.json states, from either layout: the original release's (WanModel: dim,
    num_heads, ...) or diffusers' (WanTransformer3DModel: num_attention_heads, attention_head_dim, ...)."""
    if "num_attention_heads" in cfg or cfg.get("_class_name") == "WanTransformer3DModel":
        if cfg.get("image_dim") or cfg.get("added_kv_proj_dim"):
            raise UserError(f"{source}: an image-to-video transformer (image_dim set); only text-to-video loads")
        out = {"num_heads": cfg.get("num_attention_heads"), "in_dim": cfg.get("in_channels"),
               "out_dim": cfg.get("out_channels"), **{k: cfg.get(k) for k in
                                                     ("text_dim", "freq_dim", "ffn_dim", "num_layers", "eps",
                                                      "cross_attn_norm", "patch_size")}}
        if cfg.get("num_attention_heads") and cfg.get("attention_head_dim"):
            out["dim"] = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        if "qk_norm" in cfg:
            out["qk_norm"] = bool(cfg["qk_norm"])
    else:
        if cfg.get("model_type", "t2v") != "t2v":
            raise UserError(f"{source}: model_type {cfg['model_type']!r}; only text-to-video (t2v) loads")
        names = [f for f in WanConfig.__dataclass_fields__]
        out = {k: cfg.get(k) for k in names}
    if out.get("patch_size") is not None:
        out["patch_size"] = tuple(out["patch_size"])
    return {k: v for k, v in out.items() if v is not None}


def check_config(stated: dict, model_cfg: WanConfig, source: str, model_source: str) -> None:
    """Every field the folder's config states must equal the run's (--model-config)."""
    for k, v in stated.items():
        have = getattr(model_cfg, k)
        same = math.isclose(v, have) if isinstance(v, float) else v == have
        if not same:
            raise UserError(f"{source}: {k} is {list(v) if isinstance(v, tuple) else v!r} there, "
                            f"{list(have) if isinstance(have, tuple) else have!r} in {model_source}")


@dataclass
class Source:
    """The weight files of an --init-from folder or file, their tensors by our parameter name."""
    path: str
    files: list
    config: dict | None
    """config.json beside the weights (None: there is none)"""
    config_path: str
    tensors: dict = field(default_factory=dict)
    """our name -> (file, stored key, shape)"""


def open_source(path: str) -> Source:
    """The files, config.json (beside the weights; {} for a bare .safetensors file) and the name of each stored
    tensor in our (original Wan) names."""
    from safetensors import safe_open

    files = resolve_files(path)
    cfg_path = (Path(path) if Path(path).is_dir() else files[0].parent) / "config.json"
    config = None
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise UserError(f"{cfg_path}: not valid JSON ({e})") from None
    src = Source(str(path), files, config, str(cfg_path))
    headers = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                headers.append((f, {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}))
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise UserError(f"{f}: cannot read safetensors header ({e})") from None
    stripped = {k: next((k[len(p):] for p in _PREFIXES if k.startswith(p)), k) for _, ks in headers for k in ks}
    diffusers_fmt = any(k.startswith(("condition_embedder.", "proj_out.")) for k in stripped.values())
    for f, keys in headers:
        for k, shape in keys.items():
            try:
                ours = next(iter(from_diffusers({stripped[k]: None}))) if diffusers_fmt else stripped[k]
            except UserError as e:
                raise UserError(f"{f}: {e}") from None
            if ours in src.tensors:
                raise UserError(f"{f}: key {k!r} appears twice in the checkpoint")
            src.tensors[ours] = (f, k, shape)
    return src


def check_keys(src: Source, expected: dict) -> None:
    """expected: our name -> shape. Missing, extra and misshapen keys, each named (up to 8 of each)."""
    def few(names):
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    extra = [src.tensors[n][1] for n in src.tensors if n not in expected]
    missing = [n for n in expected if n not in src.tensors]
    bad = [f"{src.tensors[n][1]} {list(src.tensors[n][2])} (the model has {list(s)})"
           for n, s in expected.items() if n in src.tensors and tuple(src.tensors[n][2]) != tuple(s)]
    problems = [f"{len(missing)} missing: {few(missing)}" if missing else "",
                f"{len(extra)} not in the model: {few(extra)}" if extra else "",
                f"{len(bad)} of another shape: {few(bad)}" if bad else ""]
    problems = [p for p in problems if p]
    if problems:
        raise UserError(f"{src.path}: keys do not match the model ({'; '.join(problems)}); "
                        f"is --model-config the checkpoint's architecture?")


def param_shapes(model) -> dict:
    """name -> full shape of every parameter (ZeRO-3 partitioned ones report ds_shape)."""
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}


def prepare(path: str, model, model_cfg: WanConfig, model_source: str) -> Source:
    """Every check of --init-from, before a weight is read (no collectives: the trainer agrees on the error)."""
    src = open_source(path)
    if src.config is None:
        raise UserError(f"--init-from {path}: no {src.config_path} (the original Wan 2.1 release and diffusers' "
                        f"transformer/ folder both have one beside the weights)")
    check_config(wan_config_fields(src.config, src.config_path), model_cfg, src.config_path, model_source)
    try:
        check_keys(src, param_shapes(model))
    except UserError as e:
        raise UserError(f"--init-from {e}") from None
    return src


def read_flat_range(handle, key: str, shape, start: int, stop: int):
    """(elements [start, stop) of the flattened tensor `key`, bytes read): only the rows of dim 0 that hold them
    are read."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    r0, r1 = start // row, -(-stop // row)
    part = handle.get_slice(key)[r0:r1] if shape else handle.get_tensor(key)
    return part.reshape(-1)[start - r0 * row:stop - r0 * row], part.numel() * part.element_size()


def load(src: Source, model) -> dict:
    """Copy the weights into `model` in place, one tensor at a time. A ZeRO-3 parameter (p.ds_tensor) gets only its
    partition's elements, read from the rows that hold them. Returns {"bytes_read", "peak_tensor_bytes"}: what this
    rank read from the files, and the largest single read (its host memory beyond the model)."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    stats = {"bytes_read": 0, "peak_tensor_bytes": 0}
    by_file = {}
    for name, p in model.named_parameters():
        if name in src.tensors:  # check_keys decided whether a missing one is an error
            by_file.setdefault(src.tensors[name][0], []).append((name, p))
    with torch.no_grad():
        for f, params in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for name, p in params:
                    _, key, shape = src.tensors[name]
                    if hasattr(p, "ds_tensor"):
                        part = p.ds_tensor
                        n = part.numel()
                        start = n * dist.get_rank(group=p.ds_process_group)
                        stop = min(start + n, math.prod(shape))
                        values, nbytes = read_flat_range(h, key, shape, start, stop) if stop > start else (None, 0)
                        if values is not None:
                            part.data[:values.numel()].copy_(values)
                    else:
                        values = h.get_tensor(key)
                        p.data.copy_(values)
                        nbytes = values.numel() * values.element_size()
                    stats["bytes_read"] += nbytes
                    stats["peak_tensor_bytes"] = max(stats["peak_tensor_bytes"], nbytes)
                    del values
    return stats
