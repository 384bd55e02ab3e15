"""`sample` (sample_cli.py): diffusers' WanPipeline on tiny random-init models saved with save_pretrained (VAE, umT5,
and a transformer exported in either layout) writes an mp4 of the requested frames and size; bad shapes are exit-2
errors naming the flag."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
av = pytest.importorskip("av")

from tests.test_encode import tiny_models  # noqa: E402
from tests.test_init_export import ROOT, random_weights, tiny  # noqa: E402


def sample(d, ckpt, out, *extra):
    return subprocess.run([sys.executable, "-m", "ds_adaptiveload", "sample", "--checkpoint", str(ckpt),
                           "--vae", str(d / "vae"), "--text-encoder", str(d / "text_encoder"), "--tokenizer",
                           str(d / "tokenizer"), "--prompt", "a red bar moves right", "--steps", "2",
                           "--dtype", "fp32", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def read_mp4(path):
    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return frames


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ds_adaptiveload.model.export import write

    d = tiny_models(tmp_path_factory.mktemp("models"))
    write(random_weights(tiny(), 7), tiny(), "diffusers", str(d / "transformer"), "fp32")
    write(random_weights(tiny(), 7), tiny(), "wan", str(d / "wan"), "fp32")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("frames,height,width,layout", [(5, 32, 48, "transformer"), (1, 16, 16, "wan")])
def test_sample_writes_an_mp4_of_the_requested_frames_and_size(models, tmp_path, frames, height, width, layout):
    out = tmp_path / "clip.mp4"
    proc = sample(models, models / layout, out, "--frames", str(frames), "--height", str(height), "--width",
                  str(width))
    assert proc.returncode == 0, proc.stderr[-4000:]
    video = read_mp4(out)
    assert len(video) == frames
    assert video[0].shape == (height, width, 3)


def test_bad_shapes_name_the_flag(models, tmp_path):
    proc = sample(models, models / "transformer", tmp_path / "c.mp4", "--frames", "6")
    assert proc.returncode == 2 and "error: --frames 6: must be 4k + 1" in proc.stderr
    proc = sample(models, models / "transformer", tmp_path / "c.mp4", "--height", "40")
    assert proc.returncode == 2 and "error: --height 40: must be a positive multiple of 16" in proc.stderr


@pytest.mark.slow
def test_preview_every_renders_on_rank_0_into_output_samples(models, tmp_path):
    from tests.test_init_export import train_tiny

    out = tmp_path / "run"
    out.mkdir()
    train_tiny(out, 3, "--no-final-save", "--preview-every", "2", "--preview-prompt", "a red bar", "--vae",
               models / "vae", "--text-encoder", models / "text_encoder", "--tokenizer", models / "tokenizer",
               "--preview-frames", "5", "--preview-height", "32", "--preview-width", "32", "--preview-steps", "2")
    assert sorted(os.listdir(out / "samples")) == ["step2.mp4"]
    video = read_mp4(out / "samples" / "step2.mp4")
    assert len(video) == 5 and video[0].shape == (32, 32, 3)


def test_preview_without_its_models_is_an_exit_2_error(tmp_path):
    proc = subprocess.run([sys.executable, "launch/train_wan.py", "--deepspeed_config", "configs/ds_tiny_cpu.json",
                           "--model-config", "configs/wan_tiny.yaml", "--synthetic", "--max-steps", "1",
                           "--preview-every", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "error: --preview-every 1: needs --preview-prompt, --vae, --text-encoder" in proc.stderr
