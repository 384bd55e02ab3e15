"""Builds DeepSpeed's CPU all-reduce op (deepspeed_shm_comm) once before the suite launches any ranks.

Built inside a launched test, the first build races that test's timeout; a build killed there leaves torch's lock
file behind, and every later load of the op waits on it for good (seen 2026-12-06 on a loaded 2-core machine: each
later 2-rank launch of tests/test_reliability.py timed out). A lock older than STALE_S with no built module is such
a leftover and is removed first."""
import glob
import os
import sys
import time

STALE_S = 900


def main() -> int:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return 0  # no DeepSpeed: the tests that need it skip
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        return 0
    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", ""), "deepspeed_shm_comm")
    lock = os.path.join(folder, "lock")
    if (os.environ.get("TORCH_EXTENSIONS_DIR") and os.path.exists(lock) and not glob.glob(os.path.join(folder, "*.so"))
            and time.time() - os.path.getmtime(lock) > STALE_S):
        print(f"tests/warm_ops.py: removing a stale build lock {lock}", file=sys.stderr)
        os.remove(lock)
    try:
        accel.create_op_builder("ShareMemCommBuilder").load(verbose=False)
    except Exception as err:  # noqa: BLE001 - the suite then builds it (or reports) where a test needs it
        print(f"tests/warm_ops.py: DeepSpeed's shm op did not build ({type(err).__name__}: {err})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
