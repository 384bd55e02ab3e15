"""--preview-every N: every N steps, the current weights rendered into OUTPUT/samples/step{N}.mp4 by diffusers'
WanPipeline (sample_cli.py), on rank 0, while the other ranks wait."""
import os


def add_arguments(p) -> None:
    p.add_argument("--preview-every", type=int, default=0, help="render a clip every N steps on rank 0 into "
                   "OUTPUT/samples (diffusers' WanPipeline; needs --preview-prompt, --vae, --text-encoder)")
    p.add_argument("--preview-prompt", help="the prompt of the preview clips")
    p.add_argument("--vae", help="diffusers AutoencoderKLWan folder (or the Wan2.1 diffusers repo) for previews")
    p.add_argument("--text-encoder", help="transformers UMT5EncoderModel folder (or the repo) for previews")
    p.add_argument("--tokenizer", help="tokenizer folder (default: beside or inside --text-encoder)")
    p.add_argument("--preview-frames", type=int, default=33, help="frames of a preview: 4k + 1 (default 33)")
    p.add_argument("--preview-height", type=int, default=480, help="multiple of 16 (default 480)")
    p.add_argument("--preview-width", type=int, default=832, help="multiple of 16 (default 832)")
    p.add_argument("--preview-steps", type=int, default=30, help="sampler steps of a preview (default 30)")


def check_arguments(args) -> None:
    """UserError for a preview without what it needs (before any process group starts)."""
    if not args.preview_every:
        return
    from argparse import Namespace

    from ds_adaptiveload.data.encode import model_folders
    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.sample_cli import check_shape

    missing = [f for f, v in (("--preview-prompt", args.preview_prompt), ("--vae", args.vae),
                              ("--text-encoder", args.text_encoder)) if not v]
    if args.preview_every < 0:
        raise UserError(f"--preview-every {args.preview_every}: must be a number of steps > 0")
    if missing:
        raise UserError(f"--preview-every {args.preview_every}: needs {', '.join(missing)}")
    check_shape(args.preview_frames, args.preview_height, args.preview_width, flag="--preview-")
    model_folders(Namespace(vae=args.vae, text_encoder=args.text_encoder, tokenizer=args.tokenizer))


def full_weights(module, rank: int) -> dict:
    """Collective under ZeRO-3 (one gather per parameter): our-named fp32 CPU weights on rank 0, {} elsewhere."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    out = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p]) if hasattr(p, "ds_tensor") else _nothing():
            if rank == 0:
                out[name.replace("_orig_mod.", "")] = p.detach().float().cpu().clone()
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def render(args, cfg, weights: dict, step: int, device) -> str:
    """Rank 0: OUTPUT/samples/step{step}.mp4 from `weights`; the pipeline is freed afterwards."""
    import torch

    from ds_adaptiveload import sample_cli as sc

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = sc.build_pipeline(sc.diffusers_transformer(cfg, weights, dtype), args.vae, args.text_encoder,
                             args.tokenizer, 3.0, dtype, device)
    video = sc.render(pipe, args.preview_prompt, "", args.preview_frames, args.preview_height, args.preview_width,
                      args.preview_steps, 5.0, 0, cfg.text_len, device)
    path = os.path.join(args.output, "samples", f"step{step}.mp4")
    sc.write_mp4(video, path)
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path
