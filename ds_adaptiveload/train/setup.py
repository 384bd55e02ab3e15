"""The collective-free pieces of a training run's setup (trainer.py): config, the synthetic dataset, the
manifest, plan, sampler and dataset with the resume checks, reading one step, the end-of-run summary.
None issues a collective, so the Trainer runs each on every rank and agrees on its UserError
(failures.agreed): one error, every rank exits 2."""
import logging
import os
import sys

from ds_adaptiveload.errors import UserError

logger = logging.getLogger(__name__)


def read_config(args, world, rank, device=None):
    """The DeepSpeed JSON, its adaptive_load section, the model, the profile (chosen for and moved to this run's
    `device`: profile_for_run) and the self-attention kernels (--attention resolved: model/attention.resolve_attention)
    (no collectives: the caller agrees on the UserError)."""
    from types import SimpleNamespace

    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.model.attention import probed, resolve_attention
    from ds_adaptiveload.model.fp8 import check_fp8
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train import config, faults, sp
    from ds_adaptiveload.train.config import zero_stage

    ds_cfg, al = config.load_ds_config(args.deepspeed_config)
    al = config.lora_from_flags(args, al)  # --lora-rank and friends over adaptive_load.lora
    al = config.offload_from_flags(args, al, args.deepspeed_config)  # --activation-offload over the JSON's key
    al = config.fp8_from_flags(args, al, args.deepspeed_config)  # --fp8 over the JSON's key; not with LoRA
    check_fp8(al.fp8, device, "--fp8" if getattr(args, "fp8", None) else f"{args.deepspeed_config}: adaptive_load.fp8")
    blocks = getattr(args, "checkpoint_blocks", False)
    if al.activation_offload == "auto" and blocks != "auto":
        raise UserError(f"{args.deepspeed_config}: adaptive_load.activation_offload \"auto\" needs "
                        f"--checkpoint-blocks auto (or give an integer number of blocks)")
    if al.activation_offload != "off" and blocks is False:  # only a checkpointed block's input can move
        raise UserError(f"{args.deepspeed_config}: adaptive_load.activation_offload needs --checkpoint-blocks")
    dims = sp.ParallelDims(world=world, sp=ds_cfg.get("sequence_parallel_size", 1), rank=rank)
    if world % dims.sp:
        raise UserError(f"{args.deepspeed_config}: sequence_parallel_size {dims.sp} does not divide "
                        f"the world size {world}")
    # Skipping an update after backward relies on ZeRO-3 discarding a step whose gradient norm is NaN.
    stage = zero_stage(ds_cfg)
    if al.on_oom == "skip" and stage != 3:
        raise UserError(f"{args.deepspeed_config}: adaptive_load.on_oom \"skip\" needs zero_optimization.stage 3")
    if getattr(args, "checkpoint_policy", "full") == "attention" and stage == 3:
        # ZeRO-3's parameter hooks inside a block run other ops in the recompute than in the forward, which
        # selective checkpointing refuses (seen on CPU, 2026-12-01).
        raise UserError(f"{args.deepspeed_config}: --checkpoint-policy attention needs zero_optimization.stage 0-2 "
                        f"(ZeRO-3 gathers parameters inside the checkpointed block); use --checkpoint-policy full")
    check_compile_cache(args)
    changed = config.ds_batch_keys(ds_cfg, dims.dp)
    model_cfg = WanConfig.from_yaml(args.model_config)
    if type(blocks) is int and blocks > model_cfg.num_layers:
        raise UserError(f"--checkpoint-blocks {blocks}: more than the model's {model_cfg.num_layers} blocks "
                        f"({args.model_config} num_layers); give at most {model_cfg.num_layers}, or the flag alone "
                        f"for every block")
    gpu = gpu_of(device)
    path, lines = al.profile_path(args.deepspeed_config, model_cfg, stage, dims.sp, gpu)
    lora = model_cfg.lora_params(al.lora.rank, al.lora.modules()) if al.lora else None
    profile, moved = profile_for_run(CostProfile.load(path), stage, dims, path, gpu, lora)  # every rank: the same plan
    lines += moved
    lines += compile_mismatch(profile, getattr(args, "compile_blocks", None), path)
    attention, core = resolve_attention(getattr(args, "attention", "sdpa"), device, model_cfg.num_heads,
                                        model_cfg.head_dim)  # fa4 where it cannot run: agreed here
    if not agree_attention_later(args, device):
        lines += attention_mismatch(profile, attention, path)  # else warned by the trainer once the ranks agree
    fault = faults.Faults(args.fault, rank)
    for line in lines if rank == 0 else ():  # the profile chosen, moved: info; calibrated unlike this run: warning
        logger.log(logging.WARNING if line.startswith("warning:") else logging.INFO, f"[train_wan] {line}")
    if rank == 0 and changed:
        logger.info(f"[train_wan] batch keys set to count micro-batches (docs/training.md): "
                    f"{ {k: v for k, (_, v) in changed.items()} } "
                    f"(config had { {k: o for k, (o, _) in changed.items()} })")
    return SimpleNamespace(ds_cfg=ds_cfg, al=al, dims=dims, G=ds_cfg["gradient_accumulation_steps"],
                           model_cfg=model_cfg, profile=profile, profile_file=path, fault=fault, attention=attention,
                           attention_core=core, attention_times=probed(device, model_cfg.num_heads, model_cfg.head_dim))


