"""The MFU levers applied to a WanModel from outside, for bench/mfu.py and bench/mfu_train.py, until the
coordinator wires them into model/wan.py and the trainer: checkpoint only the first k blocks (k per
micro-batch from schedule/memory.py) and regional compile of the blocks (model/compile.py).

The blocks' `forward` instance attributes carry both: eager or compiled WanBlock.forward, wrapped in
torch.utils.checkpoint for blocks below k. The model's own checkpoint_blocks must be off (else every block
is checkpointed twice over)."""
import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.wan import WanBlock, WanModel
from ds_adaptiveload.schedule.memory import blocks_to_checkpoint, selective_checkpoint


def _checkpointed(fn):
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(self, *args, **kwargs)
        return checkpoint(fn, self, *args, use_reentrant=False, **kwargs)
    return forward


def _selective(fn):
    """Policy "attention": WanBlock.forward's own selective checkpoint (inside the compiled region)."""
    def forward(self, x, e0, context, lay, *_, **__):  # the model's own save_attention flag is replaced
        return fn(self, x, e0, context, lay, save_attention=True)
    return forward


class Levers:
    """levers = Levers(model); levers.set(k=12, compiled=True) before a forward."""

    def __init__(self, model: torch.nn.Module, compile_kw=None):
        wan = [m for m in model.modules() if isinstance(m, WanModel)]
        if len(wan) != 1:
            raise UserError(f"Levers: expected one WanModel inside the model, found {len(wan)}")
        self.model = wan[0]
        self.model.checkpoint_blocks = False
        self.blocks = [b for b in self.model.blocks if isinstance(b, WanBlock)]
        self.compile_kw = dict(compile_kw or {})
        self._compiled = None
        self.state = (None, None, None, None)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def set(self, k: int, compiled: bool = False, policy: str = "full", k_full: int = 0) -> None:
        """Checkpoint blocks 0..k-1 (k = num_layers: all, 0: none); compiled: True the blocks compiled whole,
        "regions" their elementwise steps (model/compile.py), False eager; policy:
        "full" recomputes checkpointed blocks whole, "attention" keeps their attention outputs except in the
        first k_full blocks (schedule/memory.selective_checkpoint)."""
        if not 0 <= k <= self.num_layers:
            raise UserError(f"Levers.set: k must be in 0..{self.num_layers}, got {k}")
        if policy not in ("full", "attention"):
            raise UserError(f"Levers.set: policy must be full or attention, got {policy!r}")
        k_full = k if policy == "full" else min(k_full, k)
        if self.state == (k, compiled, policy, k_full):
            return
        from ds_adaptiveload.model.compile import bind_regions, block_forward, region_fns

        if compiled is True and self._compiled is None:
            self._compiled = block_forward(**self.compile_kw)
        fn = self._compiled if compiled is True else WanBlock.forward
        bind_regions(self.model, region_fns(**self.compile_kw) if compiled == "regions" else None)  # None: eager
        for i, b in enumerate(self.blocks):
            b.forward = types.MethodType(_checkpointed(fn) if i < k_full else _selective(fn) if i < k else fn, b)
        self.state = (k, compiled, policy, k_full)


def micro_batch_tokens(x, patch_size) -> tuple:
    """(samples, tokens) of a model input: a latent [B, C, F, H, W] or a list of [C, F, H, W] (packed)."""
    p = math.prod(patch_size)
    if isinstance(x, torch.Tensor) and x.ndim == 5:
        return x.shape[0], x.shape[0] * math.prod(x.shape[2:]) // p
    if isinstance(x, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in x):
        return len(x), sum(math.prod(t.shape[1:]) // p for t in x)
    raise UserError(f"micro_batch_tokens: expected a [B, C, F, H, W] tensor or a list of [C, F, H, W], got {type(x)}")


def choose_k(x, memory: dict, levers: Levers, mode, policy="full"):
    """k for this micro-batch: mode 'auto' (blocks_to_checkpoint), 'all', 'none' or an int; with policy
    'attention' and mode 'auto' the pair (k, k_full) of schedule/memory.selective_checkpoint."""
    if mode == "auto":
        samples, tokens = micro_batch_tokens(x, levers.model.cfg.patch_size)
        if policy == "attention":
            return selective_checkpoint(int(tokens), int(samples), memory, levers.num_layers)
        return blocks_to_checkpoint(int(tokens), int(samples), memory, levers.num_layers)
    if mode == "all":
        return levers.num_layers
    if mode == "none":
        return 0
    return min(int(mode), levers.num_layers)
