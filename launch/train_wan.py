"""Train a Wan 2.1 DiT with DeepSpeed and the AdaptiveLoad scheduler (docs/training.md).

    deepspeed --num_gpus 8 launch/train_wan.py --deepspeed_config configs/ds_zero3_bf16.json \
        --model-config configs/wan_1_3b.yaml --data data/manifest.jsonl --max-steps 1000
    deepspeed --num_gpus 2 launch/train_wan.py --deepspeed_config configs/ds_tiny_cpu.json \
        --model-config configs/wan_tiny.yaml --synthetic --max-steps 4          # CPU smoke run

Reads top to bottom: distributed init -> config -> seed -> data/sampler -> model -> deepspeed.initialize
-> checkpoint resume -> loop.
"""
import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_adaptiveload.errors import UserError  # noqa: E402


def parse_args(argv=None):
    import deepspeed

    from ds_adaptiveload.schedule.mixes import MIXES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", required=True, help="WanConfig YAML (configs/wan_*.yaml)")
    p.add_argument("--data", help="training manifest (JSONL with shard/latent_key/text_key per sample)")
    p.add_argument("--synthetic", action="store_true",
                   help="write a synthetic latent dataset under OUTPUT/synthetic and train on it")
    p.add_argument("--synthetic-num", type=int, default=64, help="samples of the synthetic dataset")
    p.add_argument("--synthetic-mix", default="tiny", choices=sorted(MIXES),
                   help="shape mix of the synthetic dataset (mixes.py)")
    p.add_argument("--output", default="runs/train", help="step logs, checkpoints, synthetic data")
    p.add_argument("--max-steps", type=int, required=True, help="optimizer steps to reach (counting resumed ones)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--no-final-save", action="store_true", help="skip the checkpoint at the end (benchmarks)")
    p.add_argument("--resume", help="checkpoint folder to continue from (OUTPUT/checkpoints of a run)")
    p.add_argument("--checkpoint-blocks", action="store_true", help="per-block activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (engine.compile())")
    p.add_argument("--timestep-shift", type=float, default=5.0, help="Wan's shift s: t = s*u / (1 + (s-1)*u)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="per-GPU peak for MFU (H200 bf16 dense: 989)")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--prefetch-factor", type=int, default=2, help="micro-batches prefetched per worker")
    p.add_argument("--dump-grads", help=argparse.SUPPRESS)  # tests: params + gradients of the last step
    p.add_argument("--fault", action="append", help=argparse.SUPPRESS)  # tests: train/faults.py
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("--deepspeed_config is required")
    if bool(args.data) == args.synthetic:
        p.error("give exactly one of --data MANIFEST or --synthetic")
    return args


