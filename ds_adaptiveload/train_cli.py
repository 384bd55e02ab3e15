"""`python -m ds_adaptiveload train`: train a Wan 2.1 DiT with DeepSpeed and the AdaptiveLoad scheduler
(docs/training.md); launch/train_wan.py runs the same.

    deepspeed --num_gpus 8 --module ds_adaptiveload train --deepspeed_config configs/ds_zero3_bf16.json \
        --model-config configs/wan_1_3b.yaml --data data/manifest.jsonl --max-steps 1000
    deepspeed --num_gpus 2 --module ds_adaptiveload train --deepspeed_config configs/ds_tiny_cpu.json \
        --model-config configs/wan_tiny.yaml --synthetic --max-steps 4          # CPU smoke run

The configs named here are the shipped ones, found outside a checkout too (shipped.py). A failure ends as one
`error:` line and an exit code (docs/reliability.md).
"""
import argparse
import logging
import sys

logger = logging.getLogger(__name__)


def _ckpt_blocks(value: str):
    """--checkpoint-blocks VALUE: 'auto' or a block count k >= 0 (the flag alone: every block); at most the model's
    layers, checked with the model config (train/setup.read_config)."""
    if value == "auto":
        return value
    try:
        blocks = int(value)
    except ValueError:
        blocks = -1
    if blocks < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a number of blocks >= 0, got {value!r}")
    return blocks


