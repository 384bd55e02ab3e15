"""The `deepspeed` launcher the multi-rank tests run: the one beside this interpreter first (a venv's), then PATH."""
import os
import shutil
import sys

import pytest

BIN = os.path.dirname(sys.executable)
DEEPSPEED = shutil.which("deepspeed", path=BIN + os.pathsep + os.environ.get("PATH", ""))
needs_launcher = pytest.mark.skipif(DEEPSPEED is None, reason="deepspeed launcher not installed")


def launcher_env(**extra) -> dict:
    """The environment for a launched run: this interpreter's bin folder first on PATH (the launcher starts its
    ranks with the `python` it finds there), plus `extra`."""
    return dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), **extra)


def spawn_ranks(worker, world: int, *args) -> None:
    """worker(rank, world, *args) on `world` processes (torch.multiprocessing), each ending as train_wan does."""
    import torch.multiprocessing as mp

    mp.spawn(_run_then_leave, args=(worker, world, *args), nprocs=world, join=True)


def _run_then_leave(rank, worker, world, *args):
    """The group destroyed, then no interpreter teardown: there a finished rank now and then aborted ("terminate
    called without an active exception", SIGABRT), failing a test whose results were already written."""
    from ds_adaptiveload.train.failures import leave, teardown

    worker(rank, world, *args)
    teardown()
    leave(0)
