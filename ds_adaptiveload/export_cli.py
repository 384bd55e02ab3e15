"""`python -m ds_adaptiveload export`: a training checkpoint (ZeRO-0 to 3, read directly) to a diffusers
WanTransformer3DModel folder or the original Wan 2.1 layout (model/export.py), weights or their EMA."""
import os
import sys
import time

from ds_adaptiveload.errors import UserError


def add_arguments(p):
    from ds_adaptiveload.model.export import DTYPES, FORMATS

    p.add_argument("--checkpoint", required=True, help="the run's OUTPUT/checkpoints folder")
    p.add_argument("--tag", help="checkpoint to export, e.g. global_step1000 (default: the one 'latest' names)")
    p.add_argument("--format", required=True, choices=sorted(FORMATS),
                   help="diffusers: a folder WanTransformer3DModel.from_pretrained loads (a pipeline's "
                        "transformer/); wan: the original Wan 2.1 release's keys and config.json (Wan's repository, "
                        "ComfyUI)")
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
    if getattr(args, "ema", False):
        weights = export.read_ema(args.checkpoint, tag, cfg)
    else:
        weights = export.read_weights(args.checkpoint, tag, getattr(args, "trust_checkpoint", False))
    expected = _expected_keys(cfg)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise UserError(f"--checkpoint {os.path.join(args.checkpoint, tag)}: its parameters are not the model "
                        f"config's (missing {missing[:5]}, extra {extra[:5]}); give the run's --model-config")
    return cfg, tag, weights


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
    files = export.write(weights, cfg, args.format, args.out, args.dtype, args.max_shard_size)
    print(f"[export] {os.path.join(args.checkpoint, tag)}{' (EMA)' if args.ema else ''} -> {args.out}: "
          f"{args.format}, {args.dtype}, {len(files)} safetensors file(s), {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0