def train(args, state) -> None:
    """state.step: the step in progress, for the error of a lost peer (main)."""
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from tqdm import tqdm

    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.model import WanModel
    from ds_adaptiveload.train import checkpoint, failures, faults, flow, metrics, sp

    # -- distributed init: gloo on the CPU accelerator, nccl on CUDA -----------------------------------
    accel = get_accelerator()
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    failures.register_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if accel.device_name() == "cpu":
        device = torch.device("cpu")
        # Ranks share the host's cores; without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    else:
        accel.set_device(local_rank)
        device = torch.device(accel.device_name(local_rank))

    # -- config (every check before the first collective is agreed: one error, every rank exits 2) ------
    c = failures.agreed(read_config, args, world, rank)
    ds_cfg, al, dims, G, model_cfg, profile, fault = c.ds_cfg, c.al, c.dims, c.G, c.model_cfg, c.profile, c.fault
    mpu = sp.init_sequence_parallel(dims)

    # -- seed: same model init on every rank; noise/t are seeded per sample (flow.py) ----------------------
    torch.manual_seed(al.seed)

    # -- data / sampler / resume checks -------------------------------------------------------------------
    manifest = args.data
    if args.synthetic:
        manifest = os.path.join(args.output, "synthetic", "manifest.jsonl")
        failures.agreed(write_synthetic if rank == 0 else lambda *a: None, args, manifest, model_cfg, al, device,
                        profile)  # the agreement is the barrier before the other ranks read it
    d = failures.agreed(prepare_data, args, manifest, c, world, rank)
    samples, bad_upfront, sampler, stream, layout = d.samples, d.bad_upfront, d.sampler, d.stream, d.layout
    workers = max(0, args.num_workers)
    loader = torch.utils.data.DataLoader(d.dataset, batch_sampler=stream, collate_fn=data.first,
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         prefetch_factor=args.prefetch_factor if workers else None,
                                         worker_init_fn=functools.partial(failures.die_with_parent, os.getpid()))

    # -- model --------------------------------------------------------------------------------------------
    model = WanModel(model_cfg, checkpoint_blocks=args.checkpoint_blocks)
    seq_shard = sp.apply_ulysses(model, mpu, model_cfg.num_heads)

    # -- deepspeed.initialize -----------------------------------------------------------------------------
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=ds_cfg, mpu=mpu)
    if args.compile:
        engine.compile()
    divisor = sp.grad_divisor(engine, dims)  # what DeepSpeed divides summed gradients by
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    zero3 = engine.zero_optimization_stage() == 3

    # -- checkpoint resume (its layout was checked before deepspeed.initialize, prepare_data) ---------------
    start = 0
    if d.resume_tag:
        cs = failures.agreed(checkpoint.load, engine, args.resume, d.resume_tag, layout)  # raises after loading
        failures.agreed(sampler.load_state_dict, cs["sampler"][rank])
        start = cs["step"]
    ckpt_dir = os.path.join(args.output, "checkpoints")

    def save_if_due(step):
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
            checkpoint.save(engine, ckpt_dir, step + 1, plan_step.state, layout, fault)

    # -- loop -----------------------------------------------------------------------------------------------
    oom_error = faults.out_of_memory_error()
    log = metrics.StepLog(args.output, rank)
    skipped = []  # this launch's skipped steps, for the summary
    bar = tqdm(total=args.max_steps, initial=start, disable=rank != 0, desc="train", dynamic_ncols=True)
    batches = iter(loader)

    def micro_step(batch, weight):
        x0 = batch["latent"].to(device, dtype, non_blocking=True)
        text = batch["text"].to(device, dtype, non_blocking=True)
        eps, t = flow.draw_noise(x0, batch["index"], al.seed, plan_step.epoch, args.timestep_shift)
        per_sample = flow.flow_matching_loss(engine, x0, text, eps, t, seq_shard=seq_shard)
        engine.backward(per_sample.sum() * weight)
        return per_sample.detach()

    def stand_in():
        """After an OOM: a 1-sample, k-token micro-batch with zero weight, so this rank still issues the
        forward/backward collectives (ZeRO-3 gathers, gradient reduce-scatters) its peers issue."""
        x0 = torch.zeros(1, data.LATENT_CHANNELS, 1, 2, 2 * dims.sp, device=device, dtype=dtype)
        text = torch.zeros(1, model_cfg.text_len, model_cfg.text_dim, device=device, dtype=dtype)
        loss = flow.flow_matching_loss(engine, x0, text, torch.zeros_like(x0, dtype=torch.float32),
                                       torch.zeros(1, device=device), seq_shard=seq_shard)
        engine.backward(loss.sum() * 0.0)

    def skip_step(step, reason, detail, rec):
        """Every rank calls this with the same decision: log the skip with every rank's sample ids."""
        everyone = [None] * world
        dist.all_gather_object(everyone, {"ids": [i for ids, is_pad in rec["_mbs"] if not is_pad for i in ids],
                                          "detail": detail})
        ids = sorted({i for e in everyone[::dims.sp] for i in e["ids"]})
        details = [d for e in everyone for d in e["detail"]]
        entry = {"step": step + 1, "reason": reason, "ids": ids, "detail": details}
        skipped.append(entry)
        if rank == 0:
            print(f"[train_wan] step {step + 1} skipped on every rank ({reason}): "
                  f"{'; '.join(details) if details else ''} samples {ids}", file=sys.stderr, flush=True)
        return entry

    try:
        for step in range(start, args.max_steps):
            state.step = step + 1
            accel.synchronize()
            t_step = time.perf_counter()
            # The step's micro-batches are read before any compute, so a bad sample is agreed on (error on
            # every rank, or the step skipped on every rank) before any collective of the step.
            t0 = time.perf_counter()
            mbs, plan_step, read_err = read_step(batches, stream, G, step + 1, rank)
            data_ms = (time.perf_counter() - t0) * 1000
            bad = [(sid, why) for b in mbs for sid, why in b.get("bad", ())]
            fatal = read_err or (failures.bad_sample_message(step + 1, rank, bad)
                                 if bad and al.on_bad_sample != "skip" else None)
            n_bad, n_fatal = failures.sum_over_ranks([len(bad), fatal is not None], device)
            if n_fatal:
                failures.agree(fatal)  # raises on every rank
            for g, batch in enumerate(mbs):
                assert batch["index"] == plan_step.micro_batches[g], "loader and sampler out of step"
            step_ids = [(b["ids"], g in plan_step.pad) for g, b in enumerate(mbs)]
            base = {"step": step + 1, "epoch": plan_step.epoch, "plan_step": plan_step.step,
                    "ids": [b["ids"] for b in mbs], "pad": plan_step.pad}
            if n_bad:  # on_bad_sample "skip"
                entry = skip_step(step, "bad_sample", [f"{sid}: {why}" for sid, why in bad], {"_mbs": step_ids})
                log.write({**base, "skipped": entry})
                bar.update(1)
                save_if_due(step)
                continue

            compute_ms = 0.0
            counters = {"loss_sum": 0.0, "samples": 0, "tokens": 0, "flops": 0.0}
            nonfinite = torch.zeros((), device=device)
            seen, oom = [], []
            for g, batch in enumerate(mbs):
                pad = g in plan_step.pad
                t0 = time.perf_counter()
                weight = 0.0 if pad else flow.loss_scale(divisor, G, plan_step.global_samples)
                if not oom:
                    try:
                        fault.before_forward(step + 1, g)
                        per_sample = micro_step(batch, weight)
                    except oom_error as e:  # agreed after the step's micro-batches (error or skip)
                        oom.append(failures.oom_message(step + 1, rank, g, batch, samples, manifest, profile,
                                                        dims.sp, e))
                    if oom:  # outside the except block, so the failed forward's frames and tensors are gone
                        recover_after_oom(engine, accel, world)
                if oom:  # this rank's step is lost; keep issuing the collectives its peers issue
                    stand_in()
                else:
                    nonfinite += (~torch.isfinite(per_sample)).sum()
                    seen.append((batch["ids"], batch["index"], per_sample, pad))
                if g == 0:
                    fault.after_backward(step + 1)
                if args.dump_grads and g == G - 1 and step == args.max_steps - 1:
                    dump_grads(engine, args.dump_grads, rank, step + 1)
                if g < G - 1:
                    engine.step()  # inside the accumulation window: no optimizer update
                accel.synchronize()
                compute_ms += (time.perf_counter() - t0) * 1000
                if not pad and not oom:
                    S = profile.geometry.tokens(*_shape(samples[batch["index"][0]]))
                    counters["samples"] += len(batch["ids"])
                    counters["tokens"] += S * len(batch["ids"])
                    counters["flops"] += model_cfg.flops_per_sample(S) * len(batch["ids"])
            # One all-gather per step, before the optimizer update, so a non-finite loss or an OOM on any rank
            # is known to every rank before it reaches the weights.
            counters.update(loss_sum=float(sum(ps.sum() for _, _, ps, is_pad in seen if not is_pad)),
                            compute_ms=compute_ms, data_ms=data_ms, nonfinite=float(nonfinite), oom=float(bool(oom)))
            ranks = metrics.gather_counters(counters, device)
            reason = detail = None
            if any(r["oom"] for r in ranks):
                if al.on_oom != "skip":
                    failures.agree(oom[0] + failures.OOM_HINT if oom else None)  # raises on every rank
                reason, detail = "oom", oom
            elif any(r["nonfinite"] for r in ranks):
                if al.on_bad_sample != "skip" or not zero3:
                    failures.agree(failures.nonfinite_message(step + 1, rank, seen, samples, manifest))
                reason, detail = "nonfinite_loss", failures.nonfinite_samples(seen, samples, manifest)
            lr = engine.get_lr()[0]  # the rate this update uses (the scheduler advances inside step())
            entry = None
            if reason:
                entry = skip_step(step, reason, detail, {"_mbs": step_ids})
                failures.poison_gradients(engine)
                engine.step()  # ZeRO-3 sees a NaN gradient norm: discards the gradients, no update, LR unchanged
                if engine.was_step_applied():
                    raise RuntimeError(f"step {step + 1}: DeepSpeed applied an update that had to be skipped")
                if device.type == "cuda":
                    accel.empty_cache()
            else:
                engine.step()
            accel.synchronize()
            step_s = time.perf_counter() - t_step

            m = metrics.step_metrics(ranks, dims.sp, step_s, args.peak_tflops, device)
            m["pred_ms"] = list(plan_step.pred_ms)
            m["pred_wall_ms"] = plan_step.pred_wall_ms
            m["pred_idle_fraction"] = metrics.idle_fraction(plan_step.pred_ms, plan_step.pred_wall_ms)
            rec = {**base, "lr": lr, **m, "rank_loss": counters["loss_sum"] / max(counters["samples"], 1)}
            if entry:
                rec["skipped"] = entry
            log.write(rec)
            if engine.monitor.enabled and not entry:
                engine.monitor.write_events(metrics.monitor_events(m, step + 1, lr))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", sps=f"{m['samples_per_s']:.1f}", idle=f"{m['idle_fraction']:.2f}")
            save_if_due(step)
        bar.close()
        if start < args.max_steps and not args.no_final_save:
            checkpoint.save(engine, ckpt_dir, args.max_steps, plan_step.state, layout, fault)
        if rank == 0:
            write_summary(args.output, start, args.max_steps, bad_upfront, skipped)
    finally:  # every exit path: the bar's line ended (the error line starts a line), workers stopped
        bar.close()
        log.close()
        stop_workers(batches)
    dist.barrier()


