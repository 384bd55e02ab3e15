"""`encode`: a folder of captioned mp4/mkv/png files -> manifest -> latent dataset -> 2 training steps, on
CPU with a tiny random-init Wan VAE and a 1-layer umT5 saved with save_pretrained (no downloads). Frame
mapping, the latent normalisation round trip, resume, the errors file and a 2-rank run."""
import argparse
import json
import os
import shutil
import subprocess

import pytest

av = pytest.importorskip("av")
np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from test_dataset_scan import read_jsonl, scan_args, write_video  # noqa: E402

from ds_adaptiveload.data import encode, frames, scan  # noqa: E402
from ds_adaptiveload.errors import UserError  # noqa: E402
from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402
from tests.launcher import BIN, DEEPSPEED, launcher_env, master_port, needs_launcher  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_DIM, TEXT_LEN = 64, 32  # configs/wan_tiny.yaml: text_dim, text_len


def tiny_models(d):
    """Random-init AutoencoderKLWan (16 latent channels, like Wan's) and UMT5EncoderModel (d_model =
    wan_tiny's text_dim) with a character-level tokenizer, saved as the Wan2.1 diffusers repo lays them out."""
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1).save_pretrained(d / "vae")
    cfg = UMT5Config(vocab_size=48, d_model=TEXT_DIM, d_kv=32, d_ff=64, num_layers=1, num_heads=2,
                     relative_attention_num_buckets=8)
    UMT5EncoderModel(cfg).save_pretrained(d / "text_encoder")
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{c: 3 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,")}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(d / "tokenizer")
    return d


CAPTIONS = {"a.mp4": "a red  bar\nmoves right", "sub/b.mkv": "b", "c.png": "", "d.mp4": "broken later"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Models, a captioned folder, its manifest (max 5 frames: the CPU VAE is slow) and one encoding."""
    d = tmp_path_factory.mktemp("enc")
    tiny_models(d)
    media = d / "media"
    (media / "sub").mkdir(parents=True)
    write_video(media / "a.mp4", "mpeg4", 16, 6, 96, 64)          # 5 frames, 272x368
    write_video(media / "sub" / "b.mkv", "ffv1", 24, 9, 64, 112)  # 9 @ 24 -> 6 @ 16 -> 5 frames, 416x240
    write_video(media / "c.png", "png", 1, 1, 100, 50, pix_fmt="rgb24", fmt="image2")
    write_video(media / "d.mp4", "mpeg4", 16, 6, 64, 64)
    for sid, text in CAPTIONS.items():
        (media / sid).with_suffix(".txt").write_text(text)
    raw = d / "raw.jsonl"
    scan.run(scan_args(media, raw, workers=1, max_frames=5, allow_empty_caption=True))
    (media / "d.mp4").write_bytes(b"\0" * 300)  # broken after the scan: encode must list it and go on
    out = d / "out"
    assert encode.run(encode_args(d, raw, out, shard_size=2)) == 0
    return dict(dir=d, raw=raw, out=out)


def encode_argv(d, raw, out, **kw):
    argv = ["--manifest", str(raw), "--vae", str(d / "vae"), "--text-encoder", str(d / "text_encoder"),
            "--tokenizer", str(d / "tokenizer"), "--out", str(out), "--dtype", "fp32", "--text-len", str(TEXT_LEN),
            "--decode-workers", "1"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def encode_args(d, raw, out, **kw):
    p = argparse.ArgumentParser()
    encode.add_arguments(p)
    return p.parse_args(encode_argv(d, raw, out, **kw))


def load_shards(out):
    from safetensors.torch import load_file
    # Copies: load_file maps the file, and the test then overwrites it.
    return {name: {k: v.clone() for k, v in load_file(out / name).items()}
            for name in sorted(os.listdir(out)) if name.endswith(".safetensors")}


# ---------------------------------------------------------------------------------------------------- frames


def test_source_indices_are_nearest_frames():
    assert frames.source_indices(5, 16, 24) == [0, 2, 3, 5, 6]  # t = i/16 -> 1.5 i source frames
    assert frames.source_indices(5, 16, 8) == [0, 1, 1, 2, 2]   # slower source: frames repeat
    assert frames.source_indices(3, 16, 16) == [0, 1, 2]
    assert frames.source_indices(3, None, None) == [0, 1, 2]
    assert frames.cover_size(64, 96, 272, 368) == (272, 408)    # height covers, width cropped
    assert frames.cover_size(112, 64, 416, 240) == (420, 240)


def test_decode_follows_the_manifest_mapping(tmp_path):
    path = tmp_path / "gray.mkv"
    with av.open(str(path), "w") as c:  # lossless; frame i is gray level 20 i, left half black
        s = c.add_stream("ffv1", rate=24)
        s.width, s.height, s.pix_fmt = 128, 64, "yuv444p"
        for i in range(12):
            a = np.full((64, 128, 3), 20 * i, np.uint8)
            a[:, :64] = 0
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    rec = dict(path=str(path), kind="video", frames=5, height=240, width=416, fps=16.0,
               source=dict(fps=24.0))
    px = frames.decode_sample(rec)
    assert px.shape == (5, 240, 416, 3) and px.dtype == np.uint8
    # 128x64 covers 240x416 at 480x240 (x3.75): 32 columns cropped each side, the black half stays left.
    levels = px[:, 120, 300:400].mean(axis=(1, 2)) / 20
    assert np.allclose(levels, [0, 2, 3, 5, 6], atol=0.2)
    assert px[:, 120, :200].max() < 8
    # 9 frames need source frames [0, 2, 3, 5, 6, 8, 9, 11, 12]; 12 is one past the end (container rounding
    # allowed for): the last decoded frame repeats.
    levels9 = frames.decode_sample({**rec, "frames": 9})[:, 120, 300:400].mean(axis=(1, 2)) / 20
    assert np.allclose(levels9, [0, 2, 3, 5, 6, 8, 9, 11, 11], atol=0.2)
    with pytest.raises(frames.DecodeError, match="decodes 12 source frames"):
        frames.decode_sample({**rec, "frames": 13, "fps": 8.0})  # would need source frame 36
    x = frames.to_model_input(px)
    assert x.shape == (3, 5, 240, 416) and x.min() >= -1 and x.max() <= 1


def test_latent_normalisation_inverts_the_wan_pipeline(dataset):
    from diffusers import AutoencoderKLWan
    vae = AutoencoderKLWan.from_pretrained(dataset["dir"] / "vae")
    x = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    z = encode.encode_videos(vae, x)
    with torch.inference_mode():
        mu = vae.encode(x).latent_dist.mean
    # diffusers' WanPipeline before vae.decode (pipeline_wan.py): latents / (1 / std) + mean
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    assert torch.allclose(z / inv_std + mean, mu, atol=1e-5)
    assert not torch.allclose(z, mu, atol=1e-2)  # the normalisation is not the identity here


# ---------------------------------------------------------------------------------------------------- encode


def test_encode_writes_the_training_format(dataset):
    d, out = dataset["dir"], dataset["out"]
    from ds_adaptiveload.data.latents import check_samples
    from ds_adaptiveload.schedule.manifest import load_manifest

    recs = {r["id"]: r for r in read_jsonl(out / "manifest.jsonl")}
    assert list(recs) == ["a.mp4", "c.png", "sub/b.mkv"]  # manifest order, the broken file left out
    assert [(recs[i]["frames"], recs[i]["height"], recs[i]["width"]) for i in recs] == [
        (5, 272, 368), (1, 240, 416), (5, 416, 240)]
    assert recs["a.mp4"]["caption"] == CAPTIONS["a.mp4"] and recs["a.mp4"]["latent_dtype"] == "bf16"
    errs = read_jsonl(out / "errors.jsonl")
    assert [e["id"] for e in errs] == ["d.mp4"] and "cannot open" in errs[0]["reason"]
    samples = load_manifest(out / "manifest.jsonl")
    assert check_samples(samples, out / "manifest.jsonl", Geometry(), TEXT_DIM) == []

    # The stored tensors are what the building blocks compute on this sample, in bf16.
    from diffusers import AutoencoderKLWan
    from safetensors import safe_open
    from transformers import AutoTokenizer, UMT5EncoderModel
    vae = AutoencoderKLWan.from_pretrained(d / "vae")
    te, tok = UMT5EncoderModel.from_pretrained(d / "text_encoder"), AutoTokenizer.from_pretrained(d / "tokenizer")
    r = recs["sub/b.mkv"]
    with safe_open(out / r["shard"], framework="pt") as f:
        lat, text = f.get_tensor(r["latent_key"]), f.get_tensor(r["text_key"])
    assert lat.shape == (16, *Geometry().latent_shape(5, 416, 240)) and lat.dtype == torch.bfloat16
    want = encode.encode_videos(vae, frames.to_model_input(frames.decode_sample(r))[None])[0]
    assert torch.allclose(lat.float(), want, atol=0.02 * want.abs().max())
    assert text.shape == (2, TEXT_DIM)  # "b" + </s>, unpadded
    assert torch.allclose(text.float(), encode.encode_texts(te, tok, ["b"], TEXT_LEN, "cpu")[0], atol=0.05)
    with safe_open(out / recs["c.png"]["shard"], framework="pt") as f:
        assert f.get_tensor("c.png/text").shape == (1, TEXT_DIM)  # empty caption: </s> only
        # Cleaned as WanPipeline cleans prompts: "a red bar moves right" (21 characters) + </s>.
        assert f.get_tensor("a.mp4/text").shape == (22, TEXT_DIM)


def test_resume_skips_done_shards_and_rewrites_an_interrupted_one(dataset, tmp_path):
    d, out = dataset["dir"], tmp_path / "out"
    shutil.copytree(dataset["out"], out)
    before = load_shards(out)
    manifest = (out / "manifest.jsonl").read_text()
    stamp = {n: os.stat(out / n).st_mtime_ns for n in before}
    encode.run(encode_args(d, dataset["raw"], out, shard_size=2))  # nothing to do
    assert {n: os.stat(out / n).st_mtime_ns for n in before} == stamp
    data = (out / "shard-00001.safetensors").read_bytes()
    (out / "shard-00001.safetensors").write_bytes(data[: len(data) // 2])  # torn
    (out / "shard-00001.safetensors.partial").write_bytes(b"left by a killed run")
    (out / "manifest.jsonl").unlink()
    encode.run(encode_args(d, dataset["raw"], out, shard_size=2))
    assert os.stat(out / "shard-00000.safetensors").st_mtime_ns == stamp["shard-00000.safetensors"]
    after = load_shards(out)
    assert after.keys() == before.keys() and not (out / "shard-00001.safetensors.partial").exists()
    for name in before:
        assert before[name].keys() == after[name].keys()
        assert all(torch.equal(before[name][k], after[name][k]) for k in before[name])
    assert (out / "manifest.jsonl").read_text() == manifest
    with pytest.raises(UserError, match="text_len 32 -> 16"):
        encode.run(encode_args(d, dataset["raw"], out, shard_size=2, text_len=16))


def test_model_folders_of_a_diffusers_repo(dataset):
    """The fixture is laid out as the Wan2.1 diffusers repo: its root, or its vae/ and text_encoder/."""
    d = dataset["dir"]
    want = (str(d / "vae"), str(d / "text_encoder"), str(d / "tokenizer"))
    for vae, te in ((d, d), (d / "vae", d / "text_encoder")):
        args = argparse.Namespace(vae=str(vae), text_encoder=str(te), tokenizer=None)
        assert tuple(os.path.normpath(x) for x in encode.model_folders(args)) == want


def test_bad_inputs(dataset, tmp_path):
    d, raw = dataset["dir"], dataset["raw"]
    with pytest.raises(UserError, match="--vae .*: not a folder"):
        encode.run(encode_args(d, raw, tmp_path / "o", vae=tmp_path / "nope"))
    with pytest.raises(UserError, match="--text-encoder .*: no config.json"):
        encode.run(encode_args(d, raw, tmp_path / "o", text_encoder=tmp_path))
    lines = raw.read_text().splitlines()
    rec = json.loads(lines[1])
    del rec["caption"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    with pytest.raises(UserError, match=rf"bad.jsonl:2: sample '{rec['id']}' has no caption"):
        encode.run(encode_args(d, bad, tmp_path / "o"))
    # Through the CLI as the deepspeed launcher calls it (--local_rank first): a one-line error, exit 2.
    from ds_adaptiveload import cli
    assert cli.main(["--local_rank=0", "encode", *encode_argv(d, bad, tmp_path / "o")]) == 2


@pytest.mark.slow
def test_two_ranks_write_the_same_dataset(dataset, tmp_path):
    """torchrun, 2 CPU processes over gloo: disjoint shards, one merged manifest equal to 1 rank's."""
    out = tmp_path / "out2"
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(master_port()), "-m",
           "ds_adaptiveload", "encode", *encode_argv(dataset["dir"], dataset["raw"], out, shard_size=1)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[encode rank 1/2] 2 samples encoded (0 errors)" in proc.stderr  # shards 1 and 3 of 0..3
    one = {r["id"]: r for r in read_jsonl(dataset["out"] / "manifest.jsonl")}
    two = {r["id"]: r for r in read_jsonl(out / "manifest.jsonl")}
    assert list(one) == list(two)
    assert [e["id"] for e in read_jsonl(out / "errors.jsonl")] == ["d.mp4"]
    from safetensors.torch import load_file
    for sid, r in two.items():
        a, b = load_file(dataset["out"] / one[sid]["shard"]), load_file(out / r["shard"])
        assert torch.equal(a[r["text_key"]], b[r["text_key"]])
        assert torch.allclose(a[r["latent_key"]].float(), b[r["latent_key"]].float(), atol=0.02)


@pytest.mark.slow
def test_encode_writes_the_empty_prompt_once(dataset):
    """OUT/empty_prompt.safetensors: "" as the text encoder sees it (</s> only), for caption dropout."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, UMT5EncoderModel

    d, out = dataset["dir"], dataset["out"]
    text = load_file(out / "empty_prompt.safetensors")["text"]
    te, tok = UMT5EncoderModel.from_pretrained(d / "text_encoder"), AutoTokenizer.from_pretrained(d / "tokenizer")
    want = encode.encode_texts(te, tok, [""], TEXT_LEN, "cpu")[0]
    assert text.dtype == torch.bfloat16 and text.shape == want.shape == (1, TEXT_DIM)
    assert torch.allclose(text.float(), want, atol=0.05)


@needs_launcher
def test_a_failure_on_one_rank_ends_every_rank_with_one_error(dataset, tmp_path):
    """Rank 1 cannot publish its shard (a folder holds the shard's name): every rank ends with the agreed error, one
    line naming the file, exit 2 from the launcher. Before, rank 1 left with a traceback (exit 1) while rank 0 died
    in the next barrier with gloo's "Connection closed by peer" traceback."""
    out = tmp_path / "out"
    (out / "shard-00001.safetensors").mkdir(parents=True)
    (out / "shard-00001.safetensors" / "x").write_text("not a shard")
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(master_port()), "--no_local_rank", "--module",
           "ds_adaptiveload", "encode", *encode_argv(dataset["dir"], dataset["raw"], out, shard_size=1)]
    env = launcher_env(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: IsADirectoryError"), proc.stderr[-4000:]
    assert str(out / "shard-00001.safetensors") in errors[0]
    assert not (out / "manifest.jsonl").exists()


@pytest.mark.slow
def test_train_two_steps_on_the_encoded_data(dataset, tmp_path):
    """launch/train_wan.py --data OUT/manifest.jsonl, the tiny model, one rank via the deepspeed launcher, with
    caption dropout (the empty prompt encode wrote) and the shipped CPU profile (its budget holds the 240p clips:
    780 tokens)."""
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["adaptive_load"]["caption_dropout"] = 0.5
    cfg["csv_monitor"]["enabled"] = False
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "1", "--master_port", str(master_port()), "launch/train_wan.py",
           "--deepspeed_config", str(tmp_path / "ds.json"), "--model-config", "configs/wan_tiny.yaml",
           "--data", str(dataset["out"] / "manifest.jsonl"), "--max-steps", "2", "--no-final-save",
           "--num-workers", "0", "--output", str(tmp_path / "run")]
    env = launcher_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    steps = read_jsonl(tmp_path / "run" / "steps.rank0.jsonl")
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)


@pytest.mark.slow
def test_a_33_frame_256px_clip_trains_with_the_shipped_cpu_config(tmp_path):
    """A user's first CPU run: 33-frame 256x256 clips (the 240p tier's 320x320: 3,600 tokens) through manifest,
    encode and 2 training steps with configs/ds_tiny_cpu.json exactly as shipped (profile auto: tiny-cpu.yaml,
    whose budget must hold the clip), from a folder outside the checkout."""
    tiny_models(tmp_path)
    media = tmp_path / "media"
    media.mkdir()
    for name in ("clip", "clip2"):  # two: the shipped config's G = 2 micro-batches need a sample each
        write_video(media / f"{name}.mp4", "mpeg4", 16, 33, 256, 256)
        (media / f"{name}.txt").write_text("a bar moves")
    raw, out = tmp_path / "raw.jsonl", tmp_path / "latents"
    scan.run(scan_args(media, raw, workers=1))
    recs = read_jsonl(raw)
    assert len(recs) == 2 and all((r["frames"], r["height"], r["width"]) == (33, 320, 320) for r in recs)
    assert Geometry().tokens(33, 320, 320) == 3600
    assert encode.run(encode_args(tmp_path, raw, out)) == 0
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "1", "--master_port", str(master_port()), "--module",
           "ds_adaptiveload", "train", "--deepspeed_config", "configs/ds_tiny_cpu.json", "--model-config",
           "configs/wan_tiny.yaml", "--data", str(out / "manifest.jsonl"), "--max-steps", "2", "--no-final-save",
           "--num-workers", "0", "--output", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "adaptive_load.profile auto: tiny-cpu" in proc.stdout  # rank 0 logs it at info
    steps = read_jsonl(tmp_path / "run" / "steps.rank0.jsonl")
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
    assert all(s["tokens"] == 7200 for s in steps)  # both clips, one per micro-batch (an epoch is one step)
