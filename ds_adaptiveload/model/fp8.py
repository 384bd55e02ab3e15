"""FP8 linear layers for the Wan DiT through torchao's float8 training, rowwise scaling (--fp8 linear, docs/training.md).

`linear` converts every block's attention projections (self and cross attention q, k, v, o) and both FFN linears to
torchao Float8Linear: their GEMMs run in float8 e4m3 with one scale per row (torch._scaled_mm), forward and backward.
Everything else stays in the compute dtype (bf16): the patch, text and time embeddings, the time projection, the
head, the modulation and the attention kernels. The GEMMs are torchao's; nothing here computes in FP8 itself.

Convert BEFORE deepspeed.initialize and before any torch.compile (train/trainer.py does):
- deepspeed.initialize hands the optimizer the parameter objects it finds and, under ZeRO-3, hooks each module's
  call to gather its weights. Float8Linear.from_float re-uses the nn.Linear's weight and bias Parameter objects in a
  new module; swapped afterwards, the engine's module hooks would sit on modules no longer in the model.
- torch.compile (compile_blocks, compile_regions) traces the modules it meets; a module swapped after tracing would
  never run, and the compiled regions bind the fp8 layers' forwards by their class (model/compile.py).
"""
import re
from typing import Optional

from ds_adaptiveload.errors import UserError

FP8_MODES = ("off", "linear")
# Block-relative names of the linears `linear` converts: the attention projections and the FFN's two linears.
FP8_LINEARS = tuple(f"{a}.{p}" for a in ("self_attn", "cross_attn") for p in "qkvo") + ("ffn.0", "ffn.2")
_TARGET = re.compile(r"(?:^|\.)blocks\.\d+\.(" + "|".join(re.escape(n) for n in FP8_LINEARS) + ")$")
# torch._scaled_mm's float8 GEMMs need Ada (8.9), Hopper (9.0) or newer.
MIN_CAPABILITY = (8, 9)
PIP = "torchao>=0.18"  # setup.py extras "fp8"


def is_fp8_target(name: str) -> bool:
    """A module's full name (in WanModel, or under a wrapper that prefixes it) that `linear` converts."""
    return _TARGET.search(name) is not None


def fp8_targets(model) -> list:
    """The names of the modules of `model` that `linear` converts, in module order."""
    return [n for n, _ in model.named_modules() if n and is_fp8_target(n)]


def torchao_missing() -> Optional[str]:
    """None when torchao's float8 training imports, else why not (the import error's text)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def check_fp8(mode: str, device, label: str) -> None:
    """UserError naming `label` (the key or flag that asked for it) where `mode` cannot run here: torchao not
    installed, no CUDA device, or a GPU older than compute capability 8.9. Nothing to check for "off"."""
    if mode == "off":
        return
    if mode not in FP8_MODES:
        raise UserError(f"{label} {mode!r}: expected one of {', '.join(FP8_MODES)}")
    missing = torchao_missing()
    if missing:
        raise UserError(f"{label} {mode} needs torchao's float8 training, which does not import ({missing}): "
                        f"pip install '{PIP}' (or the package's extra: pip install 'ds_adaptiveload[fp8]')")
    import torch

    if device is None or torch.device(device).type != "cuda":
        where = "no device" if device is None else f"the device is {torch.device(device).type}"
        raise UserError(f"{label} {mode} needs a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                        f"or newer (Ada, Hopper, Blackwell): torch._scaled_mm runs FP8 GEMMs there only, and {where}; "
                        f"train with {label} off")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise UserError(f"{label} {mode} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; "
                        f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}; train with {label} off")


def rowwise_config(emulate: bool = False):
    """torchao's rowwise recipe: inputs, weights and output gradients cast to e4m3 with one power-of-2 scale per row.
    emulate: torchao's emulation of the scaled GEMM in high precision (CPU tests; no speed-up)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    # pad_inner_dim: torch._scaled_mm needs the inner dimension a multiple of 16, and in the weight gradient that is
    # the micro-batch's token count (32,760 for a 480p 81-frame clip is not); compiled regions see it as a symbol,
    # which failed the check at trace time on an H100 (2026-12-07). Padding copies only where it is not a multiple.
    return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), pad_inner_dim=True, emulate=emulate)


def convert_fp8(model, mode: str = "linear", config=None) -> list:
    """Convert `model`'s block linears to torchao float8 layers in place (mode "linear"; "off": nothing) and return
    the converted names. config: a torchao Float8LinearConfig (default rowwise_config()). Before
    deepspeed.initialize and before compiling (module docstring)."""
    if mode == "off":
        return []
    if mode not in FP8_MODES:
        raise UserError(f"convert_fp8: mode {mode!r}: expected one of {', '.join(FP8_MODES)}")
    missing = torchao_missing()
    if missing:
        raise UserError(f"convert_fp8: torchao's float8 training does not import ({missing}): pip install '{PIP}'")
    from torchao.float8 import convert_to_float8_training

    from ds_adaptiveload.model import fp8_layers

    kinds = {}

    def pick(module, name):
        if is_fp8_target(name):
            kinds[name] = type(module)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=pick, config=config or rowwise_config())
    for name, kind in kinds.items():  # the projections whose input is not what their weight multiplies
        fp8_layers.adopt(model.get_submodule(name), kind)
    return list(kinds)
