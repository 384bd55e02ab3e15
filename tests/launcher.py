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
