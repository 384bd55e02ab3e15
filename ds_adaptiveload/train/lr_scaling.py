"""Learning rate scaled by each step's batch size, with DeepSpeed's dynamic-batching semantics.

DeepSpeed's `data_efficiency.data_sampling.dynamic_batching.lr_scaling_method` (runtime/data_pipeline/
data_sampling/variable_batch_size_and_lr.py: scale_lr, VariableBatchSizeLR) sets the LR of a step whose
batch holds n samples (over all data-parallel ranks) to lr * n / ref (linear), lr * sqrt(n / ref) (sqrt)
or lr (none), where lr is what the wrapped schedule gives for that step and ref the batch size the LR was
tuned for (DeepSpeed: train_batch_size). The schedule itself advances as without scaling. Here n is known
from the plan when a step is handed out, so the scale is applied then instead of from a precomputed list.
Torch-free: it only reads and writes the optimizer's param_groups.
"""
import math

from ds_adaptiveload.errors import UserError

METHODS = ("none", "linear", "sqrt")


def scale_lr(lr: float, batch_size: int, reference: int, method: str) -> float:
    """lr for a batch of `batch_size` samples, when `lr` refers to `reference` samples."""
    if method == "linear":
        return lr * batch_size / reference  # Goyal et al.: k times the batch, k times the LR
    if method == "sqrt":
        return lr * math.sqrt(batch_size / reference)  # Krizhevsky: keeps the gradient variance
    if method == "none":
        return lr
    raise UserError(f"adaptive_load.lr_scaling_method must be one of {', '.join(METHODS)}, got {method!r}")


class BatchSizeLR:
    """An LR scheduler that wraps another (or a constant LR) and scales its rate by the batch size of the
    step about to be taken. Install it as `engine.lr_scheduler`: DeepSpeed then calls `step()` after every
    applied update and stores `state_dict()` in its checkpoints.

    Order per optimizer step: `set_batch_size(n)` (the loader calls it when it hands out the step) sets the
    scaled LR that the update uses; `step()` restores the unscaled LR, steps the wrapped schedule (so
    schedules that read the current LR, such as torch's chainable ones, see their own values) and keeps
    its new rate unscaled until the next step's size is known. A step DeepSpeed skips (overflow) calls no
    `step()`; the next `set_batch_size` scales from the same unscaled rate."""

    def __init__(self, optimizer, base=None, method="none", reference=1):
        if method not in METHODS:
            scale_lr(1.0, 1, 1, method)  # raises the UserError naming the key
        if not isinstance(reference, int) or isinstance(reference, bool) or reference < 1:
            raise UserError(f"adaptive_load.lr_reference_batch_size must be a positive integer, got {reference!r}")
        self.optimizer = getattr(base, "optimizer", None) or optimizer
        self.base, self.method, self.reference = base, method, reference
        self.unscaled = [g["lr"] for g in self.optimizer.param_groups]
        self.batch_size = None

    def _set(self, lrs):
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    def set_batch_size(self, n: int) -> None:
        """The next update trains n samples (over all data-parallel ranks)."""
        self.batch_size = n
        self._set([scale_lr(lr, n, self.reference, self.method) for lr in self.unscaled])

    def step(self, *args, **kwargs) -> None:
        self._set(self.unscaled)
        if self.base is not None:
            self.base.step(*args, **kwargs)
        self.unscaled = [g["lr"] for g in self.optimizer.param_groups]

    def get_lr(self) -> list:
        """The rates the next update uses (scaled once its batch size is set)."""
        return [g["lr"] for g in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return {"base": None if self.base is None else self.base.state_dict(), "method": self.method,
                "reference": self.reference, "unscaled": list(self.unscaled)}

    def load_state_dict(self, state: dict) -> None:
        keys = {"base", "method", "reference", "unscaled"}
        if not isinstance(state, dict) or set(state) != keys:
            raise UserError(f"LR scheduler state: expected keys {sorted(keys)}, got "
                            f"{sorted(state) if isinstance(state, dict) else type(state).__name__} (a checkpoint "
                            f"saved without LR scaling; resume it without, or start the scaled run afresh)")
        if (state["base"] is None) != (self.base is None):
            raise UserError("LR scheduler state: saved with" + ("out" if state["base"] is None else "") +
                            " a wrapped schedule, this run has" + ("out" if self.base is None else "") + " one")
        if self.base is not None:
            self.base.load_state_dict(state["base"])
        # method and reference come from this run's config: a resumed run may change how it scales
        self.unscaled = list(state["unscaled"])
        self._set(self.unscaled)


def install(engine, method: str, reference: int = None) -> BatchSizeLR:
    """Wrap the engine's LR schedule (or its constant LR) and install the wrapper as engine.lr_scheduler;
    reference None: engine.train_batch_size(), as DeepSpeed's dynamic batching. Call it before
    engine.load_checkpoint, so a resumed run restores the wrapped state. Installing again wraps the
    original schedule, not the wrapper."""
    base = engine.lr_scheduler
    base = base.base if isinstance(base, BatchSizeLR) else base
    lr = BatchSizeLR(engine.optimizer, base, method, reference or engine.train_batch_size())
    engine.lr_scheduler = lr
    return lr