def profile_for_run(profile, stage: int, dims, source: str = "profile", gpu=None, lora=None):
    """(profile, lines): the profile with its memory moved to this run's ZeRO `stage` and world size where it was
    calibrated for another (schedule/zero.for_run: what it moved, and what that leaves out), to this run's GPU where
    it was measured on one of another capacity (gpu: gpu_of's (name, capacity bytes); profile.for_device), and a
    warning where it was calibrated for another Ulysses degree, which no accounting fixes. lora: a LoRA run's adapter
    parameter count (None: full training): a profile of the other kind has its state bytes moved too."""
    from ds_adaptiveload.schedule.profile import for_device
    from ds_adaptiveload.schedule.zero import for_run

    profile, lines = for_run(profile, stage, dims.world, source, lora)
    if gpu is not None:
        profile, more = for_device(profile, gpu[1], gpu[0], source)
        lines += more
    sp = profile.meta.get("sp", dims.sp)
    if sp != dims.sp:
        # A profile's per-GPU terms depend on the SP degree (attention k x per GPU token, the all-to-all).
        lines.append(f"warning: the profile was calibrated for sp={sp}, this run has sp={dims.sp}: predictions and "
                     f"balance will be off (measured: -33% on the 1.3B model); calibrate with this config or derive "
                     f"one (bench/plan/sp_profile_check.py)")
    return profile, lines


