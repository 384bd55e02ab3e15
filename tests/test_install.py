"""Installable: the built wheel, installed into a fresh virtual environment, ships the configs and profiles, and in an
empty folder outside the checkout `plan` runs on a shipped profile and `python -m ds_adaptiveload train` trains 2 CPU
steps with the shipped tiny config. torch and DeepSpeed come from this interpreter's site-packages (a .pth file), so
the test installs no dependency."""
import json
import os
import site
import subprocess
import sys

import pytest

from tests.launcher import master_port, needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, cwd, timeout=600, **env):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(python, bin folder) of a fresh venv holding the wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("install")
    built = run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(tmp / "dist")], ROOT, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("ds_adaptiveload-*.whl")
    made = run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], tmp)
    assert made.returncode == 0, made.stderr
    python = str(tmp / "venv" / "bin" / "python")
    installed = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q",
                     str(wheel)], tmp)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # then the dependencies, after the venv's own packages on sys.path (before the install, pip would take this
    # interpreter's copy of the package for the venv's)
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp).stdout.strip()
    with open(os.path.join(purelib, "deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    return python, os.path.dirname(python)


def test_the_wheel_ships_the_configs_and_profiles(venv, tmp_path):
    python, _ = venv
    out = run([python, "-c", "import ds_adaptiveload, os; from ds_adaptiveload import shipped; "
                             "print(ds_adaptiveload.__file__); print(shipped.root()); print(shipped.profile_names()); "
                             "print(sorted(os.listdir(shipped.root())))"], tmp_path)
    assert out.returncode == 0, out.stderr
    pkg, root, names, files = out.stdout.splitlines()
    assert pkg.startswith(os.path.dirname(python).rsplit("/bin", 1)[0]) and not pkg.startswith(ROOT)
    assert root == os.path.join(os.path.dirname(pkg), "configs")
    want = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", "profiles")) if f.endswith(".yaml"))
    assert eval(names) == want and "h100-wan1.3b-zero2" in want
    assert set(eval(files)) >= {"ds_tiny_cpu.json", "ds_zero2_bf16.json", "ds_zero3_bf16.json", "wan_1_3b.yaml",
                                "wan_tiny.yaml", "profiles"}


def test_plan_on_a_shipped_profile_in_an_empty_folder(venv, tmp_path):
    python, _ = venv
    out = run([python, "-m", "ds_adaptiveload", "plan", "--profile", "h100-wan1.3b-zero2", "--mix",
               "video-heavy:500", "--world-size", "8", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["samples_planned"] == 500 and summary["capacity_bytes"] == 85017493504
    assert summary["budget_tokens"] > 313403  # moved from 1 to 8 ranks of ZeRO-2: the optimizer state shards
    assert "memory moved from ZeRO-2 on 1 rank(s) to this run's ZeRO-2 on 8" in out.stdout  # a note, logged at info


@needs_launcher
def test_two_cpu_training_steps_with_the_shipped_tiny_config_in_an_empty_folder(venv, tmp_path):
    python, bin_ = venv
    out = run([python, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(master_port()),
               "--module", "ds_adaptiveload", "train", "--deepspeed_config", "configs/ds_tiny_cpu.json",
               "--model-config", "configs/wan_tiny.yaml", "--synthetic", "--synthetic-num", "16", "--max-steps", "2",
               "--num-workers", "0", "--output", "run"], tmp_path, timeout=600,
              PATH=bin_ + os.pathsep + os.environ.get("PATH", ""))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "adaptive_load.profile auto: tiny-cpu (measured for this run: cpu, ZeRO-3, sp=1)" in out.stdout
    with open(tmp_path / "run" / "steps.rank0.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] == s["loss"] for s in steps)
    assert sorted(os.listdir(tmp_path)) == ["run", "runs"]  # the run wrote only its output and the csv monitor
