"""Checkpoints that resume safely (docs/reliability.md): files loaded without running code in them, interrupted and
damaged saves, a full disk, a fresh run into an old output, `latest` outside the folder, a changed ZeRO stage or
model, --keep-last. CPU, 2 ranks, tiny model, through the real `deepspeed` launcher (tests/test_reliability.py's
launch helpers); one 3-step run with a checkpoint per step is shared by the module and copied by each test."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ds_adaptiveload.data import latents as data
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train import checkpoint, ckpt_files, ckpt_safe
from tests.launcher import DEEPSPEED, needs_launcher

slow = pytest.mark.slow  # launches ranks: the slow tier (bash tests/run.sh --all)
from tests.test_reliability import TINY, launch, lineage, ok, one_error, write_config


class Payload:
    """Unpickling it runs `touch MARKER` (what a crafted checkpoint file does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft(path, marker) -> None:
    """Replace a checkpoint file by a torch file whose unpickling writes `marker`, and update the checksum manifest
    (an attacker who can write the file can write the manifest)."""
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)}, path)
    folder = os.path.dirname(path)
    sums = json.load(open(os.path.join(folder, ckpt_files.CHECKSUMS)))
    sums["files"][os.path.basename(path)] = ckpt_files.hash_file(path)
    json.dump(sums, open(os.path.join(folder, ckpt_files.CHECKSUMS), "w"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from ds_adaptiveload.schedule.mixes import make_mix

    d = tmp_path_factory.mktemp("data")
    return data.write_synthetic(str(d), make_mix("tiny", 48, 0), text_dim=TINY.text_dim,
                                max_text_len=TINY.text_len, dtype="fp32", shard_size=16)


@pytest.fixture(scope="module")
def base(tmp_path_factory, dataset):
    """3 steps, a checkpoint after each, --keep-last 2: global_step2 and global_step3 remain."""
    if DEEPSPEED is None:
        pytest.skip("deepspeed launcher not installed")
    d = tmp_path_factory.mktemp("base")
    cfg = write_config(d / "ds.json")
    ok(launch(d / "run", dataset, cfg, "--max-steps", "3", "--save-every", "1", "--keep-last", "2"))
    return d / "run", cfg


def copy_run(base, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base[0], out)
    return out, out / "checkpoints"


# ----------------------------------------------------------------------------------------------------
# Loading runs no code from the files


@slow
@needs_launcher
def test_crafted_checkpoint_file_is_refused_without_running_it(tmp_path, dataset, base):
    out, ckpt = copy_run(base, tmp_path)
    marker = tmp_path / "marker"
    victim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    craft(victim, marker)
    line = one_error(launch(out, dataset, base[1], "--max-steps", "4", "--resume", str(ckpt)))
    assert not marker.exists()
    assert str(victim) in line and "posix.system" in line and "--trust-checkpoint" in line, line


def test_guard_loads_weights_only_unless_trusted(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "x.pt"
    torch.save({"x": Payload(marker)}, path)
    assert ckpt_safe.unsafe_globals(str(path)) == ["posix.system"]

    class Engine:
        load, save = staticmethod(torch.load), staticmethod(torch.save)

    with pytest.raises(UserError, match=r"x.pt: loading it would run code \(posix.system is not one of the types"):
        ckpt_safe.Guard(Engine(), trust=False).load(str(path))
    assert not marker.exists()
    ckpt_safe.Guard(Engine(), trust=True).load(str(path))  # --trust-checkpoint: full unpickling, as asked
    assert marker.exists()


# ----------------------------------------------------------------------------------------------------
# Interrupted saves, damaged checkpoints, a full disk


@slow
@needs_launcher
def test_interrupted_first_save_starts_from_step_0(tmp_path, dataset, base):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    proc = launch(out, dataset, base[1], "--max-steps", "1", "--fault", "save-abort:1")
    assert proc.returncode != 0
    # DeepSpeed's recovery scripts are copied in before the publish: the folder holds them, no `latest`
    assert sorted(os.listdir(ckpt)) == [".tmp-global_step1", "zero_to_fp32.py", "zero_to_torch.py"]
    proc = launch(out, dataset, base[1], "--max-steps", "1", "--resume", str(ckpt))
    ok(proc)
    assert f"--resume {ckpt}: no checkpoint there yet, starting from step 0" in proc.stderr
    assert (ckpt / "latest").read_text() == "global_step1"


def test_a_finished_save_without_latest_is_a_fallback(tmp_path):
    """A full disk when `latest` is written: the renamed folder holds its manifest, so it is found."""
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step2" / "a.pt").write_bytes(b"x")
    ckpt_files.write_checksums(str(tmp_path / "global_step2"), {"a.pt": ckpt_files.hash_file(str(tmp_path / "global_step2" / "a.pt"))})
    (tmp_path / "global_step4").mkdir()  # renamed, manifest never written: not a candidate
    for script in ckpt_files.DS_SCRIPTS:
        (tmp_path / script).write_text("")
    assert ckpt_files.candidates(str(tmp_path)) == (["global_step2"], [])
    (tmp_path / "latest").write_text("global_step6")
    assert ckpt_files.candidates(str(tmp_path)) == (["global_step2"], ["'latest' names 'global_step6', which does not exist"])


@slow
@needs_launcher
def test_damaged_newest_checkpoint_falls_back(tmp_path, dataset, base):
    out, ckpt = copy_run(base, tmp_path)
    victim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    proc = launch(out, dataset, base[1], "--max-steps", "4", "--resume", str(ckpt))
    ok(proc)
    warn = [line for line in proc.stderr.splitlines() if "newest intact" in line]
    assert len(warn) == 1 and "checkpoint global_step3 is damaged: zero_pp_rank_1_mp_rank_00_model_states.pt has" in \
        warn[0] and warn[0].endswith("resuming from global_step2, the newest intact checkpoint"), proc.stderr[-3000:]
    assert f"resumed from {ckpt / 'global_step2'}: step 2 done, continuing with step 3" in proc.stdout
    assert [r["step"] for r in lineage(out, 0)] == [1, 2, 3, 4]
    assert (ckpt / "latest").read_text() == "global_step4"


def test_flipped_bytes_are_found(tmp_path):
    folder = tmp_path / "global_step2"
    folder.mkdir()
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"exp_avg": torch.arange(64.0)}, folder / name)
    ckpt_files.write_checksums(str(folder), {n: ckpt_files.hash_file(str(folder / n)) for n in os.listdir(folder)})
    assert checkpoint._verify_mine(str(folder), 0, 2, False) == checkpoint._verify_mine(str(folder), 1, 2, False) == []
    victim = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    raw = bytearray(victim.read_bytes())
    raw[-200:-196] = bytes(b ^ 0xFF for b in raw[-200:-196])  # two floats' worth, same size
    victim.write_bytes(raw)
    assert checkpoint._verify_mine(str(folder), 0, 2, False) == []  # rank 1 checks the file rank 1 wrote
    assert checkpoint._verify_mine(str(folder), 1, 2, False) == [
        ("damaged", "zero_pp_rank_1_mp_rank_00_optim_states.pt: sha256 differs from the manifest (the file changed "
                    "after it was saved)")]


@slow
@needs_launcher
@pytest.mark.parametrize("fault,what,latest", [("enospc-save:1:2", "cannot save", "global_step1"),
                                               ("enospc-log:0:2", "cannot write the step log", "global_step2")])
def test_full_disk_ends_with_one_error(tmp_path, dataset, base, fault, what, latest):
    """In DeepSpeed's save of step 2 on rank 1; in rank 0's step-log line of step 2 (agreed when step 3 is read,
    after step 2's checkpoint)."""
    out = tmp_path / "run"
    proc = launch(out, dataset, base[1], "--max-steps", "3", "--save-every", "1", "--fault", fault)
    line = one_error(proc)
    assert what in line and "No space left on device" in line and "--resume" in line, line
    assert (out / "checkpoints" / "latest").read_text() == latest


# ----------------------------------------------------------------------------------------------------
# What --resume may load, and what a fresh run may overwrite


@slow
@needs_launcher
def test_fresh_run_into_an_old_output_is_refused_unless_overwrite(tmp_path, dataset, base):
    out, ckpt = copy_run(base, tmp_path)
    line = one_error(launch(out, dataset, base[1], "--max-steps", "1"))
    assert line == (f"error: --output {out}: {ckpt} holds checkpoints of an earlier run (latest: 'global_step3'); "
                    f"continue it with --resume {ckpt}, or pass --overwrite to start from step 0 and delete them")
    assert (ckpt / "latest").read_text() == "global_step3"
    ok(launch(out, dataset, base[1], "--max-steps", "1", "--overwrite"))
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest", "zero_to_fp32.py", "zero_to_torch.py"]


@pytest.mark.parametrize("latest", ["../..", "/etc", "..", "global_step2/../../x", ".tmp-global_step3"])
def test_latest_outside_the_folder_is_refused(tmp_path, latest):
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "latest").write_text(latest)
    with pytest.raises(UserError, match=r"'latest' names .*, which is not a checkpoint folder inside .*; refused"):
        ckpt_files.candidates(str(tmp_path))


