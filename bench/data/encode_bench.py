"""Clips per second and peak memory of `encode` on one GPU: full-size Wan 2.1 VAE and umT5-XXL encoder with
RANDOM weights (the real ones cannot be downloaded here; speed and memory depend on the architecture, not
the values), built on the meta device and materialised in bf16 on the GPU.

    python bench/data/encode_bench.py --out bench/results/            # H200, < 4 min
    python bench/data/encode_bench.py --out /tmp/b --tiny               # CPU smoke run: tiny models, 240p 5f

Per setting (480p 81f, 720p 81f, 720p 81f with VAE tiling): a real H.264 clip of the source size is written,
then each of 1 warm-up + --samples clips is decoded with PyAV exactly as `encode` does (frames.py, on the
CPU) and encoded by ds_adaptiveload.data.encode's encode_videos / encode_texts (the command's own code
path; a 512-token caption, as the tokenizer pads every caption to text_len). One JSON goes into --out.
"""
import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time

T_START = time.perf_counter()  # the 4-minute limit counts from process start, imports included
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# umT5-XXL (google/umt5-xxl, Wan 2.1's text encoder): 24 layers, d_model 4096, 64 heads, ~5.7B encoder params.
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6)
UMT5_TINY = dict(vocab_size=64, d_model=64, d_kv=32, d_ff=64, num_layers=1, num_heads=2,
                 relative_attention_num_buckets=8)
VAE_TINY = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1)  # diffusers' defaults are Wan 2.1's
# name, (source height, width, fps, frames), bucket (frames, height, width), VAE tiling
SETTINGS = [("480p-81f", (480, 854, 24, 122), (81, 480, 832), False),
            ("720p-81f", (720, 1280, 24, 122), (81, 720, 1280), False),
            ("720p-81f-tiled", (720, 1280, 24, 122), (81, 720, 1280), True)]
TINY_SETTINGS = [("240p-5f", (240, 416, 16, 5), (5, 240, 416), False)]


def materialise(model, device, dtype):
    """Meta-device model -> real tensors on `device`; weights ~ N(0, 1/fan_in), norm gains 1, other
    vectors 0, so activations stay finite through the random network."""
    import torch

    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma") or (p.ndim == 1 and "norm" in name):  # WanRMS_norm gains are [C, 1, 1]
                p.fill_(1.0)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
            else:
                p.zero_()
    return model.to(dtype).eval()


