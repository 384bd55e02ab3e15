"""--profile-steps (train/gpu_busy.py): the busy-time arithmetic over a GPU timeline, the flag's checks, and a
profiled step on CUDA."""
import argparse
import json
import logging
import time

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train import gpu_busy


def test_union_counts_overlaps_once_and_gaps_not_at_all():
    # two streams overlapping 10-30 and 20-50, a gap, then 60-70: 40 + 10 us busy
    assert gpu_busy.union_ms([(20.0, 50.0), (10.0, 30.0), (60.0, 70.0)]) == pytest.approx(0.05)
    assert gpu_busy.union_ms([(0.0, 100.0), (10.0, 20.0)]) == pytest.approx(0.1)  # nested
    assert gpu_busy.union_ms([]) == 0.0


def test_gpu_intervals_take_kernels_and_copies_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 100, "dur": 50},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 160, "dur": 10},
        {"ph": "X", "cat": "gpu_memset", "ts": 175, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "ts": 90, "dur": 200},  # a host-side launch call: not GPU work
        {"ph": "i", "cat": "kernel", "ts": 300},                    # not a complete event
    ]}
    assert gpu_busy.gpu_intervals(trace) == [(100.0, 150.0), (160.0, 170.0), (175.0, 180.0)]
    assert gpu_busy.union_ms(gpu_busy.gpu_intervals(trace)) == pytest.approx(0.065)


@pytest.mark.parametrize("text,want", [("4-6", (4, 6)), ("5", (5, 5)), (None, None)])
def test_range(text, want):
    assert gpu_busy.parse_range(text) == want


@pytest.mark.parametrize("text", ["0-2", "6-4", "a-b", "3-", "-3"])
def test_bad_range_names_the_flag(text):
    with pytest.raises(UserError, match="--profile-steps"):
        gpu_busy.parse_range(text)


def test_cpu_run_records_nothing_and_says_so(tmp_path, caplog):
    args = argparse.Namespace(profile_steps="1-2")
    with caplog.at_level(logging.WARNING):
        prof = gpu_busy.StepProfile(args, torch.device("cpu"), str(tmp_path), 0)
    assert "needs CUDA" in caplog.text
    prof.start(0)
    assert prof.stop(0, 1.0) == {}
    assert not (tmp_path / "profile").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_step_on_cuda(tmp_path):
    """Steps 2 and 3 of 3 are profiled: busy time is positive and below the wall time; the host's sleep between
    two kernels is not counted as busy."""
    args = argparse.Namespace(profile_steps="2-3")
    prof = gpu_busy.StepProfile(args, torch.device("cuda"), str(tmp_path), 0)
    a = torch.randn(2048, 2048, device="cuda")
    got = []
    for step in range(3):
        prof.start(step)
        torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ a).sum().item()
        time.sleep(0.2)  # the GPU idles while the host works
        (a @ a).sum().item()
        step_s = time.perf_counter() - t
        got.append(prof.stop(step, step_s))
    assert got[0] == {}
    for rec in got[1:]:
        assert 0 < rec["gpu_busy_ms"] < 200 and 0 < rec["gpu_busy_frac"] < 0.5
    saved = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert saved == ["step2-rank0.json", "step3-rank0.json"]
    json.loads((tmp_path / "profile" / "step2-rank0.json").read_text())
