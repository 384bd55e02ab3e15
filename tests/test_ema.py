"""adaptive_load.ema_decay (train/ema.py): on 2 CPU ranks under ZeRO-3 (each rank keeps its partitions) and ZeRO-2,
the EMA a checkpoint holds follows ema = d * ema + (1 - d) * w over the saved weights of each step, and
`export --ema [--tag]` writes it."""
import os

import pytest
import torch

from tests.launcher import needs_launcher
from tests.test_init_export import export, train_tiny

DECAY = 0.5  # large steps of the average: a wrong update shows


@pytest.mark.slow
@needs_launcher
@pytest.mark.parametrize("stage", [3, 2])
def test_the_ema_follows_the_weights_and_exports(tmp_path, stage):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file


    out = tmp_path / "run"
    out.mkdir()
    train_tiny(out, stage, "--save-every", "1", steps=3, adaptive_load={"ema_decay": DECAY})
    ckpt = out / "checkpoints"
    files = sorted(os.listdir(ckpt / "global_step3"))
    ema_files = [f for f in files if f.startswith("ema_rank")]
    assert ema_files == (["ema_rank0.pt", "ema_rank1.pt"] if stage == 3 else ["ema_rank0.pt"])

    def ema_at(step):
        proc = export("--checkpoint", ckpt, "--tag", f"global_step{step}", "--ema", "--format", "wan", "--out",
                      tmp_path / f"ema{step}", "--dtype", "fp32")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return load_file(str(tmp_path / f"ema{step}" / "diffusion_pytorch_model.safetensors"))

    w = {k: get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=f"global_step{k}") for k in (1, 2, 3)}
    ema = ema_at(1)
    assert any(not torch.equal(ema[k], w[1][k]) for k in ema)  # the average lags the weights
    for step in (2, 3):
        ema = {k: DECAY * ema[k] + (1 - DECAY) * w[step][k] for k in ema}
    got = ema_at(3)
    assert set(got) == set(w[3])
    worst = max((got[k] - ema[k]).abs().max().item() for k in got)
    assert worst < 1e-6, worst


@pytest.mark.slow
@needs_launcher
def test_a_resumed_run_continues_the_ema(tmp_path):
    """3 steps straight, and 2 + resume + 1 from the step-2 checkpoint: the same EMA at step 3 (ZeRO-3)."""
    import shutil

    straight, resumed = tmp_path / "a", tmp_path / "b"
    straight.mkdir()
    resumed.mkdir()
    ema = {"ema_decay": DECAY}
    train_tiny(straight, 3, "--save-every", "2", steps=3, adaptive_load=ema)
    shutil.copytree(straight / "checkpoints" / "global_step2", resumed / "checkpoints" / "global_step2")
    (resumed / "checkpoints" / "latest").write_text("global_step2")
    train_tiny(resumed, 3, "--resume", resumed / "checkpoints", steps=3, adaptive_load=ema)
    for rank in (0, 1):
        a = torch.load(straight / "checkpoints" / "global_step3" / f"ema_rank{rank}.pt", weights_only=True)["ema"]
        b = torch.load(resumed / "checkpoints" / "global_step3" / f"ema_rank{rank}.pt", weights_only=True)["ema"]
        assert set(a) == set(b)
        assert all(torch.equal(a[k], b[k]) for k in a), rank
