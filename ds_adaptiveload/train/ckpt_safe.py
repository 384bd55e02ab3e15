"""What DeepSpeed reads and writes for a checkpoint, guarded: files are loaded with torch.load(weights_only=True),
which builds tensors and plain containers but calls no other function, plus the few DeepSpeed classes its states
hold (SAFE_GLOBALS); a file that needs anything else is refused unless --trust-checkpoint. A failed write
(a full disk) is recorded instead of raised, so that every rank still runs DeepSpeed's save to its end (its
collectives stay matched) and the error is agreed afterwards (checkpoint.save).
"""
import functools
import os
import pickle
import zipfile

from ds_adaptiveload.errors import UserError

TRUST_HINT = "pass --trust-checkpoint to load it with full unpickling, only for a file whose origin you trust"


def safe_globals() -> list:
    """The classes besides tensors and containers that DeepSpeed's ZeRO and model states pickle (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-2 and ZeRO-3 checkpoints of DeepSpeed 0.19): the
    loss scaler object of the optimizer state (DynamicLossScaler under fp16), the ZeRO stage enum, and the
    (start, numel) records of ZeRO-1/2's parameter slices. Each is plain data once unpickled."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def unsafe_globals(path: str) -> list:
    """The globals a torch file needs that weights_only loading refuses (read from its pickle without running it).
    Raises ValueError for a file that is not a readable zip-format torch file (DeepSpeed writes that format; a
    truncated one is not): damaged, or not DeepSpeed's."""
    import torch

    if not zipfile.is_zipfile(path):
        raise ValueError("not a readable zip-format torch file (truncated, or not written by DeepSpeed)")
    with torch.serialization.safe_globals(safe_globals()):
        try:
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except (RuntimeError, KeyError, pickle.UnpicklingError) as e:
            raise ValueError(f"unreadable ({(str(e).splitlines() or [''])[0][:200]})") from None


def refusal(path: str, needs: list) -> str:
    return (f"{path}: loading it would run code ({', '.join(needs[:3])}{' ...' if len(needs) > 3 else ''} is "
            f"not one of the types a DeepSpeed checkpoint holds); refused: {TRUST_HINT}")


def check_folder(folder: str, trust: bool = False) -> None:
    """Readers outside training (export, sample) call this before DeepSpeed's own readers, which unpickle fully:
    every torch file in `folder` must need no global beyond SAFE ones, else a UserError names it (unless trust)."""
    import glob

    for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        try:
            needs = unsafe_globals(path)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
        if needs and not trust:
            raise UserError(refusal(path, needs))


class Guard:
    """Installed on a DeepSpeed engine's checkpoint engine (install): its load and save go through here."""

    def __init__(self, ckpt_engine, trust: bool, faults=None):
        self.trust, self.faults = trust, faults
        self.error = None
        """The first write that failed in the current save (a line), or None."""
        self.step = None
        """The step of the save in progress (faults)."""
        self._load, self._save = ckpt_engine.load, ckpt_engine.save

    def load(self, path, map_location=None):
        import torch

        if self.trust:
            return torch.load(path, map_location=map_location, weights_only=False)
        try:
            with torch.serialization.safe_globals(safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            needs = [line.split("GLOBAL ", 1)[1].split()[0] for line in str(e).splitlines() if "GLOBAL " in line]
            raise UserError(refusal(path, needs or ["an unsupported object"])) from None

    def save(self, state_dict, path):
        if self.error:  # the save already failed here: write nothing more, keep running DeepSpeed's collectives
            return
        try:
            if self.faults is not None:
                self.faults.during_save(self.step, path)
            self._save(state_dict, path)
        except OSError as e:
            self.error = f"{path}: {e.strerror or e}"

    def copy_scripts(self, copy, save_path):
        """DeepSpeed's _copy_recovery_script (rank 0): its full disk is recorded like a tensor file's."""
        if self.error:
            return
        try:
            copy(save_path)
        except OSError as e:
            self.error = f"{save_path}: copying DeepSpeed's recovery scripts: {e.strerror or e}"


def install(engine, trust: bool = False, faults=None) -> Guard:
    """Route the engine's checkpoint loads and writes through a Guard (once; returns it)."""
    guard = getattr(engine, "_ds_adaptiveload_guard", None)
    if guard is not None:
        return guard
    ce = engine.checkpoint_engine
    guard = Guard(ce, trust, faults)
    ce.load, ce.save = guard.load, guard.save
    engine._copy_recovery_script = functools.partial(guard.copy_scripts, engine._copy_recovery_script)
    engine._ds_adaptiveload_guard = guard
    return guard
