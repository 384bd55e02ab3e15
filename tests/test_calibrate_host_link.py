"""calibrate's host-link measurement (calibrate/host_link.py): medians over sizes and directions, the field written
into the profile and read back by the offload planner, and the CPU skip. The CUDA timing itself is stubbed here."""
import logging
from types import SimpleNamespace

import pytest

from ds_adaptiveload.calibrate.host_link import host_link_fields, measure
from ds_adaptiveload.calibrate.result import build_profile
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.offload import DEFAULT_HOST_LINK_BYTES_PER_S, host_link
from ds_adaptiveload.schedule.profile import CostProfile

SIZES = (1 << 20, 4 << 20, 16 << 20)


def _stub(rates, slow_first=True):
    """copy_seconds at `rates` bytes/s per direction; the first copy of each size 10x slower (the warm-up)."""
    seen, calls = set(), []

    def seconds(direction, nbytes):
        calls.append((direction, nbytes))
        first = (direction, nbytes) not in seen
        seen.add((direction, nbytes))
        return nbytes / rates[direction] * (10 if first and slow_first else 1)

    return seconds, calls


def test_medians_and_the_slower_direction():
    seconds, calls = _stub({"d2h": 20e9, "h2d": 25e9})
    got = measure(seconds, SIZES, repeats=3)
    assert got["bytes_per_s"] == pytest.approx(20e9)  # the warm-up copy is not counted
    assert got["h2d"] == {s: pytest.approx(25e9) for s in SIZES}
    assert len(calls) == 2 * len(SIZES) * 4


def test_the_median_ignores_an_outlier():
    times = iter([1.0, 1.0, 1.0, 100.0, 1.0] * 6)  # per size: warm-up, then 1, 1, 100, 1 s
    got = measure(lambda d, n: next(times), (10**9,), repeats=4)
    assert got["bytes_per_s"] == pytest.approx(1e9)


def _profile_with(tmp_path, fields):
    prof = build_profile(Geometry(), (1.0, 0.01, 0.0), 5.0, (1e9, 1e5, 0.0), 80e9, 0.9, 1000,
                         {"model": {"dim": 64, "num_layers": 2}}, {}, host_link=fields)
    prof.to_yaml(str(tmp_path / "p.yaml"))
    return CostProfile.load(str(tmp_path / "p.yaml"))


def test_cuda_writes_the_profile_key_the_planner_reads(tmp_path):
    seconds, _ = _stub({"d2h": 21.3e9, "h2d": 26e9})
    fields = host_link_fields(SimpleNamespace(type="cuda"), seconds)
    assert fields["memory"] == {"host_link_bytes_per_s": pytest.approx(21.3e9)}
    assert fields["fit"]["gb_per_s"]["h2d"]["16MiB"] == pytest.approx(26.0)
    prof = _profile_with(tmp_path, fields)
    assert prof.memory["host_link_bytes_per_s"] == pytest.approx(21.3e9)
    assert host_link(prof.memory) == pytest.approx(21.3e9)
    assert prof.fit["host_link"]["gb_per_s"]["d2h"]["256MiB"] == pytest.approx(21.3)


def test_cpu_is_skipped_and_said(tmp_path, caplog):
    def never(direction, nbytes):
        raise AssertionError("nothing is timed on the CPU")

    with caplog.at_level(logging.INFO, logger="ds_adaptiveload.calibrate.host_link"):
        fields = host_link_fields(SimpleNamespace(type="cpu"), never)
    assert fields["memory"] == {} and fields["fit"].startswith("skipped")
    assert "host link: skipped" in caplog.text
    prof = _profile_with(tmp_path, fields)
    assert "host_link_bytes_per_s" not in prof.memory and prof.fit["host_link"].startswith("skipped")
    assert host_link(prof.memory) == DEFAULT_HOST_LINK_BYTES_PER_S
