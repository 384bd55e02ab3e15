"""Fused LayerNorm-Modulate: y = (LN(x) [* weight + bias]) * (1 + scale) + shift.

Three layers, as in Liger-Kernel: host functions calling the CUDA op, a small autograd Function, and a thin
nn.Module. Where the op cannot be used (CPU tensors, no toolkit, a layout the kernel does not cover) the same
function runs `ln_modulate_reference`, a PyTorch implementation with identical semantics.

Backend choice: env DS_ADAPTIVELOAD_LN_MODULATE = auto (default: CUDA op when it loads, else PyTorch,
with one warning for CUDA tensors) | cuda (raise if the op cannot be used) | torch (always PyTorch).
"""
from __future__ import annotations

import os
import warnings

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


def _layout(t: torch.Tensor, B: int, S: int, D: int, xdim: int):
    """(mode, stride_b, stride_s, tensor) of a scale/shift tensor over rows b*S+s, or None if the kernel
    does not cover it. The returned tensor has unit stride along D (a copy only if it had not)."""
    if t.dim() == 0 or t.shape[-1] != D or t.dim() > xdim:
        return None
    if t.stride(-1) != 1:
        t = t.contiguous()
    lead = [1] * (xdim - t.dim()) + list(t.shape[:-1])
    tb, ts = (1, lead[0]) if xdim == 2 else (lead[0], lead[1])
    if tb == 1 and ts == 1:
        return GLOBAL, 0, 0, t
    sb = t.stride(-3) if (xdim == 3 and t.dim() == 3) else 0
    if tb == B and ts == 1:
        return (GLOBAL, 0, 0, t) if B == 1 else (PER_SAMPLE, sb, 0, t)
    if ts == S and (tb == B or B == 1):
        return PER_TOKEN, (sb if tb == B else 0), t.stride(-2), t
    return None


def _plan(x, scale, shift, weight, bias, out_dtype):
    """Kernel plan (B, S, D, scale layout, shift layout) or a string saying why the kernel does not apply."""
    if x.dim() not in (2, 3):
        return "x must be 2-D or 3-D"
    D = x.shape[-1]
    B, S = (1, x.shape[0]) if x.dim() == 2 else (x.shape[0], x.shape[1])
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


def _shape_dtype(t):
    return None if t is None else (t.shape, t.dtype)


class LNModulateFunction(torch.autograd.Function):
    """Autograd Function over the CUDA op; `plan` comes from _plan()."""

    @staticmethod
    def forward(ctx, x, scale, shift, weight, bias, eps, out_dtype, plan):
        op = load_op()
        B, S, D, (sc_mode, sc_sb, sc_ss, sc_t), (sh_mode, sh_sb, sh_ss, sh_t) = plan
        x2 = x.reshape(B * S, D).contiguous()
        w = weight.detach().reshape(D).float().contiguous() if weight is not None else None
        b = bias.detach().reshape(D).float().contiguous() if bias is not None else None
        # The kernel writes x's dtype or fp32; any other out_dtype is converted afterwards.
        k_dtype = out_dtype if out_dtype in (x.dtype, torch.float32) else torch.float32
        save = any(ctx.needs_input_grad[:5])
        y, mean, rstd = op.forward(x2, sc_t, sh_t, w, b, B, S, sc_sb, sc_ss, sh_sb, sh_ss, float(eps),
                                   _DTYPE_CODE[k_dtype], bool(save), -1, -1)
        ctx.save_for_backward(x2, sc_t, w, b, mean, rstd)
        ctx.meta = (x.shape, scale.shape, scale.dtype, shift.shape, shift.dtype, B, S, D, sc_mode, sc_sb, sc_ss,
                    sh_mode, float(eps), k_dtype, _shape_dtype(weight), _shape_dtype(bias))
        return y.view(x.shape).to(out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, sc_t, w, b, mean, rstd = ctx.saved_tensors
        (x_shape, sc_shape, sc_dtype, sh_shape, sh_dtype, B, S, D, sc_mode, sc_sb, sc_ss, sh_mode, eps, k_dtype,
         weight, bias) = ctx.meta
        need = ctx.needs_input_grad
        dy2 = dy.reshape(B * S, D).to(k_dtype).contiguous()
        dx, dsc, dsh, dw, db = load_op().backward(
            dy2, x2, sc_t, w, b, mean, rstd, B, S, sc_sb, sc_ss, sc_mode if need[1] else -1,
            sh_mode if need[2] else -1, bool(need[3]), bool(need[4]), eps, -1, -1)
        dscale = dsc.reshape(sc_shape).to(sc_dtype) if need[1] else None
        dshift = dsh.reshape(sh_shape).to(sh_dtype) if need[2] else None
        dweight = dw.reshape(weight[0]).to(weight[1]) if need[3] else None
        dbias = db.reshape(bias[0]).to(bias[1]) if need[4] else None
        return dx.view(x_shape), dscale, dshift, dweight, dbias, None, None, None


def ln_modulate(x, scale, shift, *, eps=1e-6, weight=None, bias=None, out_dtype=None):
    """LN(x) [* weight + bias] * (1 + scale) + shift, computed in fp32, returned in out_dtype (default x.dtype).

    x: [B, S, D] or [S, D]; scale/shift: [D], [B, 1, D] or [B, S, D] (any row stride, e.g. chunks of a
    [B, S, 6, D] tensor), fp32 or x's dtype. Gradients flow to every tensor argument."""
    global _warned
    out_dtype = out_dtype or x.dtype
    if x.shape[-1:] != scale.shape[-1:] or x.shape[-1:] != shift.shape[-1:]:
        raise UserError(f"ln_modulate: last dim of scale {tuple(scale.shape)} / shift {tuple(shift.shape)} "
                        f"must equal D of x {tuple(x.shape)}")
    backend = os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE", "auto")
    if backend not in ("auto", "cuda", "torch"):
        raise UserError(f"DS_ADAPTIVELOAD_LN_MODULATE={backend!r}: expected auto, cuda or torch")
    if backend != "torch" and x.is_cuda:
        plan = _plan(x, scale, shift, weight, bias, out_dtype)
        if isinstance(plan, tuple) and load_op() is not None:
            return LNModulateFunction.apply(x, scale, shift, weight, bias, eps, out_dtype, plan)
        reason = plan if isinstance(plan, str) else f"op unavailable ({op_error()})"
        if backend == "cuda":
            raise RuntimeError(f"ln_modulate: CUDA op requested but not usable: {reason}")
        if not _warned:
            warnings.warn(f"ln_modulate: using the PyTorch implementation: {reason}", stacklevel=2)
            _warned = True
    elif backend == "cuda":
        raise RuntimeError("ln_modulate: CUDA op requested for CPU tensors")
    return ln_modulate_reference(x, scale, shift, eps=eps, weight=weight, bias=bias, out_dtype=out_dtype)


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
