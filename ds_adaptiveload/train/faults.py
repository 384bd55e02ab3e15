"""Fault injection for the reliability tests (tests/test_reliability.py); hidden `--fault SPEC` flag.

    kill:RANK:STEP        SIGKILL rank RANK during step STEP (1-based), after its first backward
    save-abort:STEP       rank 0 SIGKILLs itself after the checkpoint of STEP is written, before it is
                          published (checkpoint.save)
    worker-kill:RANK:STEP rank RANK SIGKILLs one of its DataLoader workers as it starts reading step STEP, and
                          waits for its death (the kernel's OOM killer, e.g.)
    oom:RANK:STEP:MB      rank RANK raises the accelerator's out-of-memory error for micro-batch MB (0-based)
                          of step STEP, before the micro-batch's forward issues any collective
    enospc-save:RANK:STEP rank RANK's writes inside DeepSpeed's save of STEP fail with ENOSPC (a full disk)
    enospc-log:RANK:STEP  rank RANK's step-log line of STEP fails with ENOSPC
    stall:RANK:STEP       rank RANK sleeps (up to 10 min) before the first forward of step STEP, so that its peers
                          wait for it inside a collective (a slow rank when a scheduler's SIGTERM arrives)

SIGKILL, not an exception: nothing gets to clean up, as with a preempted node or the kernel's OOM killer.
"""
import errno
import os
import signal
import time

from ds_adaptiveload.errors import UserError


class Faults:
    def __init__(self, specs, rank: int):
        self.rank = rank
        self.kill, self.save_abort, self.oom, self.worker_kill = set(), set(), set(), set()
        self.enospc_save, self.enospc_log, self.stall = set(), set(), set()
        for spec in specs or ():
            kind, *nums = spec.split(":")
            try:
                nums = tuple(int(n) for n in nums)
            except ValueError:
                nums = ()
            kinds = {"kill": (2, self.kill), "save-abort": (1, self.save_abort), "oom": (3, self.oom),
                     "worker-kill": (2, self.worker_kill), "enospc-save": (2, self.enospc_save),
                     "enospc-log": (2, self.enospc_log), "stall": (2, self.stall)}
            want, into = kinds.get(kind, (None, None))
            if want is None or len(nums) != want:
                raise UserError(f"--fault {spec!r}: expected kill:RANK:STEP, save-abort:STEP, oom:RANK:STEP:MB, "
                                f"worker-kill:RANK:STEP, enospc-save:RANK:STEP, enospc-log:RANK:STEP or stall:RANK:STEP")
            into.add(nums)

    def after_backward(self, step: int) -> None:
        if (self.rank, step) in self.kill:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_read(self, step: int, batches) -> None:
        """Inside the step's read, so that the DataLoader's SIGCHLD check raises there, as it does when a worker dies
        while the rank waits for its data."""
        workers = getattr(batches, "_workers", None)
        if (self.rank, step) in self.worker_kill and workers:
            os.kill(workers[0].pid, signal.SIGKILL)
            workers[0].join(timeout=30)

    def before_publish(self, step: int) -> None:
        if self.rank == 0 and (step,) in self.save_abort:
            os.kill(os.getpid(), signal.SIGKILL)

    def during_save(self, step, path: str) -> None:
        """Before each file DeepSpeed writes for the checkpoint of `step` (ckpt_safe.Guard)."""
        if (self.rank, step) in self.enospc_save:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def before_log(self, step: int, path: str) -> None:
        if (self.rank, step) in self.enospc_log:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    def before_forward(self, step: int, micro: int) -> None:
        if micro == 0 and (self.rank, step) in self.stall:
            time.sleep(600)  # a signal's handler (SIGTERM: failures.on_sigterm) ends the sleep by raising
        if (self.rank, step, micro) in self.oom:
            raise out_of_memory_error()(f"injected out-of-memory (--fault oom:{self.rank}:{step}:{micro})")


def out_of_memory_error():
    """torch.OutOfMemoryError (accelerator-agnostic, torch >= 2.5) or torch.cuda.OutOfMemoryError."""
    import torch

    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
