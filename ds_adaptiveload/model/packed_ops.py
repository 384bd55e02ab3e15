"""The per-group steps of a packed micro-batch over its whole [T, dim] token tensor: modulation and the gated
residual add write each group's result straight into its rows of one output; RoPE hands the attention its groups'
queries and keys and writes their gradients into the rows of dq and dk; the attention's output projection reads
the groups' outputs where they lie and writes each GEMM into its rows; the value projection (and cross-attention's
query projection) hands each run its rows and takes the runs' gradients where they lie.

Per group through Packing.map, each step would cost two [T, dim] copies that one-shape micro-batches do not
make: the merge of the groups' results in forward, and the cat of the split's per-group gradients in backward
(both run again in a checkpointed block's recompute). Here each autograd Function takes the whole tensors,
runs the group's kernel on its rows' views and writes into the rows of one preallocated output, in forward and
in backward. The gated add hands its gradient through to x unchanged (d out / d x is the identity). The same
copies sit at the attention's two ends: the per-group attention outputs were merged into [T, heads, head_dim] for
the output projection, and the per-group query and key gradients concatenated for their projections (on the H200
36 and 39 ms of a 16.4 s mixed pack: docs/history/benchmarks.md); _PackedRope and _PartsLinear remove them, and
_SplitLinear the cat of the value (and cross-attention query) gradients.

Used for micro-batches of two or more groups or runs (model/packing.Packing.runs) outside torch.compile tracing
(model/layout._several); one needs no merge, and a compiled whole block fuses the merges itself.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ds_adaptiveload.model.packing import merge, split_rows, split_samples
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


class _PackedRope(torch.autograd.Function):
    """RoPE of q and k [T, heads, head_dim] per group -> each run's rotated queries, then keys, each
    [n, local, heads, head_dim] (new tensors; a run of several groups gets each group's rotation written into its
    rows, so attention sees the run as one batch without a cat). RoPE is a rotation per channel pair, so its
    gradient is the rotation by minus the angle: backward runs fns.rope_grad_into per group, into the group's rows
    of dq and dk."""

    @staticmethod
    def forward(ctx, q, k, rope, dims, runs, fns):
        qv, kv = split_rows(q, dims), split_rows(k, dims)
        qs, ks = [], []
        for a, b in runs:
            if b - a == 1:
                x, y = fns.rope_qk(qv[a], kv[a], *rope[a])
            else:
                counts = [dims[i][0] for i in range(a, b)]
                x = q.new_empty((sum(counts), dims[a][1], *q.shape[1:]))
                y = k.new_empty((sum(counts), dims[a][1], *k.shape[1:]))
                for i, xo, yo in zip(range(a, b), x.split(counts), y.split(counts)):
                    fns.rope_qk_into(qv[i], kv[i], *rope[i], xo, yo)
            qs.append(x)
            ks.append(y)
        ctx.rope, ctx.dims, ctx.runs, ctx.fns = rope, dims, runs, fns
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (q, k)]
        return (*qs, *ks)

    @staticmethod
    def backward(ctx, *grads):
        n, dims = len(ctx.runs), ctx.dims
        out = []
        for (shape, dtype, device), gs, need in zip(ctx.meta, (grads[:n], grads[n:]), ctx.needs_input_grad[:2]):
            if not need:
                out.append(None)
                continue
            # each run's gradient split into its groups' rows (views); an unused output's gradient arrives as
            # zeros (materialize_grads)
            per_group = [p for (a, b), g in zip(ctx.runs, gs) for p in g.split([dims[i][0] for i in range(a, b)])]
            d = torch.empty(shape, dtype=dtype, device=device)
            for g, rows, (cos, sin) in zip(per_group, split_rows(d, dims), ctx.rope):
                ctx.fns.rope_grad_into(g, cos, sin, rows)
            out.append(d)
        return (*out, None, None, None, None)


class _PartsLinear(torch.autograd.Function):
    """linear over the rows of several parts [n_g, local, ..., in] (the groups' attention outputs) -> [T, out], each
    part's GEMM written into its rows of the output, where a merge would first copy the parts into one [T, in]
    tensor. Backward: each part's input gradient by its own GEMM; the weight gradient summed over the parts in
    fp32 (each part's GEMM rounded once, as one GEMM over all rows rounds once)."""

    @staticmethod
    def forward(ctx, weight, bias, *parts):
        flat = [p.reshape(-1, weight.shape[1]) for p in parts]
        rows = [f.shape[0] for f in flat]
        out = flat[0].new_empty(sum(rows), weight.shape[0])
        for f, o in zip(flat, out.split(rows)):
            if bias is None:
                torch.mm(f, weight.t(), out=o)
            else:
                torch.addmm(bias, f, weight.t(), out=o)
        ctx.save_for_backward(weight, *parts)
        ctx.rows, ctx.has_bias = rows, bias is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        weight, *parts = ctx.saved_tensors
        needs = ctx.needs_input_grad
        douts = dout.contiguous().split(ctx.rows)
        dw = _weight_grad(douts, [p.reshape(-1, weight.shape[1]) for p in parts], weight) if needs[0] else None
        db = dout.sum(0) if ctx.has_bias and needs[1] else None
        dparts = [(d @ weight).view(p.shape) if need else None for d, p, need in zip(douts, parts, needs[2:])]
        return (dw, db, *dparts)


def _weight_grad(douts, xs, weight):
    """sum over the parts of dout_i^T @ x_i ([rows_i, out] and [rows_i, in]) in fp32, rounded to weight's dtype:
    each part's GEMM rounds once, as one GEMM over all rows does."""
    acc = None
    for d, x in zip(douts, xs):
        part = (d.t() @ x).float()
        acc = part if acc is None else acc.add_(part)
    return acc.to(weight.dtype)


class _SplitLinear(torch.autograd.Function):
    """linear(x, weight, bias) over all rows of x [T, in] as one GEMM, handed back as the parts' rows [rows_i, out]
    (views of the one output). The attention's backward returns a new gradient tensor per run; autograd would cat
    them into one [T, out] gradient for the projection (a [T, out] copy per call). Here backward takes each part's
    gradient where it lies and writes its input-gradient GEMM into the part's rows of dx; the weight gradient as
    _PartsLinear's. A part whose output is unused gets a zero gradient from autograd (materialize_grads)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows):
        ctx.save_for_backward(x, weight)
        ctx.rows, ctx.has_bias = rows, bias is not None
        return F.linear(x, weight, bias).split(rows)

    @staticmethod
    def backward(ctx, *douts):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        douts = [d.reshape(-1, weight.shape[0]) for d in douts]
        dx = dw = db = None
        if needs[0]:
            dx = torch.empty_like(x)
            for d, rows in zip(douts, dx.split(ctx.rows)):
                torch.mm(d, weight, out=rows)
        if needs[1]:
            dw = _weight_grad(douts, x.split(ctx.rows), weight)
        if ctx.has_bias and needs[2]:
            db = torch.stack([d.sum(0, dtype=torch.float32) for d in douts]).sum(0).to(weight.dtype)
        return dx, dw, db, None


def packed_rope(q, k, rope, dims, fns, runs=None):
    """_PackedRope: q, k [T, heads, head_dim] rows of the groups `dims`; rope: (cos, sin) per group; fns: BlockFns;
    runs: [start, stop) group ranges (Packing.runs; None: one run per group). Returns (per-run rotated queries,
    per-run rotated keys)."""
    runs = tuple((i, i + 1) for i in range(len(dims))) if runs is None else tuple(runs)
    out = _PackedRope.apply(q, k, tuple(rope), tuple(dims), runs, fns)
    return out[:len(runs)], out[len(runs):]


def split_linear(x, weight, bias, rows):
    """_SplitLinear: linear(x, weight, bias) for x [T, in], as the parts' rows [rows_i, out] (rows sums to T)."""
    return _SplitLinear.apply(x, weight, bias, tuple(rows))


def parts_linear(parts, weight, bias):
    """_PartsLinear: linear(concatenated rows of `parts`, weight, bias) without concatenating them."""
    return _PartsLinear.apply(weight, bias, *parts)


class RowsLinear(nn.Linear):
    """nn.Linear that also takes a list of parts [n_g, local, ..., in_features] (a packed micro-batch's per-group
    attention outputs) as the rows of one input, in order, and writes each part's GEMM into its rows of the one
    output (_PartsLinear), without merging the parts first. One module call and one output tensor either way, as
    ZeRO-3's hooks need (model/wan.PatchEmbed). Under autocast the parts are merged and F.linear runs."""

    def forward(self, x):
        if not isinstance(x, (list, tuple)):
            return F.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled(x[0].device.type):
            return F.linear(merge(x).flatten(1), self.weight, self.bias)
        return parts_linear(x, self.weight, self.bias)


def packed_modulate(x, scale, shift, dims, eps):
    """_PackedModulate: x [T, D] rows of the groups `dims` ((n_g, local_g) each), scale/shift [n, 1, D]."""
    return _PackedModulate.apply(x, scale, shift, tuple(dims), eps)


def packed_gated_add(x, y, gate, dims, fns):
    """_PackedGatedAdd: x, y [T, D] rows of the groups `dims`, gate [n, 1, D]; fns: BlockFns."""
    return _PackedGatedAdd.apply(x, y, gate, tuple(dims), fns)
