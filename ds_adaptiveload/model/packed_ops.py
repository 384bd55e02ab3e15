"""The per-sample elementwise steps of a packed micro-batch (modulation, gated residual add) over its whole
[T, dim] token tensor, each group's result written straight into its rows of one output.

Per group through Packing.map, each step would cost two [T, dim] copies that one-shape micro-batches do not
make: the merge of the groups' results in forward, and the cat of the split's per-group gradients in backward
(both run again in a checkpointed block's recompute). Here each autograd Function takes the whole tensors,
runs the group's kernel on its rows' views and writes into the rows of one preallocated output, in forward and
in backward. The gated add hands its gradient through to x unchanged (d out / d x is the identity).

Used for micro-batches of two or more groups outside torch.compile tracing (model/wan.Layout); one group
needs no merge, and a compiled whole block fuses the merges itself.
"""
import torch

from ds_adaptiveload.model.packing import split_rows, split_samples
from ds_adaptiveload.ops.layernorm_modulate import _bwd_impl, _fwd_impl, kernel_plan, ln_modulate_reference


class _PackedModulate(torch.autograd.Function):
    """LN(x) * (1 + scale) + shift per sample over all groups: x [T, D], scale/shift [n, 1, D] -> [T, D]. Each
    group runs the fused kernel writing into its rows of the output (and of dx in backward); where the kernel
    does not apply (CPU, DS_ADAPTIVELOAD_LN_MODULATE=torch) the group runs the PyTorch reference, whose backward
    recomputes it under autograd."""

    @staticmethod
    def forward(ctx, x, scale, shift, dims, eps):
        out = torch.empty_like(x)
        stats = []
        groups = zip(split_rows(x, dims), split_samples(scale, dims), split_samples(shift, dims), split_rows(out, dims))
        for xg, sg, hg, og in groups:
            plan = kernel_plan(xg, sg, hg)
            if plan is None:
                og.copy_(ln_modulate_reference(xg, sg, hg, eps=eps))
                stats += [x.new_empty(0, dtype=torch.float32)] * 2
            else:
                stats += _fwd_impl(xg, sg, hg, None, None, eps, xg.dtype, True, plan, into=og)[1:]
        ctx.save_for_backward(x, scale, shift, *stats)
        ctx.dims, ctx.eps = dims, eps
        return out

    @staticmethod
    def backward(ctx, dout):
        x, scale, shift, *stats = ctx.saved_tensors
        dims, needs = ctx.dims, ctx.needs_input_grad[:3]
        dx = torch.empty_like(x)
        dsc, dsh = [], []
        groups = zip(split_rows(x, dims), split_samples(scale, dims), split_samples(shift, dims),
                     split_rows(dout.contiguous(), dims), split_rows(dx, dims), stats[0::2], stats[1::2])
        for xg, sg, hg, dg, dxg, mean, rstd in groups:
            if mean.numel():
                _, a, b, _, _ = _bwd_impl(dg, xg, sg, hg.shape, hg.dtype, None, None, mean, rstd, ctx.eps,
                                          [True, needs[1], needs[2], False, False], dx_into=dxg)
            else:
                a, b = _reference_grads(dg, xg, sg, hg, ctx.eps, dxg)
            dsc.append(a)
            dsh.append(b)
        return (dx if needs[0] else None, torch.cat(dsc) if needs[1] else None, torch.cat(dsh) if needs[2] else None,
                None, None)


def _reference_grads(dy, x, scale, shift, eps, dx_into):
    """The PyTorch path's gradients of one group: dx written into dx_into, (dscale, dshift) returned."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
        y = ln_modulate_reference(*leaves, eps=eps)
        dx, dsc, dsh = torch.autograd.grad(y, leaves, dy)
    dx_into.copy_(dx)
    return dsc, dsh


class _PackedGatedAdd(torch.autograd.Function):
    """x + y * gate per sample in fp32, rounded to x's dtype: x, y [T, D], gate [n, 1, D] -> [T, D]. fns: the
    model's BlockFns, whose gated_add_into, gated_dy_into and gate_grad run per group (compiled under
    compile_regions)."""

    @staticmethod
    def forward(ctx, x, y, gate, dims, fns):
        out = torch.empty_like(x)
        for xg, yg, gg, og in zip(split_rows(x, dims), split_rows(y, dims), split_samples(gate, dims),
                                  split_rows(out, dims)):
            fns.gated_add_into(xg, yg, gg, og)
        ctx.save_for_backward(y, gate)
        ctx.dims, ctx.fns = dims, fns
        return out

    @staticmethod
    def backward(ctx, dout):
        y, gate = ctx.saved_tensors
        dims = ctx.dims
        dout = dout.contiguous()
        dy = torch.empty_like(y)
        groups = zip(split_rows(dout, dims), split_rows(y, dims), split_samples(gate, dims), split_rows(dy, dims))
        dgate = []
        for dg, yg, gg, dyg in groups:
            ctx.fns.gated_dy_into(dg, gg, dyg)
            dgate.append(ctx.fns.gate_grad(dg, yg))
        return dout, dy, torch.cat(dgate), None, None


def packed_modulate(x, scale, shift, dims, eps):
    """_PackedModulate: x [T, D] rows of the groups `dims` ((n_g, local_g) each), scale/shift [n, 1, D]."""
    return _PackedModulate.apply(x, scale, shift, tuple(dims), eps)


def packed_gated_add(x, y, gate, dims, fns):
    """_PackedGatedAdd: x, y [T, D] rows of the groups `dims`, gate [n, 1, D]; fns: BlockFns."""
    return _PackedGatedAdd.apply(x, y, gate, tuple(dims), fns)
