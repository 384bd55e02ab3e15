"""`python -m ds_adaptiveload calibrate`: the command's arguments and its run (measured, or --estimate)."""
import argparse

from ds_adaptiveload.calibrate.estimate import estimate_profile
from ds_adaptiveload.calibrate.grid import GRID_SHAPES, HELDOUT_SHAPES, parse_shapes
from ds_adaptiveload.calibrate.measure import measure_profile
from ds_adaptiveload.calibrate.packs import PACKS
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.fileio import read_json_object
from ds_adaptiveload.flags import positive_float
from ds_adaptiveload.model.config import ATTENTION_BACKENDS
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.train.config import add_lora_flags, lora_settings


def add_arguments(p):
    """The command's flags (documented in docs/calibration.md)."""
    p.add_argument("--model-config", required=True, help="WanConfig YAML (configs/wan_*.yaml)")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                   help="the DeepSpeed JSON the training run uses (ZeRO stage, bf16, optimizer, "
                        "sequence_parallel_size)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.add_argument("--estimate", action="store_true",
                   help="no GPU: write an analytic profile from the model's FLOPs and memory arithmetic")
    p.add_argument("--time-budget", type=float, default=300.0,
                   help="seconds for the whole measured calibration, start-up included (default 300)")
    p.add_argument("--safety", type=float, default=0.9, help="fraction of device memory the budget may use")
    p.add_argument("--checkpoint-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="per-block activation checkpointing, as the trainer's --checkpoint-blocks (default on)")
    p.add_argument("--compile-blocks", nargs="?", const="auto", default=None, metavar="KIND",
                   help="compile the blocks as the trainer's --compile-blocks KIND does (auto, block or regions), "
                        "so that time and memory are measured for the code training runs (default: eager)")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                   help="the self-attention kernels, as the trainer's --attention (model/attention.py)")
    p.add_argument("--train-world-size", type=int, default=None,
                   help="GPUs of the training run the budget is for (ZeRO-3 shards scale with 1/N); "
                        "default: this run's world size, at least sequence_parallel_size (--estimate: at least 2)")
    p.add_argument("--shapes", default=None,
                   help="fitted shapes FxHxW,... (default: 1x480x832 up to 81x720x1280)")
    p.add_argument("--heldout", default=None, help="held-out shapes FxHxW,... ('' for none)")
    p.add_argument("--batches", default=None, help="batch sizes to try per shape, e.g. 1,2,4,8 (default 1..64)")
    p.add_argument("--probe-tokens", type=int, default=None,
                   help="largest B*s (per-GPU tokens) probed per micro-batch (default: the largest shape's s)")
    p.add_argument("--probe-budget", action=argparse.BooleanOptionalAction, default=True,
                   help="after the fit, run one micro-batch at the extrapolated budget when time allows (an OOM "
                        "there lowers the budget)")
    p.add_argument("--open-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="after the fit, run a clip and a multi-sample point again with no block checkpointed (and a "
                        "clip keeping attention outputs, not under ZeRO-3): the memory.block_* fields and "
                        "time_ms.recompute_frac that --checkpoint-blocks auto plans with (calibrate/blocks.py)")
    p.add_argument("--packs", type=int, default=PACKS,
                   help=f"held-out packed micro-batches of mixed shapes measured after the fit to validate the "
                        f"planner's packed costing (default {PACKS}; 0 skips them and their time reserve)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point after one warm-up (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin-dual", action="store_true",
                   help="write the dual (p, m_comp) fitted over the calibrated range into the profile's dual: "
                        "section (default: only report it under fit:, and the planner derives it per dataset)")
    add_lora_flags(p)  # calibrate --lora-rank R: the LoRA step (adapters trained, base frozen) is what is measured
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    p.add_argument("--json", help="also write the raw measurements here (JSON)")
    # --estimate
    p.add_argument("--peak-tflops", type=positive_float, default=989.0,
                   help="--estimate: per-GPU peak (H200 bf16 dense)")
    p.add_argument("--mfu", type=float, default=0.5,
                   help="--estimate: achieved fraction of the peak (one 1.3B block reached 0.47-0.52 for S >= 7800)")
    p.add_argument("--device-memory-gib", type=float, default=141.0, help="--estimate: device memory (H200: 141)")
    p.add_argument("--link-gbs", type=float, default=200.0,
                   help="effective per-GPU link bandwidth GB/s for ZeRO-3 gathers and the Ulysses all-to-all "
                        "(--estimate, and measured runs on one GPU for a config with sequence_parallel_size > 1)")


def run(args) -> int:
    """Measure (or with --estimate, compute) the profile and write args.out through CostProfile.to_yaml."""
    from ds_adaptiveload.model import WanConfig

    cfg = WanConfig.from_yaml(args.model_config)
    ds = read_json_object(args.deepspeed_config, "DeepSpeed config")
    if not 0 < args.safety <= 1:
        raise UserError(f"--safety must be in (0, 1], got {args.safety}")
    if args.packs < 0:
        raise UserError(f"--packs must be >= 0, got {args.packs}")
    shapes = parse_shapes(args.shapes, "--shapes") if args.shapes is not None else GRID_SHAPES
    heldout = parse_shapes(args.heldout, "--heldout") if args.heldout is not None else HELDOUT_SHAPES
    if not shapes:
        raise UserError("--shapes: at least one shape is needed")
    args.lora = lora_settings(args, ds, args.deepspeed_config)
    if args.estimate and args.lora:
        raise UserError("--estimate models full training only; calibrate a LoRA step without --estimate")
    if args.estimate:
        prof = estimate_profile(cfg, ds, args)
    else:
        from ds_adaptiveload.train.config import default_alloc_conf

        default_alloc_conf()  # before the first CUDA allocation: the allocator the trainer uses
        from ds_adaptiveload.model.attention import resolve_attention

        # auto -> the kernels that will run, so meta.attention names them (the trainer compares it with its own)
        args.attention = resolve_attention(args.attention, None, cfg.num_heads, cfg.head_dim)[0]
        prof = measure_profile(cfg, ds, args, shapes, heldout)
        if prof is None:  # not rank 0 of a multi-rank calibration
            return 0
    prof.to_yaml(args.out)
    prof = CostProfile.load(args.out)  # what the planner will read: must load
    print(f"wrote {args.out}: fixed {prof.fixed_ms:.2f} ms, floor {prof.floor_ms:.1f} ms, per_token {prof.per_token_ms:.4g} ms, "
          f"per_token_sq {prof.per_token_sq_ms:.4g} ms, step_fixed {prof.step_fixed_ms:.1f} ms, "
          f"budget {prof.budget_tokens} tokens"
          + (f", dual p={prof.dual_p:.3f} m_comp={prof.dual_m_comp:.4g} (pinned)" if prof.dual_p else ""))
    return 0
