"""ds_adaptiveload: compute-balanced batching and fused kernels for video DiT training on DeepSpeed."""

__version__ = "0.1.0"
