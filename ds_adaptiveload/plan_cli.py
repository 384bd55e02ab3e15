"""`python -m ds_adaptiveload plan`: plan an epoch on the CPU and report its predicted balance.

A contract that scripts depend on: flags, the --dump line format and the --json summary keys only grow."""
import json
import logging
import time

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.flags import non_negative_int, positive_int
from ds_adaptiveload.schedule.memory import plan_checkpoints  # noqa: F401 (plan_cli.plan_checkpoints: tests)
from ds_adaptiveload.train.config import AdaptiveLoadConfig, add_flag, check_grad_accum, flag_name, offload_arg

logger = logging.getLogger(__name__)


def add_arguments(p):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", help="JSONL manifest: id, frames, height, width per line")
    src.add_argument("--mix", metavar="NAME:N", help="a built-in synthetic mix instead, e.g. video-heavy:100000")
    p.add_argument("--profile", required=True,
                   help="cost profile YAML, or the name of a shipped one (e.g. h100-wan1.3b-zero2; shipped.py)")
    p.add_argument("--world-size", type=positive_int, required=True, help="GPUs (data-parallel size = N / sp)")
    p.add_argument("--sp", type=positive_int, default=1, help="Ulysses sequence-parallel degree")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per rank per step (G)")
    # the flags of adaptive_load keys come from its schema (train/config.py), checked by it in run()
    for key in ("policy", "seed", "on_oversize", "window", "fill", "heavy_mix"):
        add_flag(p, key)
    p.add_argument("--epoch", type=non_negative_int, default=0)
    add_flag(p, "replicate", default="auto", choices=["auto", "on", "off"], type=None,
             help="packed: light samples in runs of R of one shape, so that a round's micro-batches are copies (auto: "
                  "when a micro-batch holds fewer than about 10 samples)")
    add_flag(p, "pack_tokens", metavar="N|auto", type=str)  # pack_tokens_arg reads it
    add_flag(p, "activation_offload", metavar="off|auto|N", type=str)  # with --checkpoint auto or auto-step
    p.add_argument("--lockstep", action="store_true",
                   help="ranks synchronise at every micro-batch (ZeRO-2/3; the trainer sets this from the "
                        "DeepSpeed config): plan and predict per micro-batch round")
    p.add_argument("--checkpoint", default="all", choices=["all", "auto", "auto-step"],
                   help="what the trainer checkpoints: all (the profile's times) | auto (train_wan --checkpoint-blocks "
                        "auto: micro-batches skip the recompute of the blocks their memory leaves open) | auto-step "
                        "(the same under ZeRO-3: the step's largest count everywhere); needs the profile's "
                        "time_ms.recompute_frac and memory.block_bytes_per_token")
    p.add_argument("--checkpoint-policy", default="full", choices=["full", "attention"],
                   help="with --checkpoint auto: train_wan's --checkpoint-policy")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="the run's ZeRO stage (default: the profile's meta.zero_stage): the profile's memory budget is "
                        "moved to this stage and --world-size, as the trainer does (schedule/zero.py)")
    p.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="plan for a GPU of this much memory (GiB, as torch reports its total memory): the profile's "
                        "budget and checkpointed blocks move there from its memory.capacity_bytes, as the trainer "
                        "does on such a GPU (profile.for_device); default: the profile's own GPU")
    p.add_argument("--dump", help="write one JSON line per micro-batch: step, rank, micro, ids (and with --checkpoint "
                                  "auto or auto-step, checkpoint: the [k, k_full, k_ffn] the trainer runs it at, and with "
                                  "--activation-offload the blocks that offload their input)")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON summary line")


def load_samples(args, geometry):
    if args.manifest:
        from ds_adaptiveload.schedule.manifest import load_manifest
        return load_manifest(args.manifest, geometry)
    from ds_adaptiveload.schedule.mixes import make_mix
    name, _, n = args.mix.partition(":")
    try:
        return make_mix(name, int(n or 10000), seed=args.seed)
    except ValueError as e:
        raise UserError(f"--mix {args.mix}: {e}") from None


