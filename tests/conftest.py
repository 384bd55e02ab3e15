"""pytest set-up: the cuda and slow markers (CUDA tests skip with a reason on a CPU), and a check that no test
leaves DeepSpeed's CPU all-reduce buffers in /dev/shm (train/engine.unlink_shm_buffer)."""
import os

import pytest

from tests.launcher import no_leaked_buffers


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped with a reason on CPU machines)")
    config.addinivalue_line("markers", "slow: multi-process or long-running test")


# Test files whose tests launch DeepSpeed ranks or train for many steps: the slow tier (`bash tests/run.sh --all`).
# The fast tier (`bash tests/run.sh`) runs the rest. Chosen from measured durations (`pytest --durations=0`).
SLOW_FILES = {
    "test_train.py", "test_reliability.py", "test_calibrate_runs.py", "test_encode.py", "test_own_loop.py",
    "test_packed_zero3.py", "test_scale.py", "test_build.py", "test_mfu_bench.py", "test_compile_blocks.py",
    # single-process but 15-40 s a test (inductor compiles, a wheel install, bench smoke runs)
    "test_compile_regions.py", "test_checkpoint_policy.py", "test_offload.py", "test_optim_step_bench.py",
    "test_bench_runner.py", "test_install.py", "test_calibrate_packed.py",
}


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(slow)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_leaked_shm_buffers():
    """Each launched CPU rank maps a 66 MB file in /dev/shm (RAM) that DeepSpeed never unlinks: 5.4 GB per suite run,
    until a later test ran out of memory. A test that leaves one of its own launches' files fails, and the files are
    removed anyway (tests/launcher.no_leaked_buffers: by master port, so other jobs' files do not count). The launcher
    variables are restored after each test."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    with no_leaked_buffers():
        yield
    # An in-process group (train/engine.single_process_env) sets these and keeps its store listening on MASTER_PORT:
    # left in os.environ, a later test's child process inherited that port and failed to bind it (EADDRINUSE).
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
