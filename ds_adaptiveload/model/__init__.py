"""Wan 2.1 DiT: config, model, checkpoint loading and diffusers key conversion (docs/model.md).

Exports resolve lazily so that `from ds_adaptiveload.model import WanConfig` does not import torch."""
import importlib

_EXPORTS = {
    "WanConfig": "ds_adaptiveload.model.config",
    "WanModel": "ds_adaptiveload.model.wan",
    "SeqShard": "ds_adaptiveload.model.wan",
    "sdpa_attention": "ds_adaptiveload.model.wan",
    "fa4_attention": "ds_adaptiveload.model.attention",
    "resolve_attention": "ds_adaptiveload.model.attention",
    "convert_fp8": "ds_adaptiveload.model.fp8",
    "load_wan_checkpoint": "ds_adaptiveload.model.checkpoint",
    "save_wan_checkpoint": "ds_adaptiveload.model.checkpoint",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
