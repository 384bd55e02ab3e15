"""LNModulateBuilder: arch-list handling (Hopper '9.0a', CUDA 13 defaults), sources, prebuilt preference."""
import os
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
from deepspeed.ops.op_builder.builder import CUDAOpBuilder  # noqa: E402

from ds_adaptiveload.ops import builder as bmod  # noqa: E402
from ds_adaptiveload.ops.builder import LNModulateBuilder, gencode_flags, parse_arch_list  # noqa: E402


@pytest.fixture(autouse=True)
def user_build(monkeypatch):
    """The users' build of the op in every test here: importing bench/kernel/ln_tuning (test_ln_modulate.py does, at
    collection) selects the bench build for the whole process."""
    monkeypatch.delenv(bmod.TUNING_ENV, raising=False)


@pytest.fixture
def arch_env(monkeypatch):
    """Restore TORCH_CUDA_ARCH_LIST (compute_capability_args writes it, as DeepSpeed's does)."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    yield monkeypatch
    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


def test_declarative_names():
    b = LNModulateBuilder()
    assert isinstance(b, CUDAOpBuilder)
    assert b.BUILD_VAR == "DS_BUILD_LN_MODULATE" and b.NAME == "ln_modulate" == b.name
    assert b.absolute_name() == "ds_adaptiveload.ops.ln_modulate_op"


def test_kernel_choice_setters_only_in_the_bench_build(monkeypatch, arch_env):
    """Users' builds lack the op's tuning setters (issue: the runtime switches leave the shipped module); the bench
    build adds them under another module name, so neither build is loaded for the other."""
    user = LNModulateBuilder()
    assert "-DLNMOD_BENCH_TUNING" not in user.cxx_args() + user.nvcc_args()
    monkeypatch.setenv(bmod.TUNING_ENV, "1")
    bench = LNModulateBuilder()
    assert bench.name == "ln_modulate_tuning" and bench.absolute_name() == "ds_adaptiveload.ops.ln_modulate_tuning_op"
    assert "-DLNMOD_BENCH_TUNING" in bench.cxx_args() and "-DLNMOD_BENCH_TUNING" in bench.nvcc_args()
    src = (Path(bmod.csrc_dir()) / "ln_modulate.cpp").read_text()
    guarded = src.split("#ifdef LNMOD_BENCH_TUNING", 1)[1].split("#endif", 1)[0]
    assert all(f'm.def("{n}"' in guarded for n in ("_set_tuning", "_get_tuning", "_fast_tiles"))
    assert src.count('m.def("_set_tuning"') == 1


def test_sources_are_absolute_and_exist():
    b = LNModulateBuilder()
    for p in b.sources() + b.include_paths():
        assert os.path.isabs(p) and os.path.exists(p), p
    assert {Path(p).suffix for p in b.sources()} == {".cpp", ".cu"}


def test_parse_arch_list():
    assert parse_arch_list("9.0a") == [(9, 0, "a", False)]
    assert parse_arch_list("9.0 8.0;8.0+PTX;10.0f") == [(8, 0, "", True), (9, 0, "", False), (10, 0, "f", False)]
    with pytest.raises(ValueError, match="cannot parse"):
        parse_arch_list("9.x")
    assert gencode_flags(parse_arch_list("9.0a;8.0+PTX")) == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80",
        "-gencode=arch=compute_90a,code=sm_90a"]


def test_hopper_arch_list_accepted(arch_env):
    arch_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    b = LNModulateBuilder()
    assert b.compute_capability_args() == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert b.enable_bf16
    # What the override fixes: DeepSpeed 0.19.8's own parser crashes on the same setting.
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    with pytest.raises(ValueError):
        CUDAOpBuilder.compute_capability_args(LNModulateBuilder())


def test_default_archs_without_gpu(arch_env):
    """No TORCH_CUDA_ARCH_LIST, no GPU (CI, CUDA 13): 8.0;9.0, never DeepSpeed's 6.0;6.1;7.0."""
    arch_env.setattr(torch.cuda, "is_available", lambda: False)
    b = LNModulateBuilder()
    assert b.arch_list() == bmod.DEFAULT_ARCHS == "8.0;9.0"
    flags = b.compute_capability_args()
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    assert not any("compute_6" in f or "compute_70" in f for f in flags)


def test_old_arch_rejected(arch_env):
    arch_env.setenv("TORCH_CUDA_ARCH_LIST", "7.0;8.0")
    with pytest.raises(RuntimeError, match=">= 8.0"):
        LNModulateBuilder().compute_capability_args()


def test_load_prefers_prebuilt(monkeypatch):
    fake = types.ModuleType("ds_adaptiveload.ops.ln_modulate_op")
    fake.torch_version = ".".join(torch.__version__.split(".")[:2])
    monkeypatch.setitem(sys.modules, "ds_adaptiveload.ops.ln_modulate_op", fake)
    monkeypatch.delitem(CUDAOpBuilder._loaded_ops, "ln_modulate", raising=False)
    b = LNModulateBuilder()
    monkeypatch.setattr(b, "jit_load", lambda verbose=True: pytest.fail("JIT used despite a prebuilt module"))
    try:
        assert b.load() is fake
    finally:
        CUDAOpBuilder._loaded_ops.pop("ln_modulate", None)


def test_prebuilt_for_other_torch_is_ignored(monkeypatch):
    fake = types.ModuleType("ds_adaptiveload.ops.ln_modulate_op")
    fake.torch_version = "1.0"
    monkeypatch.setitem(sys.modules, "ds_adaptiveload.ops.ln_modulate_op", fake)
    assert LNModulateBuilder().prebuilt() is None


def test_csrc_fallback_to_checkout():
    # In a checkout there is no ds_adaptiveload/ops/csrc; the repo's ops/csrc is used.
    d = bmod.csrc_dir()
    assert d.is_absolute() and (d / "ln_modulate_fwd.cu").is_file()


def test_report_runs(capsys):
    import argparse

    from ds_adaptiveload.ops import report

    report.add_arguments(argparse.ArgumentParser())
    assert report.run(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert "ln_modulate" in out and "torch" in out and "deepspeed" in out
