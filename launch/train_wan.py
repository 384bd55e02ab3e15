"""Train a Wan 2.1 DiT with DeepSpeed and the AdaptiveLoad scheduler (docs/training.md).

    deepspeed --num_gpus 8 launch/train_wan.py --deepspeed_config configs/ds_zero3_bf16.json \
        --model-config configs/wan_1_3b.yaml --data data/manifest.jsonl --max-steps 1000
    deepspeed --num_gpus 2 launch/train_wan.py --deepspeed_config configs/ds_tiny_cpu.json \
        --model-config configs/wan_tiny.yaml --synthetic --max-steps 4          # CPU smoke run

Reads top to bottom: distributed init -> config -> seed -> data/sampler -> model -> deepspeed.initialize
-> checkpoint resume -> loop.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_adaptiveload.errors import UserError  # noqa: E402


def parse_args(argv=None):
    import deepspeed

    from ds_adaptiveload.mixes import MIXES

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
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    if not args.deepspeed_config:
        p.error("--deepspeed_config is required")
    if bool(args.data) == args.synthetic:
        p.error("give exactly one of --data MANIFEST or --synthetic")
    return args


def train(args) -> None:
    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from tqdm import tqdm

    from ds_adaptiveload.manifest import load_manifest
    from ds_adaptiveload.model import WanConfig, WanModel
    from ds_adaptiveload.planner import PlanConfig
    from ds_adaptiveload.profile import CostProfile
    from ds_adaptiveload.sampler import AdaptiveSampler
    from ds_adaptiveload.train import checkpoint, config, data, flow, metrics, sp

    # -- distributed init: gloo on the CPU accelerator, nccl on CUDA -----------------------------------
    accel = get_accelerator()
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if accel.device_name() == "cpu":
        device = torch.device("cpu")
        # Ranks share the host's cores; without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    else:
        accel.set_device(local_rank)
        device = torch.device(accel.device_name(local_rank))

    # -- config -------------------------------------------------------------------------------------------
    ds_cfg, al = config.load_ds_config(args.deepspeed_config)
    dims = sp.ParallelDims(world=world, sp=ds_cfg.get("sequence_parallel_size", 1), rank=rank)
    if world % dims.sp:
        raise UserError(f"{args.deepspeed_config}: sequence_parallel_size {dims.sp} does not divide "
                        f"the world size {world}")
    mpu = sp.init_sequence_parallel(dims)
    changed = config.ds_batch_keys(ds_cfg, dims.dp)
    G = ds_cfg["gradient_accumulation_steps"]
    model_cfg = WanConfig.from_yaml(args.model_config)
    profile = CostProfile.load(al.resolve_profile(args.deepspeed_config))
    if rank == 0 and changed:
        print(f"[train_wan] batch keys set to count micro-batches (docs/training.md): "
              f"{ {k: v for k, (_, v) in changed.items()} } (config had { {k: o for k, (o, _) in changed.items()} })")

    # -- seed: same model init on every rank; noise/t are seeded per sample (flow.py) ----------------------
    torch.manual_seed(al.seed)

    # -- data / sampler -----------------------------------------------------------------------------------
    manifest = args.data
    if args.synthetic:
        manifest = os.path.join(args.output, "synthetic", "manifest.jsonl")
        if rank == 0:
            from ds_adaptiveload.mixes import make_mix

            data.write_synthetic(os.path.dirname(manifest), make_mix(args.synthetic_mix, args.synthetic_num, al.seed),
                                 text_dim=model_cfg.text_dim, max_text_len=model_cfg.text_len, seed=al.seed,
                                 dtype="fp32" if device.type == "cpu" else "bf16", geometry=profile.geometry)
        dist.barrier()
    samples = load_manifest(manifest, profile.geometry)
    data.check_samples(samples, manifest, profile.geometry, model_cfg.text_dim)
    plan_cfg = PlanConfig(policy=al.policy, world_size=world, sp=dims.sp, grad_accum=G, seed=al.seed,
                          on_oversize=al.on_oversize, window=al.window, fill=al.fill)
    sampler = AdaptiveSampler(samples, profile, plan_cfg, dims.dp_rank)
    dataset = data.LatentDataset(samples, manifest, profile.geometry, model_cfg.text_len, model_cfg.text_dim)
    stream = data.MicroBatchStream(sampler)
    workers = max(0, args.num_workers)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=stream, collate_fn=data.first, num_workers=workers,
                                         pin_memory=device.type == "cuda",
                                         prefetch_factor=args.prefetch_factor if workers else None)

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

    # -- checkpoint resume --------------------------------------------------------------------------------
    layout = {"world": world, "sp": dims.sp, "grad_accum": G, "adaptive_load": al.to_dict(),
              "manifest_samples": len(samples)}
    start = 0
    if args.resume:
        cs = checkpoint.load(engine, args.resume, layout)
        sampler.load_state_dict(cs["sampler"][rank])
        start = cs["step"]
    ckpt_dir = os.path.join(args.output, "checkpoints")

    # -- loop -----------------------------------------------------------------------------------------------
    log = metrics.StepLog(args.output, rank)
    bar = tqdm(total=args.max_steps, initial=start, disable=rank != 0, desc="train", dynamic_ncols=True)
    batches = iter(loader)
    for step in range(start, args.max_steps):
        accel.synchronize()
        t_step = time.perf_counter()
        compute_ms = data_ms = 0.0
        counters = {"loss_sum": 0.0, "samples": 0, "tokens": 0, "flops": 0.0}
        nonfinite = torch.zeros((), device=device)
        seen = []
        for g in range(G):
            t0 = time.perf_counter()
            batch = next(batches)
            data_ms += (time.perf_counter() - t0) * 1000
            if g == 0:
                plan_step = stream.pending.popleft()
            assert batch["index"] == plan_step.micro_batches[g], "loader and sampler out of step"
            pad = g in plan_step.pad
            t0 = time.perf_counter()
            x0 = batch["latent"].to(device, dtype, non_blocking=True)
            text = batch["text"].to(device, dtype, non_blocking=True)
            eps, t = flow.draw_noise(x0, batch["index"], al.seed, plan_step.epoch, args.timestep_shift)
            per_sample = flow.flow_matching_loss(engine, x0, text, eps, t, seq_shard=seq_shard)
            weight = 0.0 if pad else flow.loss_scale(divisor, G, plan_step.global_samples)
            engine.backward(per_sample.sum() * weight)
            if args.dump_grads and g == G - 1 and step == args.max_steps - 1:
                dump_grads(engine, args.dump_grads, rank, step + 1)
            if g < G - 1:
                engine.step()  # inside the accumulation window: no optimizer update
            per_sample = per_sample.detach()
            nonfinite += (~torch.isfinite(per_sample)).sum()
            seen.append((batch["ids"], batch["index"], per_sample, pad))
            accel.synchronize()
            compute_ms += (time.perf_counter() - t0) * 1000
            if not pad:
                S = profile.geometry.tokens(*_shape(samples[batch["index"][0]]))
                counters["samples"] += len(batch["ids"])
                counters["tokens"] += S * len(batch["ids"])
                counters["flops"] += model_cfg.flops_per_sample(S) * len(batch["ids"])
        # One all-gather per step, before the optimizer update, so a non-finite loss stops every rank
        # before it reaches the weights.
        counters.update(loss_sum=float(sum(ps.sum() for _, _, ps, is_pad in seen if not is_pad)),
                        compute_ms=compute_ms, data_ms=data_ms, nonfinite=float(nonfinite))
        ranks = metrics.gather_counters(counters, device)
        if any(r["nonfinite"] for r in ranks):
            raise UserError(nonfinite_message(step, ranks, seen, samples, manifest, rank))
        lr = engine.get_lr()[0]  # the rate this update uses (the scheduler advances inside step())
        engine.step()
        accel.synchronize()
        step_s = time.perf_counter() - t_step

        m = metrics.step_metrics(ranks, dims.sp, step_s, args.peak_tflops, device)
        m["pred_ms"] = list(plan_step.pred_ms)
        m["pred_idle_fraction"] = metrics.idle_fraction(plan_step.pred_ms)
        log.write({"step": step + 1, "epoch": plan_step.epoch, "plan_step": plan_step.step, "lr": lr, **m,
                   "rank_loss": counters["loss_sum"] / max(counters["samples"], 1),
                   "ids": [ids for ids, _, _, _ in seen], "pad": plan_step.pad})
        if engine.monitor.enabled:
            engine.monitor.write_events(metrics.monitor_events(m, step + 1, lr))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", sps=f"{m['samples_per_s']:.1f}", idle=f"{m['idle_fraction']:.2f}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
            checkpoint.save(engine, ckpt_dir, step + 1, plan_step.state, layout)
    bar.close()
    if start < args.max_steps and not args.no_final_save:
        checkpoint.save(engine, ckpt_dir, args.max_steps, plan_step.state, layout)
    log.close()
    del batches  # stop DataLoader workers before the process group goes away
    dist.barrier()


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


def nonfinite_message(step, ranks, seen, samples, manifest, rank) -> str:
    bad = [r for r, c in enumerate(ranks) if c["nonfinite"]]
    mine = []
    for ids, index, per_sample, _ in seen:
        for sid, i, v in zip(ids, index, per_sample.tolist()):
            if v != v or v in (float("inf"), float("-inf")):
                mine.append(f"{sid} ({samples[i].extra.get('shard', '?')})")
    if mine:
        return (f"step {step + 1}: non-finite loss on rank {rank} for sample(s) {', '.join(mine)} "
                f"(manifest {manifest}); stopped before the optimizer update")
    return f"step {step + 1}: non-finite loss on rank(s) {bad} (their error names the samples); stopped"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except UserError as e:
        # A UserError raised in a DataLoader worker arrives wrapped with the worker's traceback; its
        # last line is the original message.
        msg = str(e).strip().splitlines()[-1]
        msg = msg.split("UserError: ", 1)[-1]
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