def gpu_of(device):
    """(name, memory capacity in bytes) of a CUDA device, the keys a profile's meta.device and memory.capacity_bytes
    hold; None for any other device (a CPU run plans with the profile's memory as written)."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    return props.name, props.total_memory


def _compile_kind(k) -> str:
    """--compile-blocks' value (or meta.compile_blocks) -> none, block or regions (auto takes regions, as
    model/compile.compile_kind does; not imported here, since it imports torch)."""
    return "none" if k in (None, False, "none") else "regions" if k in (True, "auto") else str(k)


def compile_mismatch(profile, compile_blocks, source: str = "profile") -> list:
    """A warning line where the profile's meta.compile_blocks (what calibrate ran) differs from this run's
    --compile-blocks: compiled blocks run faster and keep other activations than eager ones, so the plan's times
    and its checkpointing are off. A profile that does not record it is left alone."""
    calibrated = profile.meta.get("compile_blocks")
    if calibrated is None or _compile_kind(calibrated) == _compile_kind(compile_blocks):
        return []
    want, have = (f"--compile-blocks {k}" if k != "none" else "no --compile-blocks"
                  for k in (_compile_kind(calibrated), _compile_kind(compile_blocks)))
    return [f"warning: {source} was calibrated with {want}, this run has {have}: its predicted times and memory "
            f"are for the other; run with {want}, or calibrate with this run's flags"]


def agree_attention_later(args, device) -> bool:
    """--attention auto on a GPU: each rank's timed choice is only a proposal; the ranks agree on the kernels once
    the model is built (Trainer.setup_model, model/attention.agreed), and the profile is compared with that."""
    return getattr(args, "attention", "sdpa") == "auto" and getattr(device, "type", None) == "cuda"


def attention_mismatch(profile, backend: str, source: str = "profile") -> list:
    """A warning line where the profile's meta.attention (the kernels calibrate ran) differs from this run's
    resolved backend (sdpa or fa4): on the H200 FA4 ran self-attention 11-17% faster than SDPA, so the profile's
    times are off by up to that share of a micro-batch. A profile that does not record it, or that records the
    flag "auto" (calibrate before it resolved the flag), is left alone."""
    calibrated = profile.meta.get("attention")
    if calibrated in (None, "auto") or calibrated == backend:
        return []
    return [f"warning: {source} was calibrated with --attention {calibrated}, this run's attention is {backend}: "
            f"its predicted times are for the other kernels; run with --attention {calibrated}, or calibrate with "
            f"--attention {backend}"]


def check_compile_cache(args) -> None:
    """--compile-cache FILE: only with --compile-blocks, not a folder, in a folder that exists and is writable
    (rank 0 rewrites it during the run; failing there, mid-run, would stop one rank only)."""
    path = getattr(args, "compile_cache", None)
    if not path:
        return
    if not getattr(args, "compile_blocks", False):
        raise UserError(f"--compile-cache {path}: only used with --compile-blocks")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"--compile-cache {path}: is a folder; give a file name")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UserError(f"--compile-cache {path}: folder {folder} does not exist or is not writable")


def write_synthetic(args, manifest, c, device, rank) -> None:
    """Rank 0: the --synthetic dataset under OUTPUT/synthetic (c: read_config's result)."""
    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.schedule.mixes import make_mix

    if rank != 0:
        return
    data.write_synthetic(os.path.dirname(manifest), make_mix(args.synthetic_mix, args.synthetic_num, c.al.seed),
                         text_dim=c.model_cfg.text_dim, max_text_len=c.model_cfg.text_len, seed=c.al.seed,
                         dtype="fp32" if device.type == "cpu" else "bf16", geometry=c.profile.geometry)


def prepare_data(args, manifest, c, world, rank):
    """Manifest, header check, plan, sampler, dataset, and the resume checks, all before DeepSpeed loads
    anything (no collectives: the caller agrees on the UserError)."""
    from types import SimpleNamespace

    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.schedule.memory import RecomputeCost
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler
    from ds_adaptiveload.train import checkpoint, ckpt_files
    from ds_adaptiveload.train.config import check_grad_accum, zero_stage

    al, geometry = c.al, c.profile.geometry
    external = getattr(args, "allow_external_shards", False)
    samples = load_manifest(manifest, geometry)
    # skip: samples found bad now leave the plan (every rank reads the same headers, so all agree)
    bad_upfront = data.check_samples(samples, manifest, geometry, c.model_cfg.text_dim, al.on_bad_sample, external)
    if bad_upfront:
        dropped = {id(s) for s, _ in bad_upfront}
        samples = [s for s in samples if id(s) not in dropped]
        if rank == 0:
            for _, reason in bad_upfront[:20]:
                logger.warning(f"[train_wan] skipped sample: {reason}")
            logger.warning(f"[train_wan] on_bad_sample=skip: {len(bad_upfront)} bad sample(s) left out of the plan, "
                           f"{len(samples)} remain")
        if not samples:
            raise UserError(f"{manifest}: every sample is bad")
    check_grad_accum(c.G, c.dims.dp, len(samples), f"{args.deepspeed_config}: gradient_accumulation_steps", manifest)
    stage = zero_stage(c.ds_cfg)
    ckpt = plan_checkpoint(args, stage)
    plan_cfg = al.plan_config(world, c.dims.sp, c.G, stage, **ckpt)
    sampler = AdaptiveSampler(samples, c.profile, plan_cfg, c.dims.dp_rank)
    # Bad samples found while reading come back as data ("bad"), so the loop can agree on them across ranks.
    dataset = data.LatentDataset(samples, manifest, geometry, c.model_cfg.text_len, c.model_cfg.text_dim,
                                 on_bad="skip", external_shards=external)
    # Only the keys that shape the plan: failure policies, LR scaling and loss weighting may change between a crash
    # and its resume (e.g. to skip what crashed it), and checkpoints from before a key existed keep loading.
    layout = {"world": world, "sp": c.dims.sp, "grad_accum": c.G, "adaptive_load": al.layout_keys(),
              "manifest_samples": len(samples)}
    if al.lora:  # a resume must train the same adapters (absent without LoRA: older checkpoints match)
        layout["lora"] = al.lora.model_dump()
    if ckpt["checkpoint"] != "all" and RecomputeCost.of(c.profile, ckpt["checkpoint_policy"]):
        layout["checkpoint"] = ckpt  # the plan costs recompute by it (absent otherwise: older checkpoints match)
    # a ZeRO stage or model DeepSpeed's files do not fit: refused before loading (absent in older checkpoints)
    layout.update(zero_stage=stage, model=c.model_cfg.to_dict())
    if args.resume and getattr(args, "overwrite", False):
        raise UserError(f"--resume {args.resume} and --overwrite: give one (--overwrite starts from step 0)")
    tags, notes = ckpt_files.candidates(args.resume) if args.resume else ([], [])
    if not tags and not notes:  # this run starts from step 0
        if getattr(args, "output", None):
            checkpoint.refuse_fresh_start(args.output, getattr(args, "overwrite", False))
        if args.resume and rank == 0:
            logger.warning(f"[train_wan] --resume {args.resume}: no checkpoint there yet, starting from step 0")
    return SimpleNamespace(samples=samples, bad_upfront=bad_upfront, sampler=sampler, dataset=dataset,
                           layout=layout, resume_tags=tags, resume_notes=notes)


def plan_checkpoint(args, stage: int) -> dict:
    """PlanConfig's checkpoint and checkpoint_policy for this run: with --checkpoint-blocks auto the planner costs
    the recompute each micro-batch's open blocks skip (under ZeRO-3 at the step's largest count, as the loader
    sets it); with every block, a fixed count or none, as the profile says."""
    policy = getattr(args, "checkpoint_policy", "full")
    if getattr(args, "checkpoint_blocks", False) != "auto":
        return {"checkpoint": "all", "checkpoint_policy": policy}
    return {"checkpoint": "auto-step" if stage == 3 else "auto", "checkpoint_policy": policy}


def read_micro_batches(batches, G, before=None, advice=None):
    """-> (the micro-batches read, None), or (..., (error line, exit code)) when reading failed on this rank (the
    caller agrees on it before any rank leaves the step). A DataLoader worker killed from outside (the kernel's OOM
    killer, a scheduler) is no bad input: its code is the lost peer's, 3, and its line ends with `advice` (default
    failures.RELAUNCH). before(): tests' fault, inside."""
    import traceback

    from ds_adaptiveload.train import failures

    mbs = []
    try:
        if before is not None:
            before()
        for _ in range(G):
            mbs.append(next(batches))
        return mbs, None
    except UserError as e:  # e.g. the sampler planned no steps, a bad sample in error mode
        return mbs, (failures.error_text(e), failures.EXIT_USER_ERROR)
    except Exception as e:  # a worker died or a bug: keep a bug's traceback, still end every rank together
        if failures.worker_killed(e):
            return mbs, (f"{failures.error_text(e)}; the data is not at fault: {advice or failures.RELAUNCH}",
                         failures.EXIT_PEER_LOST)
        traceback.print_exc()
        return mbs, (f"reading the step failed ({type(e).__name__}: {failures.error_text(e)})", failures.EXIT_FAILED)


def end_loop(batches, *closers) -> None:
    """The training loop's `finally`: run closers (the progress bar's line ends, so an error line starts a line),
    then stop the DataLoader's workers now (an exception's traceback would keep the iterator alive). While an
    error propagates, no SIGTERM or worker death may replace it (failures.hold_signals), and a worker already
    gone (ended by the launcher) is no new error."""
    from ds_adaptiveload.train.failures import hold_signals

    failing = sys.exc_info()[0] is not None
    if failing:
        hold_signals()
    for close in closers:
        close()
    if failing:
        kill_workers(batches)
        return
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def kill_workers(batches) -> None:
    """A failing rank's DataLoader workers: SIGKILLed and reaped, their index queues closed, without the iterator's
    own shutdown. That shutdown first sets a multiprocessing.Event whose lock the workers take for every index; a
    worker the launcher's SIGTERM ended inside it leaves the lock held for good, and the rank hung there (one run of
    test_the_launchers_sigterms_during_a_peer_failure_leave_one_line in 433). The workers' results are not wanted."""
    workers = getattr(batches, "_workers", None)
    if workers is None or getattr(batches, "_shutdown", True):
        return
    batches._shutdown = True  # the iterator's __del__ does not shut down again
    for w in workers:
        try:
            w.kill()
            w.join(timeout=5)
        except Exception:  # already reaped, or never started
            pass
    for q in getattr(batches, "_index_queues", ()):
        q.cancel_join_thread()  # nothing waits at exit for a pipe no worker reads
        q.close()
    if getattr(batches, "_worker_pids_set", False):
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False


def write_summary(out_dir, start, end, bad_upfront, skipped) -> None:
    """OUTPUT/skipped.json and one stderr line: what this launch left out and why."""
    import json

    doc = {"steps": [start + 1, end], "samples_left_out_of_plan": [{"id": s.id, "reason": r} for s, r in bad_upfront],
           "skipped_steps": skipped}
    with open(os.path.join(out_dir, "skipped.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if bad_upfront or skipped:
        reasons = {}
        for e in skipped:
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
        logger.warning(f"[train_wan] summary: {len(bad_upfront)} sample(s) left out of the plan, "
                       f"{len(skipped)} step(s) skipped {reasons} ({sum(len(e['ids']) for e in skipped)} samples not "
                       f"trained); see {os.path.join(out_dir, 'skipped.json')}")


def offload_line(al, checkpoint_blocks, model_cfg, profile, sampler, recompute, meminfo="/proc/meminfo"):
    """The start-up line of adaptive_load.activation_offload, (logging level, text), or None when it is off: how many
    blocks offload and the pinned host memory the plan's offloaded inputs hold on the rank that holds the most
    (schedule/offload.plan_pinned_bytes), against the profile's memory.host_bytes_per_rank, else this host's
    MemAvailable divided by its ranks (LOCAL_SIZE, set by the DeepSpeed launcher); a warning where it does not fit.
    The plan reads only the profile's key: every rank plans alike, whatever its host has free. recompute: the
    loader's RecomputeCost under --checkpoint-blocks auto (its counts), else None (a fixed count)."""
    from ds_adaptiveload.schedule.memory import plan_checkpoints
    from ds_adaptiveload.schedule.offload import input_bytes_per_token, plan_pinned_bytes

    setting = al.activation_offload
    if setting in ("off", 0):
        return None
    plan, in_bpt = sampler.plan, input_bytes_per_token(model_cfg.dim)
    if recompute is not None:
        ckpts = plan_checkpoints(plan, sampler.samples, profile.geometry, sampler.cfg, recompute)
        pinned = plan_pinned_bytes(plan, lambda s, r, m: ckpts[s, r, m][3], in_bpt)
        blocks = f"{min(c[3] for c in ckpts.values())}-{max(c[3] for c in ckpts.values())} blocks per micro-batch"
    else:
        n = min(setting, model_cfg.num_layers if checkpoint_blocks is True else int(checkpoint_blocks))
        pinned, blocks = plan_pinned_bytes(plan, lambda s, r, m: n, in_bpt), f"{n} blocks"
    host, where = profile.memory.get("host_bytes_per_rank"), "memory.host_bytes_per_rank"
    if host is None:
        host = host_available(meminfo)
        where = "MemAvailable / LOCAL_SIZE"
    text = (f"[train_wan] activation offload: {blocks} keep their input in pinned host memory, predicted "
            f"{_size(pinned)} of it per rank")
    text += f" ({where}: {_size(host)})" if host is not None else ""
    if host is not None and pinned > host:
        return logging.WARNING, (f"{text}: warning: more than the host holds; lower --activation-offload or set "
                                 f"the profile's memory.host_bytes_per_rank for auto to plan within it")
    return logging.INFO, text


def host_available(meminfo="/proc/meminfo"):
    """This host's MemAvailable in bytes divided by its ranks (LOCAL_SIZE or LOCAL_WORLD_SIZE, default 1), or None
    where unreadable."""
    try:
        with open(meminfo) as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    ranks = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"  # deepspeed's, torchrun's
    return kb * 1024 // max(1, int(ranks))


def _size(nbytes) -> str:
    """Bytes as GiB from 1 GiB up, else MiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def offload_stats(module, al) -> list:
    """[(blocks, bytes)] the micro-batch just run moved to host memory (model/offload.py stats) under
    adaptive_load.activation_offload; [] when it is off."""
    off = getattr(module, "_offload", None)
    if off is None or al.activation_offload in ("off", 0):
        return []
    stats = off.stats()
    return [(stats["tensors"], stats["bytes"])]


def offload_fields(offloaded) -> dict:
    """The step log's offload_blocks (per micro-batch) and offload_mib (over the step) of offload_stats' pairs."""
    if not offloaded:
        return {}
    return {"offload_blocks": [n for n, _ in offloaded], "offload_mib": round(sum(b for _, b in offloaded) / 2**20, 4)}