@slow
@needs_launcher
def test_changed_zero_stage_is_named(tmp_path, dataset, base):
    out, ckpt = copy_run(base, tmp_path)
    cfg = json.loads(base[1].read_text())
    cfg["zero_optimization"]["stage"] = 2
    (tmp_path / "z2.json").write_text(json.dumps(cfg))
    line = one_error(launch(out, dataset, tmp_path / "z2.json", "--max-steps", "4", "--resume", str(ckpt)))
    assert line == (f"error: --resume {ckpt}: checkpoint global_step3 was saved with zero_stage=3, this run has "
                    f"zero_stage=2; DeepSpeed loads a checkpoint only into the same ZeRO stage and model"), line


def test_changed_model_is_named(tmp_path):
    (tmp_path / "global_step3").mkdir()
    layout = {"world": 2, "zero_stage": 3, "model": TINY.to_dict()}
    (tmp_path / "global_step3" / checkpoint.LAYOUT_FILE).write_text(json.dumps({"step": 3, **layout}))
    checkpoint.check_layout(str(tmp_path), "global_step3", layout)
    with pytest.raises(UserError, match=r"saved with model.num_layers=2, this run has model.num_layers=3; DeepSpeed"):
        checkpoint.check_layout(str(tmp_path), "global_step3", {**layout, "model": {**layout["model"], "num_layers": 3}})
    older = {"step": 3, "world": 2}  # saved before these keys were stored: left to DeepSpeed
    (tmp_path / "global_step3" / checkpoint.LAYOUT_FILE).write_text(json.dumps(older))
    checkpoint.check_layout(str(tmp_path), "global_step3", layout)