def build_models(tiny, device, dtype):
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    t = time.perf_counter()
    with torch.device("meta"):
        vae = AutoencoderKLWan(**(VAE_TINY if tiny else {}))
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # materialise the 5.7B encoder directly in bf16
        try:
            te = UMT5EncoderModel(UMT5Config(**(UMT5_TINY if tiny else UMT5_XXL)))
        finally:
            torch.set_default_dtype(old)
    vae, te = materialise(vae, device, dtype), materialise(te, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return vae, te, time.perf_counter() - t


class RandomTokens:
    """Stands in for the umT5 tokenizer (not downloadable here): every caption becomes text_len random ids,
    the first `length` unmasked, padded as the real tokenizer pads."""

    def __init__(self, vocab, length):
        self.vocab, self.length = vocab, length

    def __call__(self, captions, max_length, **_):
        import torch

        ids = torch.randint(2, self.vocab, (len(captions), max_length))
        mask = torch.zeros_like(ids)
        mask[:, : min(self.length, max_length)] = 1
        return argparse.Namespace(input_ids=ids * mask, attention_mask=mask)


def write_clip(path, height, width, fps, n):
    import av
    import numpy as np

    base = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    with av.open(path, "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def time_setting(vae, te, name, src, bucket, tiling, samples, device, text_len, tmp, deadline):
    import torch

    from ds_adaptiveload.data import encode, frames

    (h, w, fps, n), (bf, bh, bw) = src, bucket
    path = os.path.join(tmp, f"{name}.mp4")
    write_clip(path, h, w, fps, n)
    rec = dict(path=path, kind="video", frames=bf, height=bh, width=bw, fps=16.0, source=dict(fps=float(fps)))
    tok = RandomTokens(te.config.vocab_size, 120)
    vae.use_tiling = False
    if tiling:
        vae.enable_tiling()
    cuda = device.type == "cuda"
    row = dict(setting=name, frames=bf, height=bh, width=bw, vae_tiling=tiling, samples=samples)
    times = {"decode_s": [], "vae_s": [], "text_s": []}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(1 + samples):  # the first is a warm-up (cuDNN autotuning, allocator growth)
        t0 = time.perf_counter()
        x = frames.to_model_input(frames.decode_sample(rec))[None].to(device)
        t1 = time.perf_counter()
        z = encode.encode_videos(vae, x)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        encode.encode_texts(te, tok, ["caption"], text_len, device)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(round(v, 4))
            if time.perf_counter() > deadline:  # keep the bench inside its limit: fewer clips, said so
                break
    samples = row["samples"] = len(times["vae_s"])
    row.update(times, latent_shape=list(z.shape[1:]), finite=bool(torch.isfinite(z).all()))
    gpu_s = sum(times["vae_s"]) / samples + sum(times["text_s"]) / samples
    row["clips_per_s"] = round(1.0 / gpu_s, 4)
    row["clips_per_s_with_serial_decode"] = round(1.0 / (gpu_s + sum(times["decode_s"]) / samples), 4)
    if cuda:
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    return row


def versions():
    import av
    import diffusers
    import torch
    import transformers

    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                diffusers=diffusers.__version__, transformers=transformers.__version__, av=av.__version__)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the result JSON")
    p.add_argument("--samples", type=int, default=2, help="timed clips per setting, after one warm-up")
    p.add_argument("--tiny", action="store_true", help="tiny models and a 240p 5-frame clip (CPU smoke run)")
    p.add_argument("--budget-s", type=float, default=180, help="seconds from start after which no further "
                   "clip is timed (at least one per setting started) and no setting starts; the bench must end "
                   "within 4 minutes")
    args = p.parse_args()
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae, te, build_s = build_models(args.tiny, device, dtype)
    weights_gib = None
    if device.type == "cuda":
        weights_gib = round(torch.cuda.memory_allocated(device) / 2**30, 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, src, bucket, tiling in TINY_SETTINGS if args.tiny else SETTINGS:
            if time.perf_counter() - T_START > args.budget_s:
                rows.append(dict(setting=name, skipped=f"--budget-s {args.budget_s:g} reached"))
                continue
            try:
                rows.append(time_setting(vae, te, name, src, bucket, tiling, args.samples, device, 512, tmp,
                                         T_START + args.budget_s))
            except torch.OutOfMemoryError as e:
                rows.append(dict(setting=name, vae_tiling=tiling, error=f"out of memory: {str(e)[:200]}"))
                torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    date = datetime.datetime.now(datetime.timezone.utc)
    result = dict(
        bench="encode", date=date.isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        versions=versions(), dtype=str(dtype).replace("torch.", ""), tiny=args.tiny,
        random_weights=True, cpu_threads=torch.get_num_threads(),
        params=dict(vae=sum(q.numel() for q in vae.parameters()), text_encoder=sum(q.numel() for q in te.parameters())),
        build_s=round(build_s, 1), weights_gib=weights_gib, rows=rows, total_s=round(time.perf_counter() - T_START, 1),
        note="RANDOM weights (Wan 2.1 VAE and umT5-XXL architectures, built on meta and materialised in "
             "bf16 on the GPU): speed and memory only. clips_per_s = 1 / (VAE + text encoder seconds per clip), "
             "what `encode` reaches when its decode threads keep up; decode_s is PyAV decoding + resize of the "
             "source clip on the CPU (one thread, serial here; `encode` overlaps it with --decode-workers). "
             "Peak memory includes the resident weights (weights_gib).")
    os.makedirs(args.out, exist_ok=True)
    tag = "cpu-tiny" if args.tiny else torch.cuda.get_device_name(device).split()[-1].lower()
    path = os.path.join(args.out, f"encode-{date:%Y-%m-%d}-{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} in {result['total_s']} s")


if __name__ == "__main__":
    main()
