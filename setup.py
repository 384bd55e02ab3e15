"""pip install .   |   DS_BUILD_OPS=1 pip install --no-build-isolation .  (prebuilds the fused op)"""
from setuptools import find_packages, setup

setup(
    name="ds_adaptiveload",
    version="0.1.0",
    description="Compute-balanced batching and fused kernels for video DiT training on DeepSpeed",
    packages=find_packages(include=["ds_adaptiveload", "ds_adaptiveload.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.16", "einops", "pyyaml", "safetensors", "tqdm"],
    extras_require={
        "test": ["pytest", "hypothesis", "diffusers", "av", "matplotlib"],
        "dataset": ["av", "matplotlib"],
    },
)
