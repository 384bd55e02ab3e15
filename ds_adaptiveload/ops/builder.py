"""DeepSpeed op builder for the fused LayerNorm-Modulate CUDA op.

Declarative like DeepSpeed's op_builder/fused_adam.py; the overrides below fix three things in
DeepSpeed 0.19.8's CUDAOpBuilder that break where our users are (Hopper, CUDA 13, wheels).
"""
import importlib
import os
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, installed_cuda_version

_HERE = Path(__file__).resolve().parent

# Used when TORCH_CUDA_ARCH_LIST is unset and no GPU is visible (CI, build hosts). DeepSpeed's own
# default under CUDA 13 is 6.0;6.1;7.0, which nvcc 13 rejects; the op needs sm_80+ anyway (bf16).
DEFAULT_ARCHS = "8.0;9.0"


def csrc_dir() -> Path:
    """Kernel sources: shipped as package data in a wheel, else the checkout's ops/csrc."""
    for d in (_HERE / "csrc", _HERE.parent.parent / "ops" / "csrc"):
        if (d / "ln_modulate.cpp").is_file():
            return d
    raise FileNotFoundError(f"ln_modulate sources not found under {_HERE / 'csrc'} or the checkout's ops/csrc")


def parse_arch_list(spec: str) -> list[tuple[int, int, str, bool]]:
    """'8.0;9.0a 10.0+PTX' -> [(8, 0, '', False), (9, 0, 'a', False), (10, 0, '', True)], sorted, deduped.

    Accepts the architecture-specific suffixes 'a' / 'f' that torch itself accepts (DeepSpeed 0.19.8
    does int('0a') and crashes) and the named forms torch knows ('Hopper' etc. are not accepted here)."""
    out: dict[tuple[int, int, str], bool] = {}
    for tok in spec.replace(" ", ";").split(";"):
        tok = tok.strip()
        if not tok:
            continue
        ptx = tok.endswith("+PTX")
        num = tok[:-4] if ptx else tok
        major, _, minor = num.partition(".")
        suffix = minor.lstrip("0123456789")
        minor = minor[: len(minor) - len(suffix)]
        if not major.isdigit() or not minor.isdigit() or suffix not in ("", "a", "f"):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot parse {tok!r} (expected e.g. 9.0, 9.0a, 9.0+PTX)")
        key = (int(major), int(minor), suffix)
        out[key] = out.get(key, False) or ptx
    return [(ma, mi, sfx, ptx) for (ma, mi, sfx), ptx in sorted(out.items())]


def gencode_flags(archs: list[tuple[int, int, str, bool]]) -> list[str]:
    flags = []
    for major, minor, suffix, ptx in archs:
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


# Bench-only build flag: DS_ADAPTIVELOAD_OP_TUNING=1 builds the op (JIT, under another name, so neither build is
# taken for the other) with its kernel-choice setters compiled in (bench/kernel/ln_tuning.py). Users' builds lack them.
TUNING_ENV = "DS_ADAPTIVELOAD_OP_TUNING"


def tuning_build() -> bool:
    return os.environ.get(TUNING_ENV, "") == "1"


class LNModulateBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_LN_MODULATE"
    NAME = "ln_modulate"

    def __init__(self):
        self.tuning = tuning_build()
        super().__init__(name=self.NAME + ("_tuning" if self.tuning else ""))

    def absolute_name(self):
        return f"ds_adaptiveload.ops.{self.name}_op"

    def _flag(self):
        return ["-DLNMOD_BENCH_TUNING"] if self.tuning else []

    def sources(self):
        d = csrc_dir()
        return [str(d / f) for f in (
            "ln_modulate.cpp", "ln_modulate_fwd.cu", "ln_modulate_bwd.cu", "ln_modulate_fast.cu", "ln_modulate_batch.cu",
            "ln_modulate_resid.cu")]

    def include_paths(self):
        return [str(csrc_dir())]

    def cxx_args(self):
        return super().cxx_args() + self.version_dependent_macros() + self._flag()

    def nvcc_args(self):
        return ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"] + self.compute_capability_args() + self._flag()

    # ---- overrides of DeepSpeed's base behaviour -------------------------------------------------

    def arch_list(self) -> str:
        """TORCH_CUDA_ARCH_LIST, else the visible GPUs, else DEFAULT_ARCHS (not DeepSpeed's CUDA-version
        table, which has no CUDA 13 row and falls back to archs nvcc 13 no longer accepts)."""
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if env:
            return env
        import torch

        if torch.cuda.is_available() and not (hasattr(torch.cuda, "_is_in_bad_fork") and torch.cuda._is_in_bad_fork()):
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            # sm_90a where possible: same code, and it is what Hopper users set anyway.
            return ";".join(f"{ma}.{mi}{'a' if (ma, mi) == (9, 0) else ''}" for ma, mi in sorted(caps))
        return DEFAULT_ARCHS

    def compute_capability_args(self, cross_compile_archs=None):
        # WHY: DeepSpeed parses '9.0a' with int() and crashes (the GPU machine sets TORCH_CUDA_ARCH_LIST=9.0a).
        # We emit explicit -gencode flags in JIT and prebuild alike; torch then adds none of its own.
        archs = parse_arch_list(cross_compile_archs or self.arch_list())
        if not archs:
            raise RuntimeError(f"{self.NAME}: empty CUDA arch list")
        too_old = [f"{ma}.{mi}" for ma, mi, _, _ in archs if ma < 8]
        if too_old:
            raise RuntimeError(f"{self.NAME}: needs compute capability >= 8.0 (bf16); got {too_old}")
        self.enable_bf16 = True
        # torch's own flag generation reads this too (e.g. for the link step); keep it consistent.
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
            f"{ma}.{mi}{sfx}{'+PTX' if ptx else ''}" for ma, mi, sfx, ptx in archs)
        return gencode_flags(archs)

    def is_compatible(self, verbose=False):
        # WHY: the base says yes everywhere; without nvcc the build can only fail later, less clearly.
        try:
            installed_cuda_version()
        except Exception as err:  # MissingCUDAException and friends
            self.error_log = f"{self.NAME}: no CUDA toolkit ({err}); set CUDA_HOME to the toolkit root"
            if verbose:
                self.warning(self.error_log)
            return False
        return super().is_compatible(verbose)

    def prebuilt(self):
        """The module built by `DS_BUILD_LN_MODULATE=1 pip install .`, or None (absent or built for
        another torch)."""
        try:
            mod = importlib.import_module(self.absolute_name())
        except ImportError:
            return None
        import torch

        if getattr(mod, "torch_version", None) != ".".join(torch.__version__.split(".")[:2]):
            return None
        return mod

    def load(self, verbose=False):
        # WHY: DeepSpeed's load() only trusts its own installed_ops table (written by DeepSpeed's setup.py),
        # which never lists our op, so it would always JIT. Prefer our prebuilt module, then JIT.
        if self.name in CUDAOpBuilder._loaded_ops:
            return CUDAOpBuilder._loaded_ops[self.name]
        mod = self.prebuilt()
        if mod is not None:
            CUDAOpBuilder._loaded_ops[self.name] = mod
            return mod
        return self.jit_load(verbose)
