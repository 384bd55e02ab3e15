"""`python -m ds_adaptiveload sample`: a clip from a trained or exported transformer through diffusers' WanPipeline
(its sampler, text encoding and VAE decoding; none of our own), written as an mp4. The trainer's --preview-every
renders the same way on rank 0."""
import logging
import os
import time

from ds_adaptiveload.errors import UserError

logger = logging.getLogger(__name__)

FPS = 16  # Wan 2.1's frame rate


def add_arguments(p):
    p.add_argument("--checkpoint", required=True,
                   help="a run's OUTPUT/checkpoints (read directly, as `export` does), an `export` folder (diffusers "
                        "or wan), the original Wan 2.1 folder, or a diffusers transformer/ folder")
    p.add_argument("--tag", help="with a run's checkpoints: the one to sample (default: the one 'latest' names)")
    p.add_argument("--ema", action="store_true", help="with a run's checkpoints: sample the EMA of the weights")
    p.add_argument("--model-config", help="WanConfig YAML, for a run's checkpoint without model_config.json")
    p.add_argument("--vae", required=True, help="diffusers AutoencoderKLWan folder (or the Wan2.1 diffusers repo)")
    p.add_argument("--text-encoder", required=True, help="transformers UMT5EncoderModel folder (or the repo)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: beside or inside --text-encoder)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="", help="what classifier-free guidance steers away from")
    p.add_argument("--frames", type=int, default=81, help="frames: 4k + 1 (default 81)")
    p.add_argument("--height", type=int, default=480, help="multiple of 16 (default 480)")
    p.add_argument("--width", type=int, default=832, help="multiple of 16 (default 832)")
    p.add_argument("--steps", type=int, default=50, help="sampler steps (default 50)")
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale (default 5)")
    p.add_argument("--flow-shift", type=float, default=3.0,
                   help="the sampler's timestep shift (diffusers' Wan 2.1 advice: 3 at 480p, 5 at 720p)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--out", required=True, help="the .mp4 to write")


def check_shape(frames: int, height: int, width: int, flag="--") -> None:
    if frames < 1 or (frames - 1) % 4:
        raise UserError(f"{flag}frames {frames}: must be 4k + 1 (the VAE packs 4 frames after the first)")
    for name, v in (("height", height), ("width", width)):
        if v < 16 or v % 16:
            raise UserError(f"{flag}{name} {v}: must be a positive multiple of 16 (VAE 8 x patch 2)")


def weights_of(args):
    """(WanConfig, our-named fp32 state dict) of --checkpoint in any of its forms."""
    from types import SimpleNamespace

    from ds_adaptiveload.model import init_from

    path = args.checkpoint
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "latest")) or args.tag):
        from ds_adaptiveload.export_cli import load_weights

        cfg, _, weights = load_weights(SimpleNamespace(checkpoint=path, tag=args.tag, ema=args.ema,
                                                       model_config=args.model_config))
        return cfg, {k: v.contiguous().float() for k, v in weights.items()}
    from safetensors import safe_open

    from ds_adaptiveload.model import WanConfig

    src = init_from.open_source(path)
    if src.config is None:
        raise UserError(f"--checkpoint {path}: no config.json beside the weights")
    cfg = WanConfig.from_dict(init_from.wan_config_fields(src.config, src.config_path), source=src.config_path)
    weights = {}
    for name, (f, key, _) in src.tensors.items():
        with safe_open(str(f), framework="pt") as h:
            weights[name] = h.get_tensor(key).float()
    return cfg, weights


def diffusers_transformer(cfg, weights: dict, dtype):
    """diffusers' WanTransformer3DModel with our weights."""
    from diffusers import WanTransformer3DModel

    from ds_adaptiveload.model.convert import diffusers_config, to_diffusers

    model = WanTransformer3DModel(**diffusers_config(cfg))
    model.load_state_dict(to_diffusers(weights), strict=True)
    return model.to(dtype).eval()


def build_pipeline(transformer, vae, text_encoder, tokenizer, flow_shift: float, dtype, device):
    """WanPipeline with the Wan 2.1 sampler diffusers ships (UniPC on flow-matching sigmas)."""
    from argparse import Namespace

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ds_adaptiveload.data.encode import model_folders

    vae_dir, te_dir, tok_dir = model_folders(Namespace(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(tok_dir),
                       text_encoder=UMT5EncoderModel.from_pretrained(te_dir, dtype=dtype),
                       vae=AutoencoderKLWan.from_pretrained(vae_dir, torch_dtype=dtype),
                       transformer=transformer, scheduler=scheduler)
    return pipe.to(device)


def render(pipe, prompt, negative_prompt, frames, height, width, steps, guidance, seed, text_len, device):
    """Frames [F, H, W, 3] uint8 of one clip."""
    import numpy as np
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=frames,
               num_inference_steps=steps, guidance_scale=guidance, generator=g, output_type="np",
               max_sequence_length=text_len)
    video = np.asarray(out.frames[0])
    return (np.clip(video, 0.0, 1.0) * 255).round().astype(np.uint8)


def write_mp4(frames, path: str, fps: int = FPS) -> None:
    """H.264 (yuv420p) where the av build has it, else MPEG-4 Part 2."""
    import av

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(path, "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.height, s.width, s.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for f in frames:
            for packet in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)


def run(args) -> int:
    import torch

    check_shape(args.frames, args.height, args.width)
    if not args.out.endswith(".mp4"):
        raise UserError(f"--out {args.out}: give a .mp4 file name")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    cfg, weights = weights_of(args)
    pipe = build_pipeline(diffusers_transformer(cfg, weights, dtype), args.vae, args.text_encoder, args.tokenizer,
                          args.flow_shift, dtype, device)
    del weights
    video = render(pipe, args.prompt, args.negative_prompt, args.frames, args.height, args.width, args.steps,
                   args.guidance, args.seed, cfg.text_len, device)
    write_mp4(video, args.out)
    logger.info(f"[sample] {args.out}: {video.shape[0]} frames of {video.shape[2]}x{video.shape[1]} in "
                f"{time.perf_counter() - t0:.1f} s")
    return 0
