"""adaptive_load.ema_decay: an exponential moving average of the weights, ema = d * ema + (1 - d) * w after every
applied update, kept in fp32.

Under ZeRO-3 each rank keeps the EMA of its own partitions only, taken from the optimizer's fp32 partition of each
parameter (no communication), and saves them as ema_rank{r}.pt in the checkpoint; `export --ema` joins the ranks'
files (model/export.read_ema). Under ZeRO-0/1/2 the weights are whole on every rank: the EMA follows the module's
weights (bf16 under bf16 training) and rank 0 saves it as ema_rank0.pt.

Only trainable parameters are averaged: with adaptive_load.lora the adapters (the frozen base never changes, and
under ZeRO-3 it has no fp32 partition to read), so `export --ema` with a lora-* format writes the adapters' EMA and
with --merge merges it into the base."""
import os

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.export import EMA_PREFIX


class EMA:
    def __init__(self, engine, decay: float, rank: int):
        self.engine, self.decay, self.rank = engine, decay, rank
        self.params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.zero3 = engine.zero_optimization_stage() == 3
        self.shadow = {n: self.source(p).detach().float().clone().view(-1) for n, p in self.params}

    def source(self, p):
        """This rank's current weights of p: the fp32 partition under ZeRO-3, else the module's weight."""
        if self.zero3:
            from deepspeed.utils import safe_get_local_fp32_param

            return safe_get_local_fp32_param(p)
        return p.data

    def update(self) -> None:
        import torch

        with torch.no_grad():
            for n, p in self.params:
                self.shadow[n].lerp_(self.source(p).detach().float().view(-1), 1.0 - self.decay)

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"{EMA_PREFIX}{self.rank}.pt")

    def save(self, folder: str) -> None:
        """This rank's file (ZeRO-3: every rank; else rank 0), inside the checkpoint before it is published."""
        import torch

        if not self.zero3 and self.rank != 0:
            return
        shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in self.params}
        torch.save({"decay": self.decay, "shapes": shapes, "ema": {n: t.cpu() for n, t in self.shadow.items()}},
                   self.path(folder))

    def load(self, folder: str) -> bool:
        """The EMA of a checkpoint (this rank's file, rank 0's without ZeRO-3); False where it holds none (the run
        that wrote it had no ema_decay): the EMA then starts from the loaded weights."""
        import torch

        path = os.path.join(folder, f"{EMA_PREFIX}{self.rank if self.zero3 else 0}.pt")
        if not os.path.isfile(path):
            return False
        doc = torch.load(path, map_location="cpu", weights_only=True)
        for n, t in self.shadow.items():
            saved = doc["ema"].get(n)
            if saved is None or saved.shape != t.shape:
                raise UserError(f"{path}: the EMA of {n} is {'missing' if saved is None else list(saved.shape)}, "
                                f"this run has {list(t.shape)} (another model or world size)")
            t.copy_(saved)
        return True
