"""The test suite is isolated from other jobs on the machine: its launches take free master ports (never a fixed one
that another job, e.g. a DeepSpeed run on the default 29500, or a parallel run of this suite may hold), and the
shared-memory check counts only the buffers of this test's own ports."""
import os
import re

import pytest

from tests.launcher import SHM_BUFFERS, buffer_port, leaked_buffers, master_port, no_leaked_buffers

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def buffer_name(port: int, rank: int = 0, uid=None) -> str:
    """The name DeepSpeed's CPU all-reduce gives a rank's buffer (deepspeed/ops/csrc/cpu/comm/shm.cpp)."""
    return SHM_BUFFERS.replace("*", f"{os.getuid() if uid is None else uid}_127.0.0.1_{port}_{rank}")


def make_buffer(path: str) -> str:
    with open(path, "wb") as f:
        f.write(b"\0" * 16)
    return path


@pytest.fixture(scope="module")
def other_jobs_files():
    """Paths made by the tests as another job's buffers, removed after the module: after the autouse check's
    teardown, which must have left them alone."""
    paths = []
    yield paths
    for p in paths:
        assert os.path.exists(p), f"the shared-memory check removed another job's file {p}"
        os.unlink(p)


def test_another_jobs_buffer_does_not_fail_this_test(other_jobs_files):
    """A DeepSpeed job on port 29500 creates its buffers while this test runs: the autouse check
    (conftest.no_leaked_shm_buffers) neither fails this test nor removes that job's file. Before, any file that
    appeared during a test failed it (twice in one suite run)."""
    other_jobs_files.append(make_buffer(buffer_name(29500, rank=1)))


def test_this_tests_own_leftover_buffer_fails_and_is_removed():
    with pytest.raises(AssertionError, match="shared-memory all-reduce buffers"):
        with no_leaked_buffers():
            mine = make_buffer(buffer_name(master_port()))
    assert not os.path.exists(mine)
    with no_leaked_buffers():  # an in-process group's port (os.environ, as single_process_env sets it) counts too
        old = os.environ.get("MASTER_PORT")
        os.environ["MASTER_PORT"] = str(master_port())
        try:
            inproc = make_buffer(buffer_name(int(os.environ["MASTER_PORT"])))
            assert leaked_buffers({os.environ["MASTER_PORT"]}) == [inproc]
            os.unlink(inproc)
        finally:
            os.environ.pop("MASTER_PORT") if old is None else os.environ.update(MASTER_PORT=old)


def test_buffer_names_are_parsed_by_port_and_user():
    assert buffer_port(buffer_name(41234, rank=3)) == 41234
    assert buffer_port(buffer_name(41234, uid=os.getuid() + 1)) is None  # another user's job
    assert buffer_port("/dev/shm/deepspeed_allreduce_buffer_junk") is None


def test_launch_ports_are_free_and_outside_the_launchers_fixed_ones():
    ports = {master_port() for _ in range(20)}
    assert len(ports) >= 19 and not any(29500 <= p < 29800 for p in ports), ports


# a number given as --master_port or MASTER_PORT, a helper's port= argument, a range of 29xxx ports, a tcp:// address
FIXED_PORT = re.compile(r"""master_port["']?,\s*["']?\d|MASTER_PORT\s*=\s*["']?\d|\bport\s*=\s*\d|range\(29\d{3}|"""
                        r"""tcp://127\.0\.0\.1:\d""")


def test_no_test_launches_on_a_fixed_port():
    """Every launch in the suite takes tests.launcher.master_port(): a fixed 29xxx port collided with other jobs
    (EADDRINUSE at start-up) and with parallel runs of the same test."""
    found = []
    for name in sorted(os.listdir(TESTS)):
        if name.endswith(".py"):
            with open(os.path.join(TESTS, name)) as f:
                found += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if FIXED_PORT.search(line)]
    assert not found, "\n".join(found)
