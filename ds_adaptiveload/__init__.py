"""ds_adaptiveload: compute-balanced batching and fused kernels for video DiT training on DeepSpeed."""
from ds_adaptiveload import _moved

__version__ = "0.1.0"
_moved.install()  # old module paths (ds_adaptiveload.planner, ...) keep importing
