"""Gated residual fused with LayerNorm-Modulate: x_new = x + gate * y; out = LN(x_new) * (1 + scale) + shift.

In a Wan block the attention / FFN output y joins the residual stream as x + gate * y and the next LayerNorm-
Modulate reads the result at once; the fused op reads x, y and gate once and writes x_new and out once. Same layers
as ln_modulate: a torch.library custom op (CUDA kernels, a CPU kernel with the reference semantics, fake and
autograd), `ln_modulate_residual_reference` (PyTorch, differentiable), and a front function that picks one by the
DS_ADAPTIVELOAD_LN_MODULATE backend rule. Not used by the model yet.
"""
from __future__ import annotations

import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.ops import layernorm_modulate as lnm


def ln_modulate_residual_reference(x, y, gate, scale, shift, *, eps=1e-6):
    """(out, x_new): x_new = x + gate * y in fp32, rounded to x's dtype; out = ln_modulate_reference(x_new)."""
    x_new = (x.float() + gate.float() * y.float()).to(x.dtype)
    return lnm.ln_modulate_reference(x_new, scale, shift, eps=eps), x_new


def _resid_layouts(x, y, gate, scale, shift):
    """(B, S, D, gate, scale, shift layouts) for the kernels, or a string saying why they do not apply."""
    plan = lnm._plan(x, scale, shift, None, None, x.dtype)
    if isinstance(plan, str):
        return plan
    B, S, D, sc, sh = plan
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        return "y must be shaped, typed and placed like x"
    if gate.dtype != scale.dtype or not gate.is_cuda or gate.device != x.device:
        return "gate must be on x's device in scale's dtype"
    g = lnm._layout(gate, B, S, D, x.dim())
    if g is None:
        return "gate layout not one of [D], [B,1,D], [B,S,D]"
    return B, S, D, g, sc, sh


def _rows(t, B, S, D):
    return t.reshape(B * S, D).contiguous()


@torch.library.custom_op("ds_adaptiveload::ln_modulate_residual", mutates_args=(), device_types="cuda")
def resid_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, x_new, mean, rstd) of the fused op; the layouts (strides) are read from the tensors at run time."""
    B, S, D, (_, g_sb, g_ss, g), (_, sc_sb, sc_ss, sc), (_, sh_sb, sh_ss, sh) = _resid_layouts(x, y, gate, scale, shift)
    out, x_new, mean, rstd = lnm.load_op().resid_forward(
        _rows(x, B, S, D), _rows(y, B, S, D), g, sc, sh, B, S, g_sb, g_ss, sc_sb, sc_ss, sh_sb, sh_ss, float(eps), True)
    return out.view(x.shape), x_new.view(x.shape), mean, rstd


@torch.library.custom_op("ds_adaptiveload::ln_modulate_residual_backward", mutates_args=(), device_types="cuda")
def resid_backward_op(d_out: torch.Tensor, d_xnew: torch.Tensor, x_new: torch.Tensor, y: torch.Tensor,
                      gate: torch.Tensor, scale: torch.Tensor, shift_shape: list[int], shift_dtype: torch.dtype,
                      mean: torch.Tensor, rstd: torch.Tensor, eps: float, needs: list[bool]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dy, dgate, dscale, dshift), each shaped and typed like its input; empty where needs[i] is False."""
    B, S, D = lnm._dims(x_new)
    g_mode, g_sb, g_ss, g = lnm._layout(gate, B, S, D, x_new.dim())
    sc_mode, sc_sb, sc_ss, sc = lnm._layout(scale, B, S, D, x_new.dim())
    sh_mode = lnm._mode(shift_shape, B, S, D, x_new.dim())
    grads = lnm.load_op().resid_backward(
        _rows(d_out, B, S, D), _rows(d_xnew, B, S, D), _rows(x_new, B, S, D), _rows(y, B, S, D), g, sc, mean, rstd,
        B, S, g_sb, g_ss, g_mode, sc_sb, sc_ss, sc_mode if needs[3] else -1, sh_mode if needs[4] else -1, float(eps))
    return _shaped(grads, x_new, y, gate, scale, shift_shape, shift_dtype, needs)


def _grads_like(x_new, y, gate, scale, shift_shape, shift_dtype):
    return [(x_new.shape, x_new.dtype), (y.shape, y.dtype), (gate.shape, gate.dtype), (scale.shape, scale.dtype),
            (tuple(shift_shape), shift_dtype)]


def _shaped(grads, x_new, y, gate, scale, shift_shape, shift_dtype, needs):
    """The kernels' gradients ([rows, D], [B, D] or [D] by mode) in their inputs' shapes and dtypes; an empty
    tensor where not needed (the element counts agree: a mode is chosen by the input's shape)."""
    like = _grads_like(x_new, y, gate, scale, shift_shape, shift_dtype)
    return tuple(g.reshape(lk[0]).to(lk[1]) if n else x_new.new_empty(0) for g, lk, n in zip(grads, like, needs))


