"""ds_adaptiveload: compute-balanced batching and fused kernels for video DiT training on DeepSpeed."""
from ds_adaptiveload import _moved

__version__ = "0.1.0"
_moved.install()  # old module paths (ds_adaptiveload.planner, ...) keep importing


def __getattr__(name):
    # Lazy: `import ds_adaptiveload` (and the torch-free `plan` command) must not import torch.
    if name == "get_dataloader_and_lr_scheduler":
        from ds_adaptiveload.loop import get_dataloader_and_lr_scheduler

        return get_dataloader_and_lr_scheduler
    raise AttributeError(f"module 'ds_adaptiveload' has no attribute {name!r}")