def read_config(args, world, rank):
    """The DeepSpeed JSON, its adaptive_load section, the model and the profile (no collectives: the
    caller agrees on the UserError)."""
    from types import SimpleNamespace

    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train import config, faults, sp

    ds_cfg, al = config.load_ds_config(args.deepspeed_config)
    dims = sp.ParallelDims(world=world, sp=ds_cfg.get("sequence_parallel_size", 1), rank=rank)
    if world % dims.sp:
        raise UserError(f"{args.deepspeed_config}: sequence_parallel_size {dims.sp} does not divide "
                        f"the world size {world}")
    # Skipping an update after backward relies on ZeRO-3 discarding a step whose gradient norm is NaN.
    if al.on_oom == "skip" and ds_cfg.get("zero_optimization", {}).get("stage", 0) != 3:
        raise UserError(f"{args.deepspeed_config}: adaptive_load.on_oom \"skip\" needs zero_optimization.stage 3")
    changed = config.ds_batch_keys(ds_cfg, dims.dp)
    model_cfg = WanConfig.from_yaml(args.model_config)
    profile = CostProfile.load(al.resolve_profile(args.deepspeed_config))
    fault = faults.Faults(args.fault, rank)
    if rank == 0 and profile.meta.get("sp", dims.sp) != dims.sp:
        # A profile's per-GPU terms depend on the SP degree (attention k x per GPU token, the all-to-all).
        print(f"[train_wan] warning: the profile was calibrated for sp={profile.meta['sp']}, this run has "
              f"sp={dims.sp}: predictions and balance will be off (measured: -33% on the 1.3B model); "
              f"calibrate with this config or derive one (bench/sp_profile_check.py)", file=sys.stderr)
    if rank == 0 and changed:
        print(f"[train_wan] batch keys set to count micro-batches (docs/training.md): "
              f"{ {k: v for k, (_, v) in changed.items()} } (config had { {k: o for k, (o, _) in changed.items()} })")
    return SimpleNamespace(ds_cfg=ds_cfg, al=al, dims=dims, G=ds_cfg["gradient_accumulation_steps"],
                           model_cfg=model_cfg, profile=profile, fault=fault)


