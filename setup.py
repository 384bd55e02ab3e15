"""pip install .   |   DS_BUILD_OPS=1 pip install --no-build-isolation .  (prebuilds the fused op)"""
import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _op_extensions():
    """The fused LayerNorm-Modulate op, prebuilt when DS_BUILD_OPS=1 or DS_BUILD_LN_MODULATE=1 (DeepSpeed's
    convention; DS_BUILD_LN_MODULATE=0 opts out). DeepSpeed's setup.py only builds DeepSpeed's own ops, so we
    build ours here through the same CUDAOpBuilder. Needs torch + deepspeed installed (--no-build-isolation)."""
    flag = os.environ.get("DS_BUILD_LN_MODULATE", os.environ.get("DS_BUILD_OPS", "0"))
    if flag != "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    # Load builder.py by path: importing the package would import torch-using modules we do not need here.
    spec = importlib.util.spec_from_file_location("_dsal_builder", ROOT / "ds_adaptiveload" / "ops" / "builder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    builder = mod.LNModulateBuilder()
    if not builder.is_compatible(verbose=True):
        raise RuntimeError(f"DS_BUILD_LN_MODULATE=1 but the op cannot be built: {builder.error_log}")
    ext = builder.builder()
    # setuptools wants sources relative to setup.py.
    ext.sources = [os.path.relpath(s, ROOT) for s in ext.sources]
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _op_extensions()

setup(
    name="ds_adaptiveload",
    version="0.1.0",
    description="Compute-balanced batching and fused kernels for video DiT training on DeepSpeed",
    packages=find_packages(include=["ds_adaptiveload", "ds_adaptiveload.*"])
    + ["ds_adaptiveload.ops.csrc", "ds_adaptiveload.configs", "ds_adaptiveload.configs.profiles"],
    # Kernel sources ship inside the package so an installed wheel can JIT-build the op; the configs and cost
    # profiles so that the README's commands and adaptive_load.profile "auto" work outside a checkout (shipped.py).
    package_dir={"ds_adaptiveload.ops.csrc": "ops/csrc", "ds_adaptiveload.configs": "configs",
                 "ds_adaptiveload.configs.profiles": "configs/profiles"},
    package_data={"ds_adaptiveload.ops.csrc": ["*.cpp", "*.cu", "*.cuh", "*.h"],
                  "ds_adaptiveload.configs": ["*.json", "*.yaml"], "ds_adaptiveload.configs.profiles": ["*.yaml"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.16", "einops", "numpy", "pydantic>=2.7", "pyyaml", "safetensors", "tqdm",
                      "huggingface_hub"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "diffusers", "transformers", "tokenizers", "av", "matplotlib", "accelerate",
                 "peft>=0.17", "torchao>=0.18"],
        # adaptive_load.lora / --lora-rank: LoRA adapters through peft (model/lora.py)
        "lora": ["peft>=0.17"],
        "dataset": ["av", "matplotlib"],
        # --attention fa4 (auto takes it on Hopper): FlashAttention-4, CuTe DSL kernels (model/attention.py)
        "fa4": ["flash-attn-4"],
        # adaptive_load.fp8 / --fp8 linear: the blocks' linears in float8 through torchao's float8 training (model/fp8.py)
        "fp8": ["torchao>=0.18"],
        # `encode`: Wan's VAE (diffusers AutoencoderKLWan) and umT5 (transformers UMT5EncoderModel)
        "encode": ["av", "diffusers>=0.33", "transformers>=4.45", "tokenizers"],
        # `sample`, --preview-every, and loading an `export` in diffusers (from_pretrained needs accelerate)
        "sample": ["av", "diffusers>=0.33", "transformers>=4.45", "tokenizers", "accelerate"],
    },
)