# ----------------------------------------------------------------------------------------------------
# --keep-last


def test_keep_last_keeps_latest_and_spares_saves_in_progress(base, tmp_path):
    assert sorted(os.listdir(base[0] / "checkpoints")) == ["global_step2", "global_step3", "latest", "zero_to_fp32.py",
                                                            "zero_to_torch.py"]  # the module's run: --keep-last 2
    for step in (1, 2, 3, 5, 6):
        (tmp_path / f"global_step{step}").mkdir()
        (tmp_path / f"global_step{step}" / ckpt_files.CHECKSUMS).write_text("{}")
    (tmp_path / ".tmp-global_step7").mkdir()  # a save in progress
    (tmp_path / "global_step0").mkdir()  # no manifest: not a finished save, left alone
    assert ckpt_files.checkpoints_to_prune(str(tmp_path), "global_step5", 2) == ["global_step2", "global_step1"]
    assert ckpt_files.prune(str(tmp_path), "global_step5", 1) == ["global_step3", "global_step2", "global_step1"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-global_step7", "global_step0", "global_step5", "global_step6"]


def test_export_refuses_a_checkpoint_that_would_run_code(tmp_path):
    """export reads checkpoints through DeepSpeed's readers, which unpickle fully: the files are checked first."""
    folder = tmp_path / "checkpoints" / "global_step1"
    folder.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("global_step1")
    marker = tmp_path / "marker"
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)}, folder / "mp_rank_00_model_states.pt")
    cmd = [sys.executable, "-m", "ds_adaptiveload", "export", "--checkpoint", str(tmp_path / "checkpoints"),
           "--format", "wan", "--out", str(tmp_path / "out"), "--model-config", "configs/wan_tiny.yaml"]
    proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not marker.exists()
    assert "mp_rank_00_model_states.pt" in proc.stderr and "--trust-checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