def write_synthetic(args, manifest, model_cfg, al, device, profile) -> None:
    """Rank 0: the --synthetic dataset under OUTPUT/synthetic."""
    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.schedule.mixes import make_mix

    data.write_synthetic(os.path.dirname(manifest), make_mix(args.synthetic_mix, args.synthetic_num, al.seed),
                         text_dim=model_cfg.text_dim, max_text_len=model_cfg.text_len, seed=al.seed,
                         dtype="fp32" if device.type == "cpu" else "bf16", geometry=profile.geometry)


def prepare_data(args, manifest, c, world, rank):
    """Manifest, header check, plan, sampler, dataset, and the resume checks, all before DeepSpeed loads
    anything (no collectives: the caller agrees on the UserError)."""
    from types import SimpleNamespace

    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.schedule.planner import PlanConfig
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler
    from ds_adaptiveload.train import checkpoint

    al, geometry = c.al, c.profile.geometry
    samples = load_manifest(manifest, geometry)
    # skip: samples found bad now leave the plan (every rank reads the same headers, so all agree)
    bad_upfront = data.check_samples(samples, manifest, geometry, c.model_cfg.text_dim, al.on_bad_sample)
    if bad_upfront:
        dropped = {id(s) for s, _ in bad_upfront}
        samples = [s for s in samples if id(s) not in dropped]
        if rank == 0:
            for _, reason in bad_upfront[:20]:
                print(f"[train_wan] skipped sample: {reason}", file=sys.stderr)
            print(f"[train_wan] on_bad_sample=skip: {len(bad_upfront)} bad sample(s) left out of the plan, "
                  f"{len(samples)} remain", file=sys.stderr)
        if not samples:
            raise UserError(f"{manifest}: every sample is bad")
    # ZeRO-2/3 synchronise ranks at every micro-batch (reduce-scatter / all-gather): plan rounds, not totals.
    lockstep = c.ds_cfg.get("zero_optimization", {}).get("stage", 0) >= 2
    plan_cfg = PlanConfig(policy=al.policy, world_size=world, sp=c.dims.sp, grad_accum=c.G, seed=al.seed,
                          on_oversize=al.on_oversize, window=al.window, fill=al.fill, lockstep=lockstep)
    sampler = AdaptiveSampler(samples, c.profile, plan_cfg, c.dims.dp_rank)
    # Bad samples found while reading come back as data ("bad"), so the loop can agree on them across ranks.
    dataset = data.LatentDataset(samples, manifest, geometry, c.model_cfg.text_len, c.model_cfg.text_dim,
                                 on_bad="skip")
    # The failure policies may change between a crash and the resume (e.g. to skip what crashed it).
    plan_keys = {k: v for k, v in al.to_dict().items() if k not in ("on_bad_sample", "on_oom")}
    layout = {"world": world, "sp": c.dims.sp, "grad_accum": c.G, "adaptive_load": plan_keys,
              "manifest_samples": len(samples)}
    tag = checkpoint.find(args.resume) if args.resume else None
    if tag:
        checkpoint.check_layout(args.resume, tag, layout)
    elif args.resume and rank == 0:
        print(f"[train_wan] --resume {args.resume}: no checkpoint there yet, starting from step 0",
              file=sys.stderr)
    return SimpleNamespace(samples=samples, bad_upfront=bad_upfront, sampler=sampler, dataset=dataset,
                           stream=data.MicroBatchStream(sampler), layout=layout, resume_tag=tag)


