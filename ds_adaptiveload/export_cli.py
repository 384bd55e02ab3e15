"""`python -m ds_adaptiveload export`: a training checkpoint (ZeRO-0 to 3, read directly) to a diffusers
WanTransformer3DModel folder or the original Wan 2.1 layout (model/export.py), weights or their EMA; a LoRA run's
adapters alone (lora-diffusers, lora-wan) or merged into its base (--merge; model/lora_export.py)."""
import logging
import os
import time

from ds_adaptiveload.errors import UserError

logger = logging.getLogger(__name__)


def add_arguments(p):
    from ds_adaptiveload.model.export import DTYPES, FORMATS
    from ds_adaptiveload.model.lora_export import LORA_FORMATS

    p.add_argument("--checkpoint", required=True, help="the run's OUTPUT/checkpoints folder")
    p.add_argument("--tag", help="checkpoint to export, e.g. global_step1000 (default: the one 'latest' names)")
    p.add_argument("--format", required=True, choices=sorted(FORMATS) + list(LORA_FORMATS),
                   help="diffusers: a folder WanTransformer3DModel.from_pretrained loads (a pipeline's "
                        "transformer/); wan: the original Wan 2.1 release's keys and config.json (Wan's repository, "
                        "ComfyUI); a LoRA run's adapters alone: lora-diffusers (pytorch_lora_weights.safetensors, "
                        "which WanPipeline.load_lora_weights loads) or lora-wan (wan_lora.safetensors, the original "
                        "Wan keys, which ComfyUI loads)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the base with the adapters merged in, in --format diffusers or wan")
    p.add_argument("--out", required=True, help="output folder (created; files of the same names are replaced)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the written weights (default bf16)")
    p.add_argument("--ema", action="store_true", help="export the EMA of the weights (adaptive_load.ema_decay)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file before the weights are sharded with an index (default 5GB)")
    p.add_argument("--model-config", help="WanConfig YAML, for a checkpoint without model_config.json")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read checkpoint files that need more than tensors and DeepSpeed's own types (this runs "
                        "code from the files: only for checkpoints whose origin you trust)")


def load_weights(args):
    """(WanConfig, name -> tensor or lazy tensor) of --checkpoint/--tag, the EMA with --ema."""
    from ds_adaptiveload.model import export

    tag = export.checkpoint_tag(args.checkpoint, args.tag)
    cfg = export.model_config(args.checkpoint, tag, args.model_config)
    ema = export.read_ema(args.checkpoint, tag, cfg) if getattr(args, "ema", False) else None
    if ema is None or lora_ema_only(ema):  # a LoRA run's EMA holds the adapters: the base comes from the weights
        weights = {**export.read_weights(args.checkpoint, tag, getattr(args, "trust_checkpoint", False)),
                   **(ema or {})}
    else:
        weights = ema
    weights = _lora(args, tag, weights)
    if args.format in ("lora-diffusers", "lora-wan"):
        return cfg, tag, weights
    expected = _expected_keys(cfg)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise UserError(f"--checkpoint {os.path.join(args.checkpoint, tag)}: its parameters are not the model "
                        f"config's (missing {missing[:5]}, extra {extra[:5]}); give the run's --model-config")
    return cfg, tag, weights


def lora_ema_only(ema: dict) -> bool:
    """Whether an EMA is a LoRA run's (train/ema.py averages the trainable weights: there, the adapters alone)."""
    from ds_adaptiveload.model import lora_export

    return lora_export.is_lora_checkpoint(ema) and not any(".base_layer." in k for k in ema)


def _lora(args, tag, weights) -> dict:
    """A LoRA checkpoint: merged into its base with --merge; kept as it is for a lora-* format (with its scale in
    args.lora_scale). A checkpoint without adapters: a lora-* format or --merge is an error."""
    from ds_adaptiveload.model import lora_export

    fmt, merge = args.format, getattr(args, "merge", False)
    if not lora_export.is_lora_checkpoint(weights):
        if fmt in lora_export.LORA_FORMATS or merge:
            raise UserError(f"--checkpoint {os.path.join(args.checkpoint, tag)}: holds no LoRA adapters (the run had no "
                            f"adaptive_load.lora); --format {fmt}{' --merge' if merge else ''} needs them")
        return weights
    if fmt in lora_export.LORA_FORMATS and merge:
        raise UserError(f"--merge writes the merged model in --format diffusers or wan, not {fmt}")
    if fmt not in lora_export.LORA_FORMATS and not merge:
        raise UserError(f"--checkpoint {os.path.join(args.checkpoint, tag)}: holds LoRA adapters; give --merge to "
                        f"write the merged model as {fmt}, or --format lora-diffusers / lora-wan for the adapters")
    args.lora_scale = lora_export.scale_of(args.checkpoint, tag, weights)
    return weights if fmt in lora_export.LORA_FORMATS else lora_export.merged(weights, args.lora_scale)


def _expected_keys(cfg) -> list:
    import torch

    from ds_adaptiveload.model import WanModel

    with torch.device("meta"):
        return list(WanModel(cfg).state_dict())


def run(args) -> int:
    from ds_adaptiveload.model import export

    t0 = time.perf_counter()
    cfg, tag, weights = load_weights(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out}: exists and is not a folder")
    if args.format in ("lora-diffusers", "lora-wan"):
        from ds_adaptiveload.model import lora_export

        files = lora_export.write(weights, args.lora_scale, args.format, args.out, args.dtype)
    else:
        files = export.write(weights, cfg, args.format, args.out, args.dtype, args.max_shard_size)
    logger.info(f"[export] {os.path.join(args.checkpoint, tag)}{' (EMA)' if args.ema else ''} -> {args.out}: "
                f"{args.format}, {args.dtype}, {len(files)} safetensors file(s), {time.perf_counter() - t0:.1f} s")
    return 0
