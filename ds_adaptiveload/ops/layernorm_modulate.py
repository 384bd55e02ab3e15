"""Fused LayerNorm-Modulate: y = (LN(x) [* weight + bias]) * (1 + scale) + shift.

Layers as in Liger-Kernel: host functions calling the CUDA op (_fwd_impl / _bwd_impl), a small autograd
Function for eager mode, the same functions registered as a torch.library custom op (fake and autograd
included) for torch.compile, and a thin nn.Module. Where the op cannot be used (CPU tensors, no toolkit, a layout the kernel does not cover) the same
function runs `ln_modulate_reference`, a PyTorch implementation with identical semantics.

Backend choice: env DS_ADAPTIVELOAD_LN_MODULATE = auto (default: CUDA op when it loads, else PyTorch,
with one warning for CUDA tensors) | cuda (raise if the op cannot be used) | torch (always PyTorch).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from ds_adaptiveload.errors import UserError

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
GLOBAL, PER_SAMPLE, PER_TOKEN = 0, 1, 2

_op = None
_op_error: str | None = None
_warned = False


def load_op():
    """The compiled op module (prebuilt, else JIT-built once), or None with the reason in op_error()."""
    global _op, _op_error
    if _op is not None or _op_error is not None:
        return _op
    try:
        from ds_adaptiveload.ops.builder import LNModulateBuilder

        _op = LNModulateBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 - any build/import failure means "use the PyTorch path"
        _op_error = f"{type(err).__name__}: {err}"
    return _op


def op_error() -> str | None:
    return _op_error


def ln_modulate_reference(x, scale, shift, *, eps=1e-6, weight=None, bias=None, out_dtype=None):
    """PyTorch implementation: fp32 math, result in out_dtype (default x.dtype). Differentiable."""
    out_dtype = out_dtype or x.dtype
    y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return (y * (1 + scale.float()) + shift.float()).to(out_dtype)


def _mode(shape, B: int, S: int, D: int, xdim: int):
    """GLOBAL / PER_SAMPLE / PER_TOKEN: how a scale/shift of this shape maps onto rows b*S+s; None if the kernel
    does not cover it."""
    if len(shape) == 0 or shape[-1] != D or len(shape) > xdim:
        return None
    lead = [1] * (xdim - len(shape)) + list(shape[:-1])
    tb, ts = (1, lead[0]) if xdim == 2 else (lead[0], lead[1])
    if tb == 1 and ts == 1:
        return GLOBAL
    if tb == B and ts == 1:
        return GLOBAL if B == 1 else PER_SAMPLE
    if ts == S and (tb == B or B == 1):
        return PER_TOKEN
    return None


def _layout(t: torch.Tensor, B: int, S: int, D: int, xdim: int):
    """(mode, stride_b, stride_s, tensor) of a scale/shift tensor over rows b*S+s, or None if the kernel
    does not cover it. The returned tensor has unit stride along D (a copy only if it had not)."""
    mode = _mode(t.shape, B, S, D, xdim)
    if mode is None:
        return None
    if t.stride(-1) != 1:
        t = t.contiguous()
    if mode == GLOBAL:
        return GLOBAL, 0, 0, t
    sb = t.stride(-3) if (xdim == 3 and t.dim() == 3) else 0  # with B = 1 only b = 0 is read
    return (PER_SAMPLE, sb, 0, t) if mode == PER_SAMPLE else (PER_TOKEN, sb, t.stride(-2), t)


def _dims(x):
    """(B, S, D) of a [B, S, D] or [S, D] x."""
    return (1, x.shape[0], x.shape[1]) if x.dim() == 2 else tuple(x.shape)


def _plan(x, scale, shift, weight, bias, out_dtype):
    """Kernel plan (B, S, D, scale layout, shift layout) or a string saying why the kernel does not apply."""
    if x.dim() not in (2, 3):
        return "x must be 2-D or 3-D"
    B, S, D = _dims(x)
    if not 1 <= D <= 16384:
        return f"D={D} outside [1, 16384]"
    if x.dtype not in _KERNEL_DTYPES or out_dtype not in _KERNEL_DTYPES:
        return "dtype not in fp32/fp16/bf16"
    if scale.dtype != shift.dtype or scale.dtype not in (torch.float32, x.dtype):
        return "scale/shift dtype must be one of fp32 or x's dtype, and equal"
    tensors = [t for t in (x, scale, shift, weight, bias) if t is not None]
    if any(not t.is_cuda or t.device != x.device for t in tensors):
        return "tensors not all on one CUDA device"
    if B > 65535:
        return "batch over 65535"
    sc, sh = _layout(scale, B, S, D, x.dim()), _layout(shift, B, S, D, x.dim())
    if sc is None or sh is None:
        return "scale/shift layout not one of [D], [B,1,D], [B,S,D]"
    if any(w is not None and w.numel() != D for w in (weight, bias)):
        return "weight/bias must have D elements"
    return B, S, D, sc, sh


def _fwd_impl(x, scale, shift, weight, bias, eps, out_dtype, save=True, plan=None, into=None):
    """The CUDA op's forward: (y in out_dtype shaped like x, mean, rstd); mean/rstd are empty unless `save`.
    `plan`: _plan()'s, when the caller has it (eager), else planned here from the tensors as they arrive.
    `into`: a contiguous tensor shaped like x, of out_dtype (x's dtype or fp32), that the kernel writes y into."""
    plan = plan or _plan(x, scale, shift, weight, bias, out_dtype)
    B, S, D, (_, sc_sb, sc_ss, sc_t), (_, sh_sb, sh_ss, sh_t) = plan
    x2 = x.reshape(B * S, D).contiguous()
    w = weight.detach().reshape(D).float().contiguous() if weight is not None else None
    b = bias.detach().reshape(D).float().contiguous() if bias is not None else None
    # The kernel writes x's dtype or fp32; any other out_dtype is converted afterwards.
    k_dtype = out_dtype if out_dtype in (x.dtype, torch.float32) else torch.float32
    y, mean, rstd = load_op().forward(x2, sc_t, sh_t, w, b, B, S, sc_sb, sc_ss, sh_sb, sh_ss, float(eps),
                                      _DTYPE_CODE[k_dtype], bool(save), -1, -1,
                                      None if into is None else into.view(B * S, D))
    if not save:
        mean = rstd = x.new_empty(0, dtype=torch.float32)
    return y.view(x.shape).to(out_dtype), mean, rstd


def _grad_like(x, scale, shift_shape, shift_dtype, weight, bias):
    """(shape, dtype) of each gradient the backward returns (x, scale, shift, weight, bias); None if absent."""
    return [(x.shape, x.dtype), (scale.shape, scale.dtype), (tuple(shift_shape), shift_dtype)] + \
        [None if t is None else (t.shape, t.dtype) for t in (weight, bias)]


def _bwd_impl(dy, x, scale, shift_shape, shift_dtype, weight, bias, mean, rstd, eps, needs, dx_into=None):
    """The CUDA op's backward: (dx, dscale, dshift, dweight, dbias), each shaped and typed like its input (the
    shift by shift_shape / shift_dtype: the backward needs only its layout); an empty tensor where needs[i] is
    False or the input is None. The forward checked the plan. dx_into: a contiguous tensor like x for dx."""
    B, S, D = _dims(x)
    sc_mode, sc_sb, sc_ss, sc_t = _layout(scale, B, S, D, x.dim())
    sh_mode = _mode(shift_shape, B, S, D, x.dim())
    x2 = x.reshape(B * S, D).contiguous()
    w = weight.detach().reshape(D).float().contiguous() if weight is not None else None
    b = bias.detach().reshape(D).float().contiguous() if bias is not None else None
    k_dtype = dy.dtype if dy.dtype in (x.dtype, torch.float32) else torch.float32
    dy2 = dy.reshape(B * S, D).to(k_dtype).contiguous()
    have = [bool(n) and t is not None for n, t in zip(needs, (x, scale, True, weight, bias))]
    dx, dsc, dsh, dw, db = load_op().backward(
        dy2, x2, sc_t, w, b, mean if mean.numel() else None, rstd if rstd.numel() else None, B, S, sc_sb, sc_ss,
        sc_mode if have[1] else -1, sh_mode if have[2] else -1, have[3], have[4], float(eps), -1, -1,
        None if dx_into is None else dx_into.view(B * S, D))
    like = _grad_like(x, scale, shift_shape, shift_dtype, weight, bias)
    outs = [g.reshape(lk[0]).to(lk[1]) if h else x.new_empty(0) for g, lk, h in zip((dsc, dsh, dw, db), like[1:], have[1:])]
    return (dx.view(x.shape), *outs)


class LNModulateFunction(torch.autograd.Function):
    """Eager autograd over the CUDA op (less host time per call than the custom op's dispatch)."""

    @staticmethod
    def forward(ctx, x, scale, shift, weight, bias, eps, out_dtype, plan):
        save = any(ctx.needs_input_grad[:5])
        y, mean, rstd = _fwd_impl(x, scale, shift, weight, bias, eps, out_dtype, save, plan)
        ctx.save_for_backward(x, scale, weight, bias, mean, rstd)
        ctx.shift, ctx.eps = (shift.shape, shift.dtype), eps
        return y

    @staticmethod
    def backward(ctx, dy):
        needs = ctx.needs_input_grad[:5]
        x, scale, weight, bias, mean, rstd = ctx.saved_tensors
        grads = _bwd_impl(dy, x, scale, *ctx.shift, weight, bias, mean, rstd, ctx.eps, needs)
        return tuple(g if n else None for g, n in zip(grads, needs)) + (None, None, None)


# ---- the same op as a torch.library custom op, which torch.compile traces (fullgraph) --------------------

@torch.library.custom_op("ds_adaptiveload::ln_modulate", mutates_args=(), device_types="cuda")
def ln_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], eps: float, out_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of the fused op; the layout (strides) is read from the tensors at run time."""
    return _fwd_impl(x, scale, shift, weight, bias, eps, out_dtype)


@torch.library.custom_op("ds_adaptiveload::ln_modulate_backward", mutates_args=(), device_types="cuda")
def ln_modulate_backward_op(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, shift_shape: list[int],
                            shift_dtype: torch.dtype, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                            mean: torch.Tensor, rstd: torch.Tensor, eps: float, needs: list[bool]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(dy, x, scale, shift_shape, shift_dtype, weight, bias, mean, rstd, eps, needs)


@ln_modulate_op.register_kernel("cpu")
def _ln_modulate_cpu(x, scale, shift, weight, bias, eps, out_dtype):
    """PyTorch semantics on CPU (what torch.library.opcheck exercises without a GPU)."""
    xf = x.float()
    mean = xf.mean(-1).reshape(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False).reshape(-1) + eps)
    return ln_modulate_reference(x, scale, shift, eps=eps, weight=weight, bias=bias, out_dtype=out_dtype), mean, rstd


@ln_modulate_backward_op.register_kernel("cpu")
def _ln_modulate_backward_cpu(dy, x, scale, shift_shape, shift_dtype, weight, bias, mean, rstd, eps, needs):
    """The gradients in closed form (kernels run below autograd, so no autograd.grad here)."""
    xf, g = x.float(), dy.float()
    rs = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
    xhat = (xf - xf.mean(-1, keepdim=True)) * rs
    w = weight.float() if weight is not None else None
    z = xhat * w if w is not None else xhat
    z = z + bias.float() if bias is not None else z
    dz = g * (1 + scale.float())
    gw = dz * w if w is not None else dz
    dx = rs * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    full = (dx, g * z, g, dz * xhat, dz)
    like = _grad_like(x, scale, shift_shape, shift_dtype, weight, bias)
    return tuple(f.sum_to_size(lk[0]).to(lk[1]) if (n and lk is not None) else x.new_empty(0)
                 for f, lk, n in zip(full, like, needs))


@ln_modulate_op.register_fake
def _ln_modulate_fake(x, scale, shift, weight, bias, eps, out_dtype):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))


@ln_modulate_backward_op.register_fake
def _ln_modulate_backward_fake(dy, x, scale, shift_shape, shift_dtype, weight, bias, mean, rstd, eps, needs):
    like = _grad_like(x, scale, shift_shape, shift_dtype, weight, bias)
    return tuple(x.new_empty(lk[0], dtype=lk[1]) if (n and lk is not None) else x.new_empty(0)
                 for lk, n in zip(like, needs))


def _setup_context(ctx, inputs, output):
    x, scale, shift, weight, bias, eps, _ = inputs
    ctx.save_for_backward(x, scale, weight, bias, output[1], output[2])
    ctx.shift, ctx.eps = (list(shift.shape), shift.dtype), eps


def _backward(ctx, dy, _dmean, _drstd):
    needs = list(ctx.needs_input_grad[:5])
    x, scale, weight, bias, mean, rstd = ctx.saved_tensors
    grads = ln_modulate_backward_op(dy, x, scale, *ctx.shift, weight, bias, mean, rstd, ctx.eps, needs)
    return tuple(g if n else None for g, n in zip(grads, needs)) + (None, None)


ln_modulate_op.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _backend() -> str:
    """DS_ADAPTIVELOAD_LN_MODULATE, read once per trace under torch.compile (a constant of the graph)."""
    return os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE", "auto")


@torch.compiler.assume_constant_result
def _op_loads() -> bool:
    return load_op() is not None


def ln_modulate(x, scale, shift, *, eps=1e-6, weight=None, bias=None, out_dtype=None):
    """LN(x) [* weight + bias] * (1 + scale) + shift, computed in fp32, returned in out_dtype (default x.dtype).

    x: [B, S, D] or [S, D]; scale/shift: [D], [B, 1, D] or [B, S, D] (any row stride, e.g. chunks of a
    [B, S, 6, D] tensor), fp32 or x's dtype. Gradients flow to every tensor argument. Under torch.compile the
    CUDA op is the custom op ds_adaptiveload::ln_modulate (no graph break); the PyTorch path is traced as is."""
    out_dtype = out_dtype or x.dtype
    if x.shape[-1:] != scale.shape[-1:] or x.shape[-1:] != shift.shape[-1:]:
        raise UserError(f"ln_modulate: last dim of scale {tuple(scale.shape)} / shift {tuple(shift.shape)} "
                        f"must equal D of x {tuple(x.shape)}")
    plan = kernel_plan(x, scale, shift, weight, bias, out_dtype)
    if plan is not None:
        if torch.compiler.is_compiling():
            return ln_modulate_op(x, scale, shift, weight, bias, float(eps), out_dtype)[0]
        return LNModulateFunction.apply(x, scale, shift, weight, bias, eps, out_dtype, plan)
    return ln_modulate_reference(x, scale, shift, eps=eps, weight=weight, bias=bias, out_dtype=out_dtype)


def kernel_plan(x, scale, shift, weight=None, bias=None, out_dtype=None):
    """The CUDA op's plan for these tensors (_plan's tuple), or None where ln_modulate runs the PyTorch path:
    DS_ADAPTIVELOAD_LN_MODULATE=torch, CPU tensors, an uncovered layout or no op (warned once). Raises where the
    variable asks for cuda and the op cannot serve."""
    global _warned
    backend = _backend()
    if backend not in ("auto", "cuda", "torch"):
        raise UserError(f"DS_ADAPTIVELOAD_LN_MODULATE={backend!r}: expected auto, cuda or torch")
    if backend != "torch" and x.is_cuda:
        plan = _plan(x, scale, shift, weight, bias, out_dtype or x.dtype)
        if isinstance(plan, tuple) and _op_loads():
            return plan
        reason = plan if isinstance(plan, str) else f"op unavailable ({op_error()})"
        if backend == "cuda":
            raise RuntimeError(f"ln_modulate: CUDA op requested but not usable: {reason}")
        if not _warned and not torch.compiler.is_compiling():
            warnings.warn(f"ln_modulate: using the PyTorch implementation: {reason}", stacklevel=3)
            _warned = True
    elif backend == "cuda":
        raise RuntimeError("ln_modulate: CUDA op requested for CPU tensors")
    return None


class FusedLayerNormModulate(torch.nn.Module):
    """LayerNorm (optionally affine) fused with AdaLN modulation: forward(x, scale, shift)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False, out_dtype=None):
        super().__init__()
        self.dim, self.eps, self.out_dtype = dim, eps, out_dtype
        self.weight = torch.nn.Parameter(torch.ones(dim)) if elementwise_affine else None
        self.bias = torch.nn.Parameter(torch.zeros(dim)) if elementwise_affine else None

    def forward(self, x, scale, shift):
        return ln_modulate(x, scale, shift, eps=self.eps, weight=self.weight, bias=self.bias,
                           out_dtype=self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}, out_dtype={self.out_dtype}"