def read_step(batches, stream, G, step, rank):
    """-> (the step's G micro-batches, its PlannedStep, None) or (..., None, error line) when reading
    failed on this rank (the caller agrees on it before any rank leaves the step)."""
    import traceback

    from ds_adaptiveload.train.failures import error_text

    mbs = []
    try:
        for _ in range(G):
            mbs.append(next(batches))
        return mbs, stream.pending.popleft(), None
    except UserError as e:  # e.g. the sampler planned no steps
        return mbs, None, f"step {step}, rank {rank}: {error_text(e)}"
    except Exception as e:  # a worker died or a bug: keep its traceback, still end every rank together
        traceback.print_exc()
        return mbs, None, f"step {step}, rank {rank}: reading the step failed ({type(e).__name__}: {error_text(e)})"


def stop_workers(batches) -> None:
    """Stop the DataLoader's workers now; an exception's traceback would keep the iterator alive."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _shape(s):
    return s.frames, s.height, s.width


def dump_grads(engine, path, rank, step):
    """Tests: full fp32 parameters and the accumulated gradients of `step` (before clipping and the
    update), so a single process can recompute that step's gradient. Collective under ZeRO-3."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    params, grads = {}, {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        params[n] = (p if full is None else full).detach().float().cpu().clone()
        grads[n] = safe_get_full_grad(p).detach().float().cpu().clone()
    if rank == 0:
        torch.save({"step": step, "params": params, "grads": grads}, path)