def _positive(value: str) -> int:
    """--keep-last K: a positive count."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of checkpoints, got {value!r}")
    return n


def add_arguments(p):
    """The trainer's flags, DeepSpeed's (--deepspeed_config) among them."""
    from ds_adaptiveload.train.config import default_alloc_conf

    default_alloc_conf()  # before anything touches CUDA (importing deepspeed may)
    import deepspeed

    from ds_adaptiveload import log
    from ds_adaptiveload.flags import non_negative_int, positive_float, positive_int
    from ds_adaptiveload.train.config import add_lora_flags

    _run_arguments(p)
    _checkpoint_arguments(p)
    _compute_arguments(p)
    add_lora_flags(p)  # --lora-rank, --lora-alpha, --lora-dropout, --lora-targets (adaptive_load.lora)
    p.add_argument("--timestep-shift", type=positive_float, default=5.0,
                   help="Wan's shift s: t = s*u / (1 + (s-1)*u)")
    p.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="per-GPU peak for MFU (H200 bf16 dense: 989)")
    p.add_argument("--num-workers", type=non_negative_int, default=2, help="DataLoader workers per rank")
    p.add_argument("--prefetch-factor", type=positive_int, default=2, help="micro-batches prefetched per worker")
    p.add_argument("--dump-grads", help=argparse.SUPPRESS)  # tests: params + gradients of the last step
    p.add_argument("--fault", action="append", help=argparse.SUPPRESS)  # tests: train/faults.py
    log.add_argument(p)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(p)


def _run_arguments(p):
    """Data, output, length of the run, validation and previews."""
    from ds_adaptiveload.flags import folder, non_negative_int, positive_int
    from ds_adaptiveload.schedule.mixes import MIXES
    from ds_adaptiveload.train import gpu_busy, preview

    p.add_argument("--model-config", required=True,
                   help="WanConfig YAML (configs/wan_*.yaml: the shipped ones are found outside a checkout too)")
    p.add_argument("--data", help="training manifest (JSONL with shard/latent_key/text_key per sample)")
    p.add_argument("--allow-external-shards", action="store_true",
                   help="read shards the manifest names outside its own folder (absolute paths, ../); refused "
                        "without this flag (docs/dataset.md)")
    p.add_argument("--synthetic", action="store_true",
                   help="write a synthetic latent dataset under OUTPUT/synthetic and train on it")
    p.add_argument("--synthetic-num", type=positive_int, default=64, help="samples of the synthetic dataset")
    p.add_argument("--synthetic-mix", default="tiny", choices=sorted(MIXES),
                   help="shape mix of the synthetic dataset (mixes.py)")
    p.add_argument("--output", default="runs/train", type=folder, help="step logs, checkpoints, synthetic data")
    p.add_argument("--max-steps", type=positive_int, required=True,
                   help="optimizer steps to reach (counting resumed ones)")
    p.add_argument("--save-every", type=non_negative_int, default=0,
                   help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--no-final-save", action="store_true", help="skip the checkpoint at the end (benchmarks)")
    p.add_argument("--resume", help="checkpoint folder to continue from (OUTPUT/checkpoints of a run)")
    p.add_argument("--init-from", metavar="DIR_OR_FILE",
                   help="start from pretrained weights: the original Wan 2.1 folder (diffusion_pytorch_model*.safetensors "
                        "and config.json, sharded with an index for 14B), a diffusers transformer/ folder, or an "
                        "`export` of a run; its config.json must match --model-config. Not with --resume")
    p.add_argument("--val-data", metavar="MANIFEST",
                   help="held-out latent manifest: its flow-matching loss at 8 fixed timesteps and fixed noise per "
                        "sample, at the start, every --val-every steps and at the end (val_loss in the step log, "
                        "OUTPUT/val.jsonl, the monitor's val/loss)")
    p.add_argument("--val-every", type=int, default=0, help="steps between validations (0: start and end only)")
    preview.add_arguments(p)
    gpu_busy.add_arguments(p)


def _checkpoint_arguments(p):
    """Checkpoint loading, saving and pruning."""
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load --resume's files with full unpickling, which can run code stored in them; without it a "
                        "file needing more than tensors and DeepSpeed's state types is refused (docs/reliability.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="start from step 0 although OUTPUT/checkpoints holds an earlier run's checkpoints, deleting them")
    p.add_argument("--keep-last", type=_positive, default=0, metavar="K",
                   help="after each save keep only the K newest checkpoints (never the one 'latest' names); default: all")


def _compute_arguments(p):
    """Activation checkpointing, attention kernels and torch.compile."""
    from ds_adaptiveload.model.config import ATTENTION_BACKENDS
    from ds_adaptiveload.train.config import add_flag

    p.add_argument("--checkpoint-blocks", nargs="?", const=True, default=False, type=_ckpt_blocks,
                   help="per-block activation checkpointing: every block; 'auto': per micro-batch, as many blocks "
                        "as its predicted peak memory needs (profile memory.block_bytes_per_token); an int k: the first k")
    add_flag(p, "activation_offload", default=None, type=str, metavar="off|auto|N")  # over the JSON's key
    p.add_argument("--checkpoint-policy", choices=("full", "attention"), default="full",
                   help="what a checkpointed block recomputes: everything (full), or all but its attention kernels, "
                        "whose outputs it keeps (attention: less recompute, ~3 KB/token more per attention call; "
                        "ZeRO-0/1/2 only). With auto, memory.attention_bytes_per_token sizes it")
    p.add_argument("--compile-blocks", nargs="?", const="auto", default=None, choices=("auto", "block", "regions"),
                   help="regional torch.compile, token counts dynamic (model/compile.py; inductor's mix-order reduction "
                        "off, pytorch/pytorch#193061): 'block' compiles each WanBlock whole (a graph per number of "
                        "shape groups), 'regions' its elementwise steps one by one (the same few graphs for any "
                        "packed micro-batch, and faster on the H200); auto (the bare flag): regions. "
                        "--compile compiles the engine")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                   help="the self-attention kernels: torch SDPA (cuDNN on Hopper), FlashAttention-4 (fa4: the optional "
                        "flash-attn-4 package; 11-17%% faster on the H200, docs/results.md), or auto: fa4 on a "
                        "Hopper GPU where the package imports, else sdpa (model/attention.py)")
    add_flag(p, "fp8", default=None)  # over the JSON's adaptive_load.fp8
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --compile-blocks (aot_eager: traced, no code generation)")
    p.add_argument("--compile-cache", help="file of compiled artifacts: loaded at start if present, rewritten after "
                                           "steps that compiled new graphs (a restart or a new machine compiles less)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (engine.compile())")


def check(args) -> None:
    """What argparse cannot say: the DeepSpeed JSON given, one data source; the JSON and model config found in the
    working directory or among the shipped configs (shipped.py)."""
    from ds_adaptiveload import shipped
    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.train import gpu_busy, preview

    if not args.deepspeed_config:
        raise UserError("--deepspeed_config is required")
    if bool(args.data) == args.synthetic:
        raise UserError("give exactly one of --data MANIFEST or --synthetic")
    if args.val_every < 0 or (args.val_every and not args.val_data):
        raise UserError(f"--val-every {args.val_every}: needs --val-data and a number of steps >= 0")
    preview.check_arguments(args)
    gpu_busy.parse_range(args.profile_steps)
    if args.init_from and args.resume:
        raise UserError("--init-from starts a new run from pretrained weights, --resume continues one: give one of them")
    for flag, key in (("--deepspeed_config", "deepspeed_config"), ("--model-config", "model_config")):
        found = shipped.find(getattr(args, key))
        if found is not None:
            setattr(args, key, found)  # else the reader's own error names the missing file


def parse_args(argv=None):
    """The flags; a bad one raises UserError (flags.Parser), which main agrees on with the other ranks."""
    from ds_adaptiveload.flags import Parser

    p = Parser(prog="python -m ds_adaptiveload train", description=__doc__.split("\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


def agreed_exit(error) -> int:
    """A bad flag (or check's error), found by every rank alone before the process group exists: each rank joins
    the group to agree on it, then rank 0 prints the one error line and every rank exits 2. A rank that exited at
    once would get its peers killed by the launcher, now and then before any printed. Call it outside the `except`
    block of `error`: the agreed error must not chain to the rank's own (failures.first_cause)."""
    import os

    from ds_adaptiveload.train import engine, failures

    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            engine.init_distributed()
        failures.agree(failures.error_text(error))  # every rank raises the same AgreedError here
        raise failures.AgreedError(failures.error_text(error))  # not reached
    except failures.AgreedError as e:
        return failures.report(e)
    finally:
        failures.teardown()


def fa4_hint(attention, e: BaseException):
    """A line for a CUDA or cuDNN RuntimeError in a run whose self-attention is FlashAttention-4 (one such error,
    in the cross-attention's cuDNN kernel, stopped an H100 run once and did not come back under
    CUDA_LAUNCH_BLOCKING=1: docs/training.md, Attention); None otherwise."""
    text = str(e)
    # torch raises a kernel's fault as RuntimeError or a subclass (torch.AcceleratorError); not so running out of memory
    if attention != "fa4" or not isinstance(e, RuntimeError) or type(e).__name__ == "OutOfMemoryError" or \
            not any(k in text for k in ("CUDA", "cuDNN", "cudnn", "mha_graph")):
        return None
    return ("[train_wan] this run's self-attention is FlashAttention-4: to tell whether the error below comes "
            "with it, run again with --attention sdpa (docs/training.md, Attention)")


def run(args) -> int:
    """check, then Trainer(args).train(); a failure ends as one `error:` line and an exit code (failures.report;
    check's UserError: agreed_exit)."""
    import faulthandler
    import signal

    from ds_adaptiveload.errors import UserError

    try:
        check(args)
    except UserError as e:
        error = e
    else:
        error = None
    if error is not None:
        return agreed_exit(error)

    # A rank stuck in a collective: `kill -USR1 <pid>` prints its Python stacks (docs/reliability.md).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from ds_adaptiveload.train import failures

    # Before the trainer's imports (seconds): a SIGTERM during them ended the rank silently, by its default action (-15)
    signal.signal(signal.SIGTERM, failures.on_sigterm)
    trainer = None
    try:
        from ds_adaptiveload.train.trainer import Trainer

        trainer = Trainer(args)
        trainer.train()
        return 0
    except (Exception, failures.Terminated) as e:  # bad input, a lost peer, SIGTERM: one line; else re-raised
        hint = fa4_hint(getattr(trainer, "attention", None), e)
        if hint:
            logger.warning(hint)
        return failures.report(e, trainer.step if trainer else None, getattr(trainer, "bar", None),
                               trainer.relaunch_advice() if trainer else failures.RELAUNCH)
    finally:
        failures.teardown()


def main(argv=None) -> int:
    """parse_args, then run: what launch/train_wan.py calls. A bad flag: agreed_exit."""
    from ds_adaptiveload.errors import UserError

    try:
        args = parse_args(argv)
    except UserError as e:
        error = e
    else:
        from ds_adaptiveload import log

        log.configure(args.log_level)
        return run(args)
    return agreed_exit(error)
