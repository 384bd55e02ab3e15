"""LoRA on one GPU: the full-size 14B model (random base) at 720p 81f with rank-32 adapters, a video-heavy packed
micro-batch on the same model, and the 1.3B model's LoRA against full fine-tuning on the same samples. Each part runs
in a process of its own (a clean GPU); raw JSON rows under --out, and a staging results table (--csv) whose rows
`python bench/harness.py merge` upserts into bench/results/results.csv.

    python bench/lora/lora_bench.py --parts 14b --steps 20 --budget-s 520 --out $OUT          # ~9 min on an H100
    python bench/lora/lora_bench.py --parts packed,1.3b-lora,1.3b-full --budget-s 400 --out $OUT
    python bench/lora/lora_bench.py --smoke --out /tmp/lora-smoke                           # CPU: the tiny model
    python bench/lora/lora_bench.py --parts 14b --steps 20 --state /tmp/lora-state --budget-s 520 --out $OUT
                                      # twice on one machine: 20 timed steps of 49 s do not fit one 10-minute command
    python bench/lora/lora_bench.py --parts 14b --memory-cap-gib 79.18 --out $OUT    # on an H200: what fits 80 GB

A step is one micro-batch: flow-matching forward, backward, optimizer step (ZeRO-2, bf16, one GPU), every block
checkpointed; the 14B parts keep the checkpointed blocks' inputs in pinned host memory (--offload-blocks, model/
offload.py). MFU counts a LoRA step's model FLOPs (WanConfig.lora_flops_per_sample, docs/training.md) and a full
step's (flops_per_sample) against --peak-tflops. A part stops when its share of --budget-s is spent and says how many
steps it ran.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import harness  # noqa: E402

PREFIX = "LORA_BENCH "
# Latent shapes (frames, height, width) of the Wan VAE (4x temporal, 8x spatial); tokens = F * H/2 * W/2.
CLIP_720P_81F = (21, 90, 160)      # 75,600 tokens
CLIP_480P_81F = (21, 60, 104)      # 32,760
CLIP_480P_33F = (9, 60, 104)       # 14,040
IMAGE_480P = (1, 60, 104)          # 1,560
PARTS = {
    "14b": dict(model="configs/wan_14b.yaml", lora=32, shapes=[CLIP_720P_81F], offload=True,
                doc="14B, LoRA r32, one 720p 81f clip (75,600 tokens) per step"),
    "packed": dict(model="configs/wan_14b.yaml", lora=32, offload=True,
                   shapes=[CLIP_480P_81F, CLIP_480P_33F] + [IMAGE_480P] * 8,
                   doc="14B, LoRA r32, a video-heavy packed micro-batch: 480p 81f + 480p 33f + 8 images (59,280 tokens)"),
    "1.3b-lora": dict(model="configs/wan_1_3b.yaml", lora=32, offload=False,
                      shapes=[CLIP_480P_81F, CLIP_480P_33F] + [IMAGE_480P] * 16,
                      doc="1.3B, LoRA r32: 480p 81f + 480p 33f + 16 images (71,760 tokens) per step"),
    "1.3b-full": dict(model="configs/wan_1_3b.yaml", lora=None, offload=False,
                      shapes=[CLIP_480P_81F, CLIP_480P_33F] + [IMAGE_480P] * 16,
                      doc="1.3B, full fine-tuning, the same samples as 1.3b-lora"),
}
SMOKE_SHAPES = [(3, 8, 8), (1, 8, 8), (1, 8, 8)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="14b,packed,1.3b-lora,1.3b-full",
                   help=f"comma list of {', '.join(PARTS)}, run in order")
    p.add_argument("--part", help=argparse.SUPPRESS)  # a child process: run this part
    p.add_argument("--steps", type=int, default=20, help="steps per part after one warm-up step")
    p.add_argument("--budget-s", type=float, default=520.0, help="seconds for all parts; each gets an equal share "
                                                                  "of what is left when it starts")
    p.add_argument("--config", default="configs/ds_zero2_bf16.json", help="DeepSpeed JSON (its ZeRO stage, bf16, "
                                                                           "optimizer; batch keys and monitors reset)")
    p.add_argument("--offload-blocks", type=int, default=None,
                   help="checkpointed blocks whose inputs go to host memory (default: all in the 14B parts, none in "
                        "the others; given, in every part: its variant then names the count)")
    p.add_argument("--no-offload", action="store_true", help="no part offloads")
    p.add_argument("--compile-blocks", default="regions", choices=("none", "regions", "block"),
                   help="as the trainer's flag (CUDA only; the CPU smoke run stays eager)")
    p.add_argument("--attention", default="auto", help="as the trainer's flag")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU bf16 dense peak (H100/H200 SXM: 989)")
    p.add_argument("--hardware", default=None, help="results rows' hardware (default: from the GPU's name)")
    p.add_argument("--csv", default=None, help="staging results table (default OUT/results-staging.csv)")
    p.add_argument("--state", default=None, metavar="DIR",
                   help="keep each part's adapters and optimizer state in DIR when it stops and resume from them when "
                        "there: a part of more steps than one command's time limit runs as several commands on one "
                        "machine (each process adds one untimed warm-up step; every trained step is counted)")
    p.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                   help="cap the caching allocator at GIB on a larger GPU (torch.cuda.set_per_process_memory_fraction):"
                        " e.g. 79.18 on an H200 shows what fits an H100 80GB")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny model, tiny shapes, 2 steps per part")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def build(spec, args):
    """(engine, model config, device, dtype): the model built on the device in the compute dtype (a 14B model is
    never materialised in fp32 on the host), its head drawn (Wan's is zero: no gradient would reach the blocks),
    adapters added, deepspeed.initialize with the trainable parameters."""
    import torch

    from ds_adaptiveload.model import WanConfig, WanModel
    from ds_adaptiveload.model.attention import resolve_attention
    from ds_adaptiveload.train import engine as eng, sp as tsp
    from ds_adaptiveload.train.config import LoraSettings, derive_ds_config

    eng.single_process_env()
    accel, _, _ = eng.init_distributed()
    device = eng.pick_device(accel, 0)
    cuda = device.type == "cuda"
    if cuda and args.memory_cap_gib:  # before the first allocation, so nothing escapes the cap
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs/wan_tiny.yaml" if args.smoke else spec["model"]))
    ds = derive_ds_config(os.path.join(ROOT, args.config), grad_accum=1, dp=1, bf16=cuda, steps_per_print=10**9,
                          tensorboard=None, csv_monitor=None, wandb=None)
    ds.pop("adaptive_load", None)
    if not cuda:
        ds["optimizer"]["params"].pop("fused", None)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = WanModel(cfg, checkpoint_blocks=True)
    finally:
        torch.set_default_dtype(before)
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)
    tsp.apply_ulysses(model, None, cfg.num_heads, resolve_attention(args.attention)[1])
    if cuda and args.compile_blocks != "none":
        from ds_adaptiveload.model.compile import apply_compile

        apply_compile(model, args.compile_blocks)
    if spec["lora"]:
        from ds_adaptiveload.model.lora import apply_lora

        apply_lora(model, LoraSettings(rank=spec["lora"]))
    if (spec["offload"] or args.offload_blocks) and not args.no_offload:  # --offload-blocks N: any part
        model.offload_blocks = cfg.num_layers if args.offload_blocks is None else args.offload_blocks
    return eng.build_engine(model, ds, mpu=None), cfg, device, dtype


def step_flops(cfg, spec, shapes):
    """Model FLOPs of one step: LoRA's (what it runs) or a full step's."""
    from ds_adaptiveload.train.config import LoraSettings

    tokens = [f * (h // 2) * (w // 2) for f, h, w in shapes]
    if spec["lora"]:
        mods = LoraSettings(rank=spec["lora"]).modules()
        return sum(cfg.lora_flops_per_sample(s, spec["lora"], mods) for s in tokens), sum(tokens)
    return sum(cfg.flops_per_sample(s) for s in tokens), sum(tokens)


def run_part(name, args) -> dict:
    """One part in this process: warm-up step, then timed steps until --steps or the deadline."""
    import torch

    from ds_adaptiveload.train import engine as eng

    deadline = time.monotonic() + args.budget_s
    spec = PARTS[name]
    t0 = time.perf_counter()
    engine, cfg, device, dtype = build(spec, args)
    build_s = time.perf_counter() - t0
    cuda = device.type == "cuda"
    shapes = SMOKE_SHAPES if args.smoke else spec["shapes"]
    g = torch.Generator().manual_seed(1)
    batch = {"latent": [torch.randn(cfg.in_dim, *s, generator=g).to(device, dtype) for s in shapes],
             "text": [torch.randn(cfg.text_len, cfg.text_dim, generator=g).to(device, dtype) for _ in shapes],
             "index": list(range(len(shapes)))}
    flops, tokens = step_flops(cfg, spec, shapes)
    prior = resume(engine, args.state, name)
    row = {"part": name, "doc": spec["doc"], "model": spec["model"], "lora_rank": spec["lora"], "tokens": tokens,
           "samples": len(shapes), "offload_blocks": engine.module.offload_blocks, "build_s": round(build_s, 1),
           "step_flops": flops, "status": "ok", "step_s": list(prior.get("step_s", [])),
           "processes": prior.get("processes", 0) + 1}
    peak, trained = prior.get("peak", 0), prior.get("trained", 0)
    left = args.steps - len(row["step_s"])  # timed steps still to run; this process adds a warm-up step before them
    for i in range(1 + left if left > 0 else 0):
        if i and time.monotonic() + max(row["step_s"] or [0]) > deadline:
            break
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        try:
            losses = eng.micro_step(engine, batch, 1.0 / len(shapes), device=device, dtype=dtype, seed=0,
                                    epoch=trained, shift=5.0)
            engine.step()
            if cuda:
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as e:
            row.update(status="oom", error=str(e).splitlines()[0][:300])
            break
        if not torch.isfinite(losses).all():
            row.update(status="crash", error=f"non-finite loss at step {trained}")
            break
        trained += 1
        if i:  # the first step compiles and warms the allocator
            row["step_s"].append(round(time.perf_counter() - t, 3))
        peak = max(peak, torch.cuda.max_memory_allocated(device) if cuda else 0)
        # after every step, so a process cut off by its machine's time limit still leaves its count behind
        with open(os.path.join(args.out, f"lora-{name}-progress.json"), "w") as f:
            json.dump({"step_s": row["step_s"], "trained": trained, "peak_gib": round(peak / 2**30, 2),
                       "processes": row["processes"]}, f)
    row["steps"], row["trained_steps"] = len(row["step_s"]), trained
    row["warmup_steps"] = trained - row["steps"]
    if row["status"] == "ok":
        keep(engine, args.state, name, {"step_s": row["step_s"], "trained": trained, "peak": peak,
                                        "processes": row["processes"]})
    row["peak_gib"] = round(peak / 2**30, 2)
    row["capacity_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2) if cuda else None
    row["memory_cap_gib"] = args.memory_cap_gib if cuda else None
    row["offloaded_gib"] = round(engine.module._offload.stats()["bytes"] / 2**30, 2)
    if row["step_s"]:
        med = harness.quantile(row["step_s"], 0.5)
        row.update(step_s_median=med, tokens_per_s=round(tokens / med, 1),
                   mfu=round(flops / med / (args.peak_tflops * 1e12), 4))
    return row


def resume(engine, state, name) -> dict:
    """What an earlier process of part `name` left in `state` (its adapters and optimizer state are loaded into
    `engine`; the frozen base is rebuilt from the same seed), or {} where there is none."""
    path = os.path.join(state, f"{name}.json") if state else ""
    if not path or not os.path.exists(path):
        return {}
    engine.load_checkpoint(state, tag=name, load_module_strict=False)  # the checkpoint holds the adapters only
    with open(path) as f:
        return json.load(f)


def keep(engine, state, name, progress):
    """Save part `name`'s trainable state (not the frozen base: 28 GB at 14B) and its progress into `state`."""
    if not state:
        return
    engine.save_checkpoint(state, tag=name, save_latest=False, exclude_frozen_parameters=True)
    with open(os.path.join(state, f"{name}.json"), "w") as f:
        json.dump(progress, f)


def hardware_name(env) -> str:
    dev = env.get("device", "cpu")
    if dev == "cpu":
        return "CPU"
    short = "H200" if "H200" in dev else "H100 80GB" if "H100" in dev else dev
    return f"1x {short}"


def variant_name(part: str, row: dict) -> str:
    """The part's name, and the offloaded block count where offload is on in a part that runs without it, or off in
    one that runs with it (offload against recompute, row by row)."""
    n = row.get("offload_blocks") or 0
    if bool(n) == PARTS[part]["offload"]:
        return part
    return f"{part}, offload {n} blocks" if n else f"{part}, no offload"


def record_rows(rows, args, raw_file, env):
    """One staging-table row per number: 14B steps, peak memory, MFU, tokens/s; 1.3B LoRA tokens/s vs full."""
    csv = args.csv or os.path.join(args.out, "results-staging.csv")
    hw = args.hardware or hardware_name(env)
    by = {r["part"]: r for r in rows}
    command = "python bench/lora/lora_bench.py --parts " + ",".join(by) + f" --steps {args.steps}"
    command += f" --offload-blocks {args.offload_blocks}" if args.offload_blocks is not None else ""
    command += f" --memory-cap-gib {args.memory_cap_gib}" if args.memory_cap_gib else ""
    command += f" --state {args.state} (once per process, on one machine)" if args.state else ""
    common = dict(experiment="lora", hardware=hw, section="training", zero_stage=2, raw_file=raw_file,
                  command=command)
    for name, r in by.items():
        status = r["status"]
        trained = r.get("trained_steps", r["steps"] + 1)
        runs = r.get("processes", 1)
        how = (f"{trained} trained steps, {r['steps']} of them timed (the first of each of {runs} processes is not; "
               f"each resumed from the last one's adapters and optimizer state)" if runs > 1 else
               f"{r['steps']} timed steps after 1 warm-up")
        cap = f"; the allocator capped at {r['memory_cap_gib']} GiB of {r['capacity_gib']}" \
            if r.get("memory_cap_gib") else ""
        note = f"{r['doc']}; {how}, no OOM{cap}" if status == "ok" else \
            f"{r['doc']}; {status} after {r['steps']} steps: {r.get('error', '')}"
        base = dict(common, variant=variant_name(name, r), model=os.path.basename(r["model"]).replace(".yaml", ""), note=note,
                    status=status if status == "ok" else status)
        if status != "ok" or not r["step_s"]:  # out of memory, a crash, or the budget spent before a timed step
            harness.record(csv, metric="peak memory", unit="GiB", value=None,
                           **{**base, "status": status if status != "ok" else "not-measured",
                              "note": base["note"] if status != "ok" else f"{r['doc']}; no timed step in the budget"})
            continue
        harness.record(csv, metric="peak memory", unit="GiB", value=r["peak_gib"], **base)
        harness.record(csv, metric="MFU", unit="%", value=round(100 * r["mfu"], 2), **base)
        harness.record(csv, metric="tokens per second", unit="tokens/s", value=r["tokens_per_s"], **base)
        harness.record(csv, metric="steps without OOM", unit="x", value=trained, **base)
    if by.get("1.3b-lora", {}).get("tokens_per_s") and by.get("1.3b-full", {}).get("tokens_per_s"):
        harness.record(csv, metric="tokens per second, LoRA vs full fine-tuning", unit="tokens/s",
                       value=by["1.3b-lora"]["tokens_per_s"], baseline=by["1.3b-full"]["tokens_per_s"],
                       variant="1.3b-lora-vs-full", model="wan_1_3b", status="ok",
                       note="same samples and checkpointing; baseline: full fine-tuning", **common)
    return csv


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:  # child
        print(PREFIX + json.dumps(run_part(args.part, args)), flush=True)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"error: --parts: unknown {bad}; choose from {', '.join(PARTS)}")
    if args.smoke:
        args.steps = min(args.steps, 2)
    os.makedirs(args.out, exist_ok=True)
    t_end, rows = time.monotonic() + args.budget_s, []
    for i, name in enumerate(parts):
        share = (t_end - time.monotonic()) / (len(parts) - i)
        child = [os.path.relpath(__file__, ROOT), "--part", name, "--steps", str(args.steps), "--budget-s",
                 str(max(share - 5, 1)), "--config", args.config, "--compile-blocks", args.compile_blocks,
                 "--attention", args.attention, "--peak-tflops", str(args.peak_tflops), "--out", args.out]
        child += (["--smoke"] if args.smoke else []) + (["--no-offload"] if args.no_offload else [])
        child += ["--offload-blocks", str(args.offload_blocks)] if args.offload_blocks is not None else []
        child += ["--state", args.state] if args.state else []
        child += ["--memory-cap-gib", str(args.memory_cap_gib)] if args.memory_cap_gib else []
        row, proc = harness.run_part(child, PREFIX, os.path.join(args.out, f"lora-{name}.log"))
        rows.append(row or {"part": name, "doc": PARTS[name]["doc"], "model": PARTS[name]["model"], "steps": 0,
                            "status": "crash", "step_s": [], "error": harness.last_error(proc.stderr)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "step_s"}), flush=True)
    harness.save_parts(args.out, "lora", rows, args, record_rows, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
