"""Packed micro-batches: how the samples of one forward, of any mix of latent shapes, lie in one token tensor.

The tokens of all samples form one [T, dim] tensor, so every linear layer is one GEMM. Samples are grouped
by patch grid (stable within a group); a group's n_g samples of `local` tokens each are contiguous rows, so its
slice views as [n_g, local, dim] without a copy. RoPE, patch embedding and unpatchify need the grid and run once
per group. Attention, modulation and gating only need equal row counts, so they run once per *run*: adjacent
groups whose samples have the same token count (480x832 and 832x480 images both have 1,560), which the grouping
places next to each other (docs/model.md). Per-sample tensors (timestep, modulation vectors, text context) are
kept in the same packed order, so a group's or run's rows of them are one slice.
"""
from dataclasses import dataclass
from math import prod
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Group:
    """The samples of one patch grid."""
    grid: tuple[int, int, int]
    """Patch grid (f, h, w) of every sample in the group."""
    index: tuple[int, ...]
    """Input positions of the samples, in packed order."""
    first: int
    """Packed position of the group's first sample (its row in per-sample tensors)."""
    local: int
    """Token rows per sample held here: all S tokens, or ceil(S / world) under sequence parallelism."""
    offset: int
    """First row of the group in the [T, dim] token tensor."""

    @property
    def n(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        """Tokens S of one whole sample."""
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def rows(self) -> int:
        return self.n * self.local


@dataclass(frozen=True)
class Packing:
    groups: tuple[Group, ...]
    order: tuple[int, ...]
    """Packed position -> input position."""

    @property
    def n(self) -> int:
        return len(self.order)

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    @property
    def is_identity(self) -> bool:
        return self.order == tuple(range(self.n))

    def views(self, h: torch.Tensor, sizes=None) -> list[torch.Tensor]:
        """Each group's rows of a [T, ...] tensor as [n_g, local, ...] views. One split, not a slice per
        group: the backward of a split is one cat, where each slice would add a zero-filled [T, ...] tensor.
        sizes: size_tensors() — the group sizes read from tensor shapes instead of this object's ints, so
        torch.compile keeps them symbolic rather than compiling a graph per micro-batch composition."""
        return split_rows(h, self.dims(sizes))

    def dims(self, sizes=None) -> list:
        """(n_g, local) per group: from the size tensors' shapes when given (symbolic under compile), else ints."""
        if sizes is not None:
            return [(s.shape[0], s.shape[1]) for s in sizes]
        return [(g.n, g.local) for g in self.groups]

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) group ranges of adjacent groups whose samples have the same token count, hence the same
        local rows and SP padding: their rows view as one [n, local, ...] batch."""
        out, start = [], 0
        for i in range(1, len(self.groups) + 1):
            if i == len(self.groups) or self.groups[i].tokens != self.groups[start].tokens:
                out.append((start, i))
                start = i
        return tuple(out)

    def run_dims(self, sizes=None, runs=None) -> list:
        """(n, local) per run (runs: as self.runs, given where a compiled block must not read the grids):
        its groups' sample counts summed, symbolic under compile when sizes are given."""
        dims = self.dims(sizes)
        return [(sum(dims[i][0] for i in range(a, b)), dims[a][1]) for a, b in (self.runs if runs is None else runs)]

    def size_tensors(self, device) -> tuple[torch.Tensor, ...]:
        """Per group an empty tensor [n_g, local, 0] that carries the group's sizes in its shape (views)."""
        return tuple(torch.empty(g.n, g.local, 0, device=device) for g in self.groups)

    def to_packed(self, v: torch.Tensor) -> torch.Tensor:
        """A per-sample tensor [n, ...] from input order into packed order."""
        return v if self.is_identity else v[torch.tensor(self.order, device=v.device)]

    def to_input(self, per_group: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-group results [n_g, ...] -> list of per-sample results in input order."""
        out = [None] * self.n
        for g, y in zip(self.groups, per_group):
            for j, i in enumerate(g.index):
                out[i] = y[j]
        return out


def split_rows(h: torch.Tensor, dims: Sequence[tuple]) -> list[torch.Tensor]:
    """Each group's rows of a [T, ...] tensor as [n_g, local, ...] views, for groups `dims` ((n_g, local) each)."""
    if len(dims) == 1:  # S from the tensor: compiled blocks then stay dynamic in S
        return [h.unflatten(0, (dims[0][0], -1))]
    parts = h.split([n * local for n, local in dims])
    return [p.unflatten(0, d) for d, p in zip(dims, parts)]


def split_samples(v: torch.Tensor, dims: Sequence[tuple]) -> list[torch.Tensor]:
    """Each group's rows [n_g, ...] of a per-sample tensor [n, ...] in packed order, for groups `dims`."""
    counts = [n for n, _ in dims]
    return list(v.split(counts)) if len(counts) > 1 else [v]


class _Merge(torch.autograd.Function):
    """Concatenate per-group [n_g, local, ...] parts along their flattened rows with one copy per part, also for
    a strided part (SDPA's output is [n, heads, S, d] underneath), where flatten + cat would copy it twice,
    and cast to `dtype` in that copy. Backward hands each part its rows of the gradient, as cat's does."""

    @staticmethod
    def forward(ctx, dtype, *parts):
        ctx.shapes, ctx.dtypes = [p.shape for p in parts], [p.dtype for p in parts]
        rows = [p.shape[0] * p.shape[1] for p in parts]
        out = parts[0].new_empty((sum(rows), *parts[0].shape[2:]), dtype=dtype or parts[0].dtype)
        for dst, p in zip(out.split(rows), parts):
            dst.view(p.shape).copy_(p)
        return out

    @staticmethod
    def backward(ctx, g):
        rows = [s[0] * s[1] for s in ctx.shapes]
        return (None, *(x.reshape(s).to(dt) for x, s, dt in zip(g.split(rows), ctx.shapes, ctx.dtypes)))


def each_rows(fn: Callable, dims: Sequence[tuple], rows: Sequence[torch.Tensor], samples: Sequence[torch.Tensor] = ()):
    """fn(*views of `rows` [n, local, ...], *rows of the per-sample `samples` [n, ...]) for each of `dims`' groups or
    runs ((n, local) each), the results as a list. An entry of `rows` may be a list of the parts already."""
    cols = [r if isinstance(r, list) else split_rows(r, dims) for r in rows] + [split_samples(s, dims) for s in samples]
    return [fn(*args) for args in zip(*cols)]


def merge(parts: Sequence[torch.Tensor], dtype=None) -> torch.Tensor:
    """Per-group [n_g, local, ...] results -> one [T, ...] tensor (a view for a single contiguous group),
    cast to dtype if given."""
    if len(parts) == 1:
        return parts[0].flatten(0, 1).to(dtype or parts[0].dtype)
    return _Merge.apply(dtype, *parts)


def plan_packing(grids: Sequence[tuple[int, int, int]], world: int = 1) -> Packing:
    """Group samples by patch grid, stable within a group. Groups are ordered by the first appearance of their
    token count, then of their grid, so groups of equal token count are adjacent and form one run; samples that
    arrive in that order (one group, or equal-token groups contiguous) keep the identity order. world > 1: each
    sample's tokens are padded to a multiple of `world` and one rank holds ceil(S / world) of them."""
    members: dict[tuple, list[int]] = {}
    for i, grid in enumerate(grids):
        members.setdefault(tuple(grid), []).append(i)
    rank: dict[int, int] = {}
    for grid in members:
        rank.setdefault(prod(grid), len(rank))
    groups, first, offset = [], 0, 0
    for grid, index in sorted(members.items(), key=lambda kv: rank[prod(kv[0])]):  # stable: grid order kept
        local = -(-prod(grid) // world)
        g = Group(grid, tuple(index), first, local, offset)
        groups.append(g)
        first, offset = first + g.n, offset + g.rows
    return Packing(tuple(groups), tuple(i for g in groups for i in g.index))
