"""The `deepspeed` launcher the multi-rank tests run (the one beside this interpreter first, a venv's, then PATH), the
master ports of their launches, and the check that a test leaves no DeepSpeed shared-memory buffer of its own."""
import glob
import os
import re
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


SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"
PORTS = set()
"""Master ports handed out by master_port() during the running test (conftest.py clears it before each test)."""


def master_port() -> int:
    """The master port of one launch: a port the kernel has just handed out as free, from its ephemeral range, where no
    launcher's fixed port lies (DeepSpeed's and torchrun's default 29500, another job's or test's 29xxx). A fixed port
    failed tests whenever another job on the machine held it (EADDRINUSE) or ran the same test at the same time."""
    from ds_adaptiveload.train.engine import free_port

    p = free_port()
    PORTS.add(p)
    return p


def buffer_port(path: str):
    """The master port in a DeepSpeed CPU all-reduce buffer's name (deepspeed/ops/csrc/cpu/comm/shm.cpp:
    deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>), or None for another name."""
    m = re.fullmatch(r"deepspeed_allreduce_buffer_(\d+)_.*_(\d+)_(\d+)", os.path.basename(path))
    return int(m.group(2)) if m and int(m.group(1)) == os.getuid() else None


def leaked_buffers(ports) -> list:
    """This user's DeepSpeed all-reduce buffers in /dev/shm whose master port is one of `ports`."""
    ports = {int(p) for p in ports if p}
    return sorted(path for path in glob.glob(SHM_BUFFERS) if buffer_port(path) in ports)


class no_leaked_buffers:
    """Context manager around one test: on exit, the all-reduce buffers of the ports this test launched on (master_port(), and
    the MASTER_PORT an in-process group set in os.environ) are removed, and an AssertionError names them. Buffers of
    other jobs on the machine (another test run, a DeepSpeed job on port 29500) are not this test's, and left alone."""

    def __enter__(self):
        PORTS.clear()
        self.env_port = os.environ.get("MASTER_PORT")
        return self

    def __exit__(self, *exc):
        ports = set(PORTS)
        if os.environ.get("MASTER_PORT") != self.env_port:  # this test started an in-process group
            ports.add(os.environ["MASTER_PORT"])
        leaked = leaked_buffers(ports)
        for path in leaked:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if exc[0] is None:
            assert not leaked, f"this test left DeepSpeed's shared-memory all-reduce buffers: {leaked}"
        return False