def run(args):
    from ds_adaptiveload.schedule.memory import RecomputeCost
    from ds_adaptiveload.schedule.planner import make_plan
    from ds_adaptiveload.schedule.profile import CostProfile

    if args.dump:
        check_dump_path(args.dump)  # before planning: a wrong path fails in a second, not after the plan
    from ds_adaptiveload import shipped

    source = shipped.resolve(args.profile, "--profile")
    profile = CostProfile.load(source)
    samples = load_samples(args, profile.geometry)
    keys = {k: getattr(args, k) for k in ("profile", "policy", "seed", "on_oversize", "window", "fill", "heavy_mix")}
    keys.update(pack_tokens=pack_tokens_arg(args.pack_tokens),
                replicate={"auto": None, "on": True, "off": False}[args.replicate],
                activation_offload=offload_arg(args.activation_offload))
    al = AdaptiveLoadConfig.checked(keys, flag_name)
    cfg = al.plan_config(args.world_size, args.sp, args.grad_accum, lockstep=args.lockstep,
                         checkpoint=args.checkpoint, checkpoint_policy=args.checkpoint_policy)
    profile = run_profile(profile, args.zero_stage, args.world_size, source,  # after cfg checked --world-size
                          device_bytes(args.device_memory_gib))
    recompute = RecomputeCost.of(profile, args.checkpoint_policy) if args.checkpoint != "all" else None
    if recompute is not None and al.activation_offload != "off":
        recompute = with_offload(recompute, al.activation_offload, profile, source)
    if args.checkpoint != "all" and recompute is None:
        logger.warning(f"{source}: no time_ms.recompute_frac, memory.block_bytes_per_token, capacity_bytes or "
                       f"meta.model.num_layers: --checkpoint {args.checkpoint} costs every block checkpointed")
    check_grad_accum(args.grad_accum, args.world_size // args.sp, len(samples), "--grad-accum",
                     args.manifest or f"--mix {args.mix}")
    t0 = time.perf_counter()
    plan = make_plan(samples, profile, cfg, epoch=args.epoch)
    elapsed = time.perf_counter() - t0
    ckpts = plan_checkpoints(plan, samples, profile.geometry, cfg, recompute)
    summary = {**plan.summary(), "plan_seconds": round(elapsed, 3), "budget_tokens": profile.budget_tokens,
               "capacity_bytes": profile.memory.get("capacity_bytes"), "checkpoint_blocks": block_range(ckpts)}
    if plan.bound:  # each part of the lower bound, so a user sees how far the others are from binding
        parts = ("fixed_s", "work_s", "heaviest_s", "forced_s")
        summary["lower_bound_parts_s"] = {k[:-2]: plan.bound[k] for k in parts}
    if al.activation_offload != "off":  # the fewest and most blocks offloaded, beside the checkpointed ones
        summary["offload_blocks"] = block_range(ckpts, 3)
        summary.update(pinned_host_bytes=pinned_bytes(plan, ckpts, al.activation_offload, profile, source),
                       host_bytes_per_rank=profile.memory.get("host_bytes_per_rank"))
    if plan.skipped:
        ids = ", ".join(samples[i].id for i in plan.skipped[:5])
        logger.warning(f"skipped {len(plan.skipped)} oversize sample(s) (over {profile.budget_tokens} tokens per GPU): "
                       f"{ids}{' ...' if len(plan.skipped) > 5 else ''}")
    if args.dump:
        write_dump(args.dump, plan, samples, ckpts)
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0


def pack_tokens_arg(v):
    """--pack-tokens: None, "auto" or an int (the schema checks it is positive)."""
    if v is None or v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise UserError(f"--pack-tokens must be a positive integer or auto, got {v!r}") from None


def device_bytes(gib):
    """--device-memory-gib in bytes (None: not given)."""
    if gib is None:
        return None
    if not gib > 0 or gib == float("inf"):
        raise UserError(f"--device-memory-gib must be a positive number of GiB, got {gib}")
    return int(gib * 2**30)


def run_profile(profile, stage, world, source, capacity_bytes=None):
    """The profile as a run of `world` ranks under ZeRO `stage` (None: the profile's own) on a GPU of
    `capacity_bytes` (None: the profile's own) plans with it: its memory moved there (schedule/zero.for_run,
    profile.for_device), what moved said in an info line."""
    from ds_adaptiveload.schedule.profile import for_device
    from ds_adaptiveload.schedule.zero import calibrated_for, for_run

    if stage is not None and calibrated_for(profile) is None:
        logger.warning(f"{source}: no meta.zero_stage, meta.train_world_size, meta.model.params or memory bytes to "
                       f"move the budget with: --zero-stage {stage} leaves it as written")
    profile, notes = for_run(profile, stage, world, source)
    if capacity_bytes is not None:
        if not profile.memory.get("capacity_bytes") or not profile.memory.get("bytes_per_token"):
            notes.append(f"{source}: no memory.capacity_bytes or memory.bytes_per_token to move the budget with: "
                         f"--device-memory-gib leaves it as written")
        profile, more = for_device(profile, capacity_bytes, None, source)
        notes += more
    for line in notes:
        logger.info(line)
    return profile


