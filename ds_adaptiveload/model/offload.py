"""Activation offload: the inputs a checkpointed block keeps from forward to backward, moved to pinned host memory.

A checkpointed block keeps only its inputs (torch.utils.checkpoint saves them through save_for_backward, which
saved-tensor hooks see) and recomputes the rest in backward. At 720p 81f on the 14B model that input is 75,600 x
5,120 bf16 values, 774 MB per block and 31 GB over 40 blocks: the largest part of what a fully checkpointed step
holds. BlockInputOffload's hooks copy each large saved tensor to pinned host memory on a side stream, so the copy
overlaps the next block's forward, and free the device copy once the copy is done (record_stream). Only the block
input itself moves: the text context and time vectors are saved by every block, so a host copy would free nothing.
Backward runs the
blocks in reverse order: fetching block i's input starts the copy back of block i - 1's, which then overlaps block
i's recompute and backward. The offloaded inputs' bytes leave the peak (schedule/offload.py: offload_blocks).

Device-agnostic: on the CPU (tests) the "host copy" is a plain copy and no stream is used, so the same code runs.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch



@dataclass
class _Packed:
    """One offloaded tensor: its host copy, the event that ends the copy, and its place in this forward's order."""
    host: torch.Tensor
    device: torch.device
    index: int
    copied: Optional[object] = None  # CUDA event: the host copy is complete
    fetched: Optional[torch.Tensor] = None  # the device copy brought back ahead of its use
    ready: Optional[object] = field(default=None, repr=False)  # CUDA event: `fetched` is complete


class BlockInputOffload:
    """Saved-tensor hooks (hooks(x)) that move a block's input x to host memory when it is saved, and bring it back in
    backward one block ahead. begin() starts a new forward (a micro-batch); stats() says what moved."""

    def __init__(self):
        self.entries = []
        self._target = None
        self.bytes_out = 0
        self._stream = None

    def begin(self) -> None:
        self.entries = []
        self.bytes_out = 0

    def hooks(self, x: torch.Tensor):
        """Hooks that offload x (the tensor itself, not other saved tensors) when it is saved."""
        self._target = (x.data_ptr(), x.shape, x.dtype)
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def stats(self) -> dict:
        return {"tensors": len(self.entries), "bytes": self.bytes_out}

    def _side(self, device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pack(self, t: torch.Tensor):
        if (t.data_ptr(), t.shape, t.dtype) != self._target:
            return t
        side = self._side(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=side is not None)
        entry = _Packed(host=host, device=t.device, index=len(self.entries))
        if side is None:
            host.copy_(t)
        else:
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is written
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                entry.copied = torch.cuda.Event()
                entry.copied.record(side)
            t.record_stream(side)  # its memory is not reused before the copy ends
        self.entries.append(entry)
        self.bytes_out += t.numel() * t.element_size()
        return entry

    def _fetch(self, entry: _Packed) -> None:
        """Start bringing `entry` back (on the side stream on CUDA)."""
        side = self._side(entry.device)
        if side is None:
            entry.fetched = entry.host.clone()
            return
        out = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)
        side.wait_stream(torch.cuda.current_stream(entry.device))  # `out`'s memory is free on the compute stream
        with torch.cuda.stream(side):
            side.wait_event(entry.copied)
            out.copy_(entry.host, non_blocking=True)
            entry.ready = torch.cuda.Event()
            entry.ready.record(side)
        entry.fetched = out

    def unpack(self, entry):
        if not isinstance(entry, _Packed):
            return entry
        if entry.fetched is None:
            self._fetch(entry)
        if entry.ready is not None:
            torch.cuda.current_stream(entry.device).wait_event(entry.ready)
        out, entry.fetched = entry.fetched, None
        if entry.index > 0 and self.entries[entry.index - 1].fetched is None:  # the block backward runs next
            self._fetch(self.entries[entry.index - 1])
        return out


def offload_context(offload: Optional[BlockInputOffload], on: bool, x: torch.Tensor):
    """offload.hooks(x) where `on`, else nothing: around a checkpointed block's call on x."""
    return offload.hooks(x) if on and offload is not None else contextlib.nullcontext()
