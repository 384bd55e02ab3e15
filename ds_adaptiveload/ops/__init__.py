"""Fused kernels. `ln_modulate` runs the CUDA op when it can load, else an identical PyTorch path."""
from ds_adaptiveload.ops.layernorm_modulate import (  # noqa: F401
    FusedLayerNormModulate,
    LNModulateFunction,
    ln_modulate,
    ln_modulate_reference,
)