def check_dump_path(path):
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"--dump {path}: is a folder; give a file path, e.g. {os.path.join(path, 'plan.jsonl')}")
    if not os.path.isdir(folder):
        raise UserError(f"--dump {path}: its folder does not exist ({folder})")


def write_dump(path, plan, samples, checkpoints=None):
    try:
        f = open(path, "w")
    except OSError as e:  # permissions, a folder created meanwhile
        raise UserError(f"--dump {path}: cannot write ({e.strerror})") from None
    with f:
        f.writelines(dump_lines(plan, samples, checkpoints))


def with_offload(recompute, setting, profile, source):
    """recompute planning --activation-offload `setting` (schedule/offload.attach), for the profile's model width."""
    from ds_adaptiveload.schedule.offload import attach, model_dim

    return attach(recompute, setting, model_dim(profile, source), profile)


def pinned_bytes(plan, ckpts, setting, profile, source):
    """--json's pinned_host_bytes: what the plan's offloaded block inputs hold of pinned host memory on the rank that
    holds the most (schedule/offload.plan_pinned_bytes): the counts of `ckpts` under --checkpoint auto, else an
    integer setting's on every block (checkpoint all)."""
    from ds_adaptiveload.schedule.offload import input_bytes_per_token, model_dim, plan_pinned_bytes

    in_bpt = input_bytes_per_token(model_dim(profile, source))
    if ckpts:
        return plan_pinned_bytes(plan, lambda s, r, m: ckpts[s, r, m][3] if len(ckpts[s, r, m]) > 3 else 0, in_bpt)
    num_layers = (profile.meta.get("model") or {}).get("num_layers")
    if setting == "auto" or not isinstance(num_layers, int):
        return 0
    return plan_pinned_bytes(plan, lambda s, r, m: min(setting, num_layers), in_bpt)


def block_range(checkpoints, at: int = 0):
    """--json's checkpoint_blocks: the fewest and most checkpointed blocks (k; at=3: offloaded blocks) over the plan's
    micro-batches, or None when the trainer checkpoints a fixed count."""
    ks = [c[at] for c in checkpoints.values() if len(c) > at] if checkpoints else None
    return [min(ks), max(ks)] if ks else None


def dump_lines(plan, samples, checkpoints=None):
    """The --dump lines of a plan, one JSON object per micro-batch (tests/plan_digests.py hashes them), with its
    checkpoint counts where `checkpoints` (plan_checkpoints) has them."""
    for s, step in enumerate(plan.steps):
        for r, mbs in enumerate(step):
            for m, mb in enumerate(mbs):
                rec = {"step": s, "rank": r, "micro": m, "ids": [samples[i].id for i in mb]}
                if (s, r, m) in plan.pad:
                    rec["pad"] = True
                if checkpoints:
                    rec["checkpoint"] = checkpoints[s, r, m]
                yield json.dumps(rec) + "\n"


def print_table(summary):
    rows = [("policy", summary["policy"]),
            ("GPUs / sp / data-parallel", f"{summary['world_size']} / {summary['sp']} / {summary['dp_size']}"),
            ("micro-batches per rank per step (G)", summary["grad_accum"]),
            ("steps", summary["steps"]),
            ("micro-batches", summary["micro_batches"]),
            ("samples planned / total / skipped",
             f"{summary['samples_planned']} / {summary['samples_total']} / {summary['samples_skipped']}"),
            ("pad micro-batches (epoch tail)", summary["pad_micro_batches"]),
            ("predicted idle fraction", f"{summary['idle_fraction']:.1%}"),
            ("step composition mix_tv", f"{summary['mix_tv']:.3f}"),
            ("predicted wall time", f"{summary['predicted_wall_s']:.1f} s"),
            ("planning time", f"{summary['plan_seconds']:.2f} s")]
    if summary.get("pack_tokens") is not None:
        rows.insert(5, ("micro-batch memory (pack_tokens)", f"{summary['pack_tokens']} tokens"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
