"""ds_adaptiveload: compute-balanced batching and fused kernels for video DiT training on DeepSpeed."""
import importlib

__version__ = "0.1.0"

# The public names and where they live. Imported on first use, so `import ds_adaptiveload` and the scheduler
# (make_plan and the rest of schedule/) stay torch-free; the loader API and the op import torch when touched.
_PUBLIC = {
    # the scheduler (torch-free)
    "Geometry": "ds_adaptiveload.schedule.geometry",
    "Sample": "ds_adaptiveload.schedule.manifest",
    "load_manifest": "ds_adaptiveload.schedule.manifest",
    "CostProfile": "ds_adaptiveload.schedule.profile",
    "PlanConfig": "ds_adaptiveload.schedule.planner",
    "Plan": "ds_adaptiveload.schedule.planner",
    "make_plan": "ds_adaptiveload.schedule.planner",
    "AdaptiveSampler": "ds_adaptiveload.schedule.sampler",
    "AdaptiveLoadConfig": "ds_adaptiveload.train.config",
    # the loader API for your own DeepSpeed loop
    "get_dataloader_and_lr_scheduler": "ds_adaptiveload.loop",
    "AdaptiveLoader": "ds_adaptiveload.loader",
    "Step": "ds_adaptiveload.loader",
    "MicroBatch": "ds_adaptiveload.loader",
    # the fused LayerNorm-Modulate op
    "ln_modulate": "ds_adaptiveload.ops",
    "FusedLayerNormModulate": "ds_adaptiveload.ops",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ds_adaptiveload' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
