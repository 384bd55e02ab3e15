"""Packed micro-batches: how the samples of one forward, of any mix of latent shapes, lie in one token tensor.

The tokens of all samples form one [T, dim] tensor, so every linear layer is one GEMM. Samples are grouped
by patch grid in order of first appearance (stable within a group); a group's n_g samples of `local` tokens
each are contiguous rows, so its slice views as [n_g, local, dim] without a copy and attention, modulation,
RoPE, patch embedding and unpatchify run once per group as dense batched calls (docs/model.md). Per-sample
tensors (timestep, modulation vectors, text context) are kept in the same packed order, so a group's rows
of them are the slice [first, first + n_g).
"""
from dataclasses import dataclass
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

    def view(self, h: torch.Tensor) -> torch.Tensor:
        """This group's rows of a [T, ...] tensor as [n_g, local, ...] (a view)."""
        return h[self.offset:self.offset + self.rows].unflatten(0, (self.n, self.local))

    def samples(self, v: torch.Tensor) -> torch.Tensor:
        """This group's rows of a per-sample tensor [n, ...] in packed order."""
        return v[self.first:self.first + self.n]


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

    def map(self, fn: Callable, rows: Sequence[torch.Tensor], samples: Sequence[torch.Tensor] = ()):
        """fn(*group views of `rows`, *group slices of `samples`) per group, results merged into [T, ...]."""
        return merge([fn(*(g.view(r) for r in rows), *(g.samples(s) for s in samples)) for g in self.groups])

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


def merge(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-group [n_g, local, ...] results -> one [T, ...] tensor (a view for a single group)."""
    flat = [p.flatten(0, 1) for p in parts]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def plan_packing(grids: Sequence[tuple[int, int, int]], world: int = 1) -> Packing:
    """Group samples by patch grid (first-appearance order, stable within a group). world > 1: each sample's
    tokens are padded to a multiple of `world` and one rank holds ceil(S / world) of them."""
    members: dict[tuple, list[int]] = {}
    for i, grid in enumerate(grids):
        members.setdefault(tuple(grid), []).append(i)
    groups, first, offset = [], 0, 0
    for grid, index in members.items():
        local = -(-(grid[0] * grid[1] * grid[2]) // world)
        g = Group(grid, tuple(index), first, local, offset)
        groups.append(g)
        first, offset = first + g.n, offset + g.rows
    return Packing(tuple(groups), tuple(i for g in groups for i in g.index))