@resid_op.register_kernel("cpu")
def _resid_cpu(x, y, gate, scale, shift, eps):
    out, x_new = ln_modulate_residual_reference(x, y, gate, scale, shift, eps=eps)
    xf = x_new.float()
    mean = xf.mean(-1).reshape(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False).reshape(-1) + eps)
    return out, x_new, mean, rstd


@resid_backward_op.register_kernel("cpu")
def _resid_backward_cpu(d_out, d_xnew, x_new, y, gate, scale, shift_shape, shift_dtype, mean, rstd, eps, needs):
    """Closed form in fp32: the LN-Modulate part from ln_modulate's CPU backward (fed fp32 so dx is not rounded)."""
    ln = lnm._ln_modulate_backward_cpu(d_out.float(), x_new.float(), scale, shift_shape, shift_dtype, None, None,
                                       mean, rstd, eps, [True, needs[3], needs[4], False, False])
    dx = d_xnew.float() + ln[0]
    full = (dx, gate.float() * dx, y.float() * dx, ln[1], ln[2])
    like = _grads_like(x_new, y, gate, scale, shift_shape, shift_dtype)
    # copy=True: dshift is d_out itself where both are fp32 per-token, and a custom op's outputs may not alias.
    return tuple(f.sum_to_size(lk[0]).to(lk[1], copy=True) if n else x_new.new_empty(0)
                 for f, lk, n in zip(full, like, needs))


@resid_op.register_fake
def _resid_fake(x, y, gate, scale, shift, eps):
    rows = x.numel() // x.shape[-1]
    return (torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))


@resid_backward_op.register_fake
def _resid_backward_fake(d_out, d_xnew, x_new, y, gate, scale, shift_shape, shift_dtype, mean, rstd, eps, needs):
    like = _grads_like(x_new, y, gate, scale, shift_shape, shift_dtype)
    return tuple(x_new.new_empty(lk[0], dtype=lk[1]) if n else x_new.new_empty(0) for lk, n in zip(like, needs))


def _setup_context(ctx, inputs, output):
    x, y, gate, scale, shift, eps = inputs
    ctx.save_for_backward(output[1], y, gate, scale, output[2], output[3])
    ctx.shift, ctx.eps = (list(shift.shape), shift.dtype), eps


def _backward(ctx, d_out, d_xnew, _dmean, _drstd):
    needs = list(ctx.needs_input_grad[:5])
    x_new, y, gate, scale, mean, rstd = ctx.saved_tensors
    d_out = torch.zeros_like(x_new) if d_out is None else d_out
    d_xnew = torch.zeros_like(x_new) if d_xnew is None else d_xnew
    grads = resid_backward_op(d_out, d_xnew, x_new, y, gate, scale, *ctx.shift, mean, rstd, ctx.eps, needs)
    return tuple(g if n else None for g, n in zip(grads, needs)) + (None,)


resid_op.register_autograd(_backward, setup_context=_setup_context)


def ln_modulate_residual(x, y, gate, scale, shift, *, eps=1e-6):
    """(out, x_new): x_new = x + gate * y (fp32 math, x's dtype), out = LN(x_new) * (1 + scale) + shift in x's dtype.

    x, y: [B, S, D] or [S, D] of one dtype (fp32 / fp16 / bf16); gate, scale, shift: [D], [B, 1, D] or [B, S, D]
    (any row stride), one dtype, fp32 or x's. Gradients flow to every tensor. The CUDA op where it applies (the
    DS_ADAPTIVELOAD_LN_MODULATE rule of ln_modulate), else ln_modulate_residual_reference."""
    for name, t in (("gate", gate), ("scale", scale), ("shift", shift)):
        if t.shape[-1:] != x.shape[-1:]:
            raise UserError(f"ln_modulate_residual: last dim of {name} {tuple(t.shape)} must equal D of x {tuple(x.shape)}")
    if y.shape != x.shape:
        raise UserError(f"ln_modulate_residual: y {tuple(y.shape)} must be shaped like x {tuple(x.shape)}")
    if lnm.kernel_plan(x, scale, shift) is not None:
        why = _resid_layouts(x, y, gate, scale, shift)
        if not isinstance(why, str):
            return tuple(resid_op(x, y, gate, scale, shift, float(eps))[:2])
        if lnm._backend() == "cuda":
            raise RuntimeError(f"ln_modulate_residual: CUDA op requested but not usable: {why}")
    return ln_modulate_residual_reference(x, y, gate, scale, shift, eps=eps)
