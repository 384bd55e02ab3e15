"""One allocator setting for calibration and training alike (the budget calibrate measures must hold in
training): PyTorch's expandable segments, unless the user set PYTORCH_CUDA_ALLOC_CONF. Without them, a
micro-batch at a budget fitted on small steps ran out of memory on H200s (2026-11-30: 135 GiB in use for a
fit of 126 GiB allocated): multi-GiB activations of a large micro-batch fragment the caching allocator's
fixed segments, which the allocated-bytes fit does not see. Set before the first CUDA allocation."""
import os

SETTING = "expandable_segments:True"


def use_expandable_segments() -> str:
    """Sets PYTORCH_CUDA_ALLOC_CONF when unset; returns the value in effect."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", SETTING)
