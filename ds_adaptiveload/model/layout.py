"""How the blocks see one forward's samples (model/packing.py): the Layout, and the per-group and per-run steps that
run on it. RoPE needs each group's grid; modulation, the gated residual adds and attention run once per run of
equal-token groups. Over two or more parts outside a compiled trace they go through model/packed_ops.py, which
writes each part into its rows of one tensor; the elementwise steps (BlockFns) are eager or compiled one by one
(model/compile.compile_regions).
"""
from dataclasses import dataclass
from typing import Callable

import torch

from ds_adaptiveload.model.packed_ops import packed_gated_add, packed_modulate, packed_rope, split_linear
from ds_adaptiveload.model.packing import Packing, each_rows, merge, split_rows
from ds_adaptiveload.ops import ln_modulate

# (q, k, v) -> out, all [B, S, heads, head_dim]; may take keyword valid_len (see model/wan.sdpa_attention).
AttentionFn = Callable[..., torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of x [B, S, H, D] in fp32; returns x's dtype."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """RoPE of one shape group's queries and keys [n_g, S_g, heads, head_dim]."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def rope_qk_into(q, k, cos, sin, q_out, k_out) -> None:
    """rope_qk of one group written into its rows of its run's rotated queries and keys (model/packed_ops.py)."""
    q_out.copy_(apply_rope(q, cos, sin))
    k_out.copy_(apply_rope(k, cos, sin))


def rope_grad_into(dy, cos, sin, out) -> None:
    """RoPE's input gradient for one group (the rotation by minus the angle, in fp32), written into `out` (the
    group's rows of dq or dk: model/packed_ops._PackedRope)."""
    out.copy_(apply_rope(dy, cos, -sin))


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Residual add with a per-sample gate, in fp32, rounded to x's dtype (one group: [n_g, S_g, dim] rows,
    gate [n_g, 1, dim])."""
    return (x.float() + y.float() * gate).to(x.dtype)


def gated_add_into(x, y, gate, out) -> None:
    """gated_add written into `out` (one group's rows of a packed output: model/packed_ops.py)."""
    out.copy_((x.float() + y.float() * gate).to(out.dtype))


def gated_dy_into(dout, gate, dy) -> None:
    """gated_add's y-gradient for one group, dout * gate, written into `dy` (x's gradient is dout itself)."""
    dy.copy_((dout.float() * gate).to(dy.dtype))


def gate_grad(dout, y) -> torch.Tensor:
    """gated_add's gate gradient for one group: the sum over tokens of dout * y, [n_g, 1, dim] fp32. A graph of
    its own under compile_regions, so that inductor plans the reduction apart from gated_dy_into's store."""
    return (dout.float() * y.float()).sum(1, keepdim=True)


@dataclass(frozen=True)
class BlockFns:
    """The per-group elementwise steps of a block, which run once per shape group: eager by default, compiled
    one by one by model/compile.compile_regions (then the graphs do not depend on how many groups a
    micro-batch holds)."""
    rope_qk: Callable = rope_qk
    rope_qk_into: Callable = rope_qk_into
    rope_grad_into: Callable = rope_grad_into
    gated_add: Callable = gated_add
    gated_add_into: Callable = gated_add_into
    gated_dy_into: Callable = gated_dy_into
    gate_grad: Callable = gate_grad


@dataclass(frozen=True)
class Layout:
    """What the blocks need about one forward's samples: their packing, each group's RoPE table, each run's
    self-attention keywords (valid_len under SP padding), and the self-attention core. RoPE runs per group (it
    needs the grid); everything else per run of equal-token groups (Packing.runs)."""
    packing: Packing
    rope: tuple
    """(cos, sin) per group, for the group's local token positions."""
    attn_kwargs: tuple
    """Keyword arguments of the self-attention core per run."""
    attn_fn: AttentionFn
    sizes: tuple = None
    """Packing.size_tensors(): the group sizes as tensor shapes. The blocks read sizes only from these (and the
    RoPE tables), never from the packing's ints, so a compiled block is not specialised on them."""
    fns: BlockFns = BlockFns()
    """The per-group elementwise steps (WanModel.set_block_fns)."""
    runs: tuple = None
    """Packing.runs, filled in here at construction (outside the blocks): a compiled block reading it from the
    packing would guard on the grids and compile a graph per micro-batch composition."""

    def __post_init__(self):
        if self.runs is None:
            object.__setattr__(self, "runs", self.packing.runs)

    @property
    def dims(self) -> list:
        """(n, local) per run."""
        return self.packing.run_dims(self.sizes, self.runs)

    def each(self, fn, rows, samples=()):
        """fn per run on its views of `rows` and its rows of the per-sample `samples`, the results as a list."""
        return each_rows(fn, self.dims, rows, samples)

    def project(self, linear, x, heads, norm=None):
        """Each run's [n, local, heads, head_dim] rows of norm(linear(x)), x [T, in]. Over several runs the
        projection hands back each run's rows (packed_ops.split_linear) and norm runs per run, so the runs'
        gradients, one new tensor each from the attention's backward, need no cat into one [T, out] tensor.
        Only for a plain nn.Linear without hooks (under ZeRO-3 each module call gathers its parameters and
        returns one tensor) and outside autocast."""
        dims, norm = self.dims, norm or _same
        if not (_several(len(dims)) and _plain(linear, x)):
            return split_rows(norm(linear(x)).unflatten(-1, heads), dims)
        parts = split_linear(x, linear.weight, linear.bias, [n * local for n, local in dims])
        return [norm(p).view(n, local, *heads) for p, (n, local) in zip(parts, dims)]

    def rope_qk(self, q, k):
        """RoPE of q and k [T, heads, head_dim] -> per run the rotated [n, local, heads, head_dim] queries, and
        keys; over whole tensors (packed_ops._PackedRope) when the micro-batch holds several groups, so that their
        gradients are written into the rows of dq and dk instead of concatenated."""
        if _several(len(self.packing.groups)):
            return packed_rope(q, k, self.rope, self.packing.dims(self.sizes), self.fns, self.runs)
        return self.rope_per_group(q, k)

    def rope_per_group(self, q, k):
        """rope_qk on each group's views of q and k, concatenated per run (autograd concatenates the gradients)."""
        gdims = self.packing.dims(self.sizes)
        pairs = [self.fns.rope_qk(qg, kg, cos, sin) for qg, kg, (cos, sin) in zip(split_rows(q, gdims),
                                                                                    split_rows(k, gdims), self.rope)]
        qs = [_cat([p[0] for p in pairs[a:b]]) for a, b in self.runs]
        return qs, [_cat([p[1] for p in pairs[a:b]]) for a, b in self.runs]

    def rows(self, parts):
        """Per-run attention outputs [n, local, heads, head_dim] as the input of RowsLinear: the list itself
        over several runs (the projection writes each into its rows), else merged into [T, dim]."""
        return list(parts) if _several(len(parts)) else merge(parts).flatten(1)

    def modulate(self, x, scale, shift, eps):
        """LN(x) * (1 + scale) + shift per sample: x [T, dim], scale/shift [n, 1, dim] fp32."""
        return modulate_rows(x, scale, shift, eps, self.dims)

    def gated_add(self, x, y, gate):
        """x + y * gate per sample: x, y [T, dim], gate [n, 1, dim] fp32."""
        dims = self.dims
        if _several(len(dims)):
            return packed_gated_add(x, y, gate, dims, self.fns)
        return merge(each_rows(self.fns.gated_add, dims, (x, y), (gate,)))


def _several(n: int) -> bool:
    """Run a per-group or per-run step over whole [T, dim] tensors (model/packed_ops.py): two or more parts, and
    not inside a compiled block's trace (inductor fuses the merges there)."""
    return n > 1 and not torch.compiler.is_compiling()


def _plain(linear, x) -> bool:
    return (type(linear) is torch.nn.Linear and not (linear._forward_hooks or linear._forward_pre_hooks)
            and not torch.is_autocast_enabled(x.device.type))


def _same(x):
    return x


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def modulate_rows(x, scale, shift, eps, dims):
    """ln_modulate per sample of a packed x [T, dim] with scale/shift [n, 1, dim], for runs `dims`."""
    if _several(len(dims)):
        return packed_modulate(x, scale, shift, dims, eps)
    return merge(each_rows(lambda xg, sc, sh: ln_modulate(xg, sc, sh, eps=eps), dims, (x,), (scale, shift)))