def recover_after_oom(engine, accel, world) -> None:
    """Free what the failed micro-batch held. With one rank under ZeRO-3, an exception inside forward
    leaves gathered parameters and a half-recorded module trace: release them and end the trace step.
    With several ranks that release would make this rank gather parameters its peers keep (persistent
    ones), so its collectives would no longer match theirs; it is left out (docs/reliability.md: an OOM
    after the micro-batch's first collective cannot be recovered with several ranks)."""
    import gc

    gc.collect()
    if world == 1 and engine.zero_optimization_stage() == 3:
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        coordinator.release_and_reset_all(engine.module)
        coordinator.reset_step()
    accel.empty_cache()


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
        print(f"[train_wan] summary: {len(bad_upfront)} sample(s) left out of the plan, {len(skipped)} step(s) "
              f"skipped {reasons} ({sum(len(e['ids']) for e in skipped)} samples not trained); "
              f"see {os.path.join(out_dir, 'skipped.json')}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    import faulthandler
    import signal
    from types import SimpleNamespace

    # A rank stuck in a collective: `kill -USR1 <pid>` prints its Python stacks (docs/reliability.md).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from ds_adaptiveload.train import failures
    from ds_adaptiveload.train.config import default_alloc_conf

    default_alloc_conf()  # before anything touches CUDA
    args = parse_args(argv)
    state = SimpleNamespace(step=None)
    signal.signal(signal.SIGTERM, failures.on_sigterm)
    try:
        train(args, state)
        return 0
    except (Exception, failures.Terminated) as e:  # bad input, a lost peer, SIGTERM: one line; else re-raised
        return failures.report(e, state.step)
    finally:
        failures.teardown()


if __name__ == "__main__":
    sys.exit(main())
