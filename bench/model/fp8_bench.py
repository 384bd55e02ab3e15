"""FP8 linear layers (--fp8 linear: torchao float8, rowwise scaling) against bf16 on one GPU: the speed of a 1.3B
training micro-step, and the numerics of N training steps from the same init and data. Each part runs in a process of
its own (a clean GPU and compile cache); raw JSON under --out and a staging results table (--csv) whose rows
`python bench/harness.py merge` upserts into bench/results/results.csv.

    python bench/model/fp8_bench.py --parts speed --budget-s 540 --out $OUT                  # bf16 and fp8, 3 shapes
    python bench/model/fp8_bench.py --parts numerics --steps 300 --budget-s 570 --out $OUT   # bf16 s0, bf16 s1, fp8 s0
    python bench/model/fp8_bench.py --parts numerics-fp8-s0 --budget-s 570 --out $OUT        # one run per command: the
                                                                   # verdict reads the other runs from the same --out
    python bench/model/fp8_bench.py --smoke --out /tmp/fp8-smoke                              # CPU: tiny model, no fp8

speed: one micro-batch per step (flow-matching forward, backward, optimizer step; ZeRO-2, bf16), every block
checkpointed under --checkpoint-policy (the trainer's recommended `--checkpoint-policy attention`) with compiled
regions (--compile-blocks regions: the fp8 layers' casts compiled too, model/compile.py), at 480p 81f (32,760 tokens),
720p 81f (75,600) and 32 images 480p (49,920); median ms after warm-up, and MFU as model FLOPs over --peak-tflops: an
fp8 row's MFU is the same bf16-equivalent count (labelled "MFU (bf16-equivalent)").
numerics: the same init (seed 0) and the same data (a fixed pool of structured synthetic latents, cycled in order) for
every run; the run's seed draws the noise and timesteps. After --steps steps, the held-out loss: fixed noise on
held-out samples at validation.timesteps() (8 fixed t, no shift). fp8 passes when |fp8 s0 - bf16 s0| <= |bf16 s1 -
bf16 s0|, the bf16 seed-to-seed spread (docs/training.md). --num-layers runs fewer blocks where --steps of the whole
model do not fit a part's budget; a part that runs out of budget says how many steps it ran.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
import harness  # noqa: E402

PREFIX = "FP8_BENCH "
# name -> (samples, latent frames, height, width); tokens = frames * height/2 * width/2
SHAPES = {"480p81": (1, 21, 60, 104), "720p81": (1, 21, 90, 160), "img32": (32, 1, 60, 104)}
SMOKE_SHAPES = {"tiny": (2, 3, 8, 8)}
PARTS = {"speed-bf16": dict(kind="speed", fp8=False, seed=0), "speed-fp8": dict(kind="speed", fp8=True, seed=0),
         "numerics-bf16-s0": dict(kind="numerics", fp8=False, seed=0),
         "numerics-bf16-s1": dict(kind="numerics", fp8=False, seed=1),
         "numerics-fp8-s0": dict(kind="numerics", fp8=True, seed=0)}
GROUPS = {"speed": ["speed-bf16", "speed-fp8"], "numerics": ["numerics-bf16-s0", "numerics-bf16-s1", "numerics-fp8-s0"]}
# numerics data: a pool of training samples cycled in order, held-out samples, per-step micro-batch
NUM_SHAPE, NUM_BATCH, NUM_TRAIN, NUM_HELDOUT, TEXT_TOKENS = (5, 30, 52), 4, 256, 16, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="speed,numerics", help=f"comma list of speed, numerics, or {', '.join(PARTS)}")
    p.add_argument("--part", help=argparse.SUPPRESS)  # a child process: run this part
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"speed: comma list of {', '.join(SHAPES)}")
    p.add_argument("--timed-steps", type=int, default=5, help="speed: timed steps per shape after 2 warm-up steps")
    p.add_argument("--steps", type=int, default=300, help="numerics: training steps per run")
    p.add_argument("--num-layers", type=int, default=None, help="numerics: blocks of the model (default: all)")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds for all parts given; each gets an equal "
                                                                  "share of what is left when it starts")
    p.add_argument("--config", default="configs/ds_zero2_bf16.json", help="DeepSpeed JSON (ZeRO stage, optimizer)")
    p.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    p.add_argument("--compile-blocks", default="regions", choices=("none", "regions", "block"))
    p.add_argument("--checkpoint-policy", default="attention", choices=("full", "attention"))
    p.add_argument("--attention", default="auto", help="as the trainer's flag")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU bf16 dense peak (H100/H200 SXM: 989)")
    p.add_argument("--hardware", default=None, help="results rows' hardware (default: from the GPU's name)")
    p.add_argument("--csv", default=None, help="staging results table (default OUT/results-staging.csv)")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny model, tiny shapes, a few steps, fp8 off")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def build(args, fp8: bool, num_layers=None):
    """(engine, model config, device, dtype): the model from seed 0, its linears converted when fp8 (before compile and
    deepspeed.initialize, as the trainer does), regions compiled, the engine of --config with G = 1."""
    import torch

    from ds_adaptiveload.model import WanConfig, WanModel
    from ds_adaptiveload.model.attention import resolve_attention
    from ds_adaptiveload.train import engine as eng, sp as tsp
    from ds_adaptiveload.train.config import derive_ds_config

    eng.single_process_env()
    accel, _, _ = eng.init_distributed()
    device = eng.pick_device(accel, 0)
    cuda = device.type == "cuda"
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs/wan_tiny.yaml" if args.smoke else args.model_config))
    if num_layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    ds = derive_ds_config(os.path.join(ROOT, args.config), grad_accum=1, dp=1, bf16=cuda, steps_per_print=10**9,
                          tensorboard=None, csv_monitor=None, wandb=None)
    ds.pop("adaptive_load", None)
    if not cuda:
        ds["optimizer"]["params"].pop("fused", None)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same init for every part
    model = WanModel(cfg, checkpoint_blocks=True, checkpoint_policy=args.checkpoint_policy).to(device, dtype)
    if fp8:
        from ds_adaptiveload.model.fp8 import check_fp8, convert_fp8

        check_fp8("linear", device, "--fp8")
        convert_fp8(model)
    tsp.apply_ulysses(model, None, cfg.num_heads, resolve_attention(args.attention)[1])
    if cuda and args.compile_blocks != "none":
        from ds_adaptiveload.model.compile import apply_compile

        apply_compile(model, args.compile_blocks)
    return eng.build_engine(model, ds, mpu=None), cfg, device, dtype


def train_step(engine, batch, device, dtype, seed: int, step: int):
    """One optimizer step of one micro-batch; the per-sample losses."""
    import torch

    from ds_adaptiveload.train import engine as eng

    losses = eng.micro_step(engine, batch, 1.0 / len(batch["index"]), device=device, dtype=dtype, seed=seed,
                            epoch=step, shift=5.0)
    engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return losses


def random_batch(cfg, shape, device, dtype, seed=1) -> dict:
    import torch

    n, *lat = shape
    g = torch.Generator().manual_seed(seed)
    return {"latent": [torch.randn(cfg.in_dim, *lat, generator=g).to(device, dtype) for _ in range(n)],
            "text": [torch.randn(TEXT_TOKENS, cfg.text_dim, generator=g).to(device, dtype) for _ in range(n)],
            "index": list(range(n))}


def run_speed(name, args, deadline) -> dict:
    """Per shape: 2 warm-up steps (compiles), then --timed-steps timed ones until the deadline."""
    import torch

    spec = PARTS[name]
    engine, cfg, device, dtype = build(args, spec["fp8"])
    cuda = device.type == "cuda"
    row = {"part": name, "fp8": spec["fp8"], "shapes": {}, "status": "ok"}
    shapes = SMOKE_SHAPES if args.smoke else {s: SHAPES[s] for s in args.shapes.split(",") if s}
    for sname, shape in shapes.items():
        batch = random_batch(cfg, shape, device, dtype)
        tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
        flops = shape[0] * cfg.flops_per_sample(tokens)
        times, res = [], {"samples": shape[0], "tokens": shape[0] * tokens, "step_flops": flops, "status": "ok"}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(2 + args.timed_steps):
            if i >= 3 and time.monotonic() + max(times) > deadline:  # one timed step always
                break
            t0 = time.perf_counter()
            try:
                losses = train_step(engine, batch, device, dtype, 0, i)
            except torch.cuda.OutOfMemoryError as e:
                res.update(status="oom", error=str(e).splitlines()[0][:300])
                break
            if not torch.isfinite(losses).all():
                res.update(status="crash", error=f"non-finite loss at step {i}")
                break
            if i >= 2:
                times.append(time.perf_counter() - t0)
        res["step_s"] = [round(t, 4) for t in times]
        res["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None
        if times:
            med = harness.quantile(times, 0.5)
            res.update(ms=round(1000 * med, 2), mfu=flops / med / (args.peak_tflops * 1e12))
        row["shapes"][sname] = res
    return row


def numerics_data(cfg, device, dtype, smoke: bool):
    """(train, held-out) lists of (latent, text): smooth latents (noise upsampled 4x in space), so there is
    structure to learn; drawn from a fixed generator, the same in every run whatever its seed."""
    import torch
    import torch.nn.functional as F

    f, h, w = (1, 4, 4) if smoke else NUM_SHAPE
    g = torch.Generator().manual_seed(1234)

    def sample():
        coarse = torch.randn(1, cfg.in_dim, f, h // 2, w // 2, generator=g)
        x = F.interpolate(coarse, size=(f, h, w), mode="trilinear", align_corners=False)[0]
        x = x / x.std()
        return x.to(device, dtype), torch.randn(TEXT_TOKENS, cfg.text_dim, generator=g).to(device, dtype)

    n_train, n_val = (8, 2) if smoke else (NUM_TRAIN, NUM_HELDOUT)
    return [sample() for _ in range(n_train)], [sample() for _ in range(n_val)]


def heldout_loss(engine, data, device) -> list:
    """Mean flow-matching loss per fixed t (validation.timesteps()) over the held-out samples, fixed noise."""
    import torch

    from ds_adaptiveload.train import flow
    from ds_adaptiveload.train.validation import timesteps

    g = torch.Generator().manual_seed(4321)
    eps = [torch.randn(x.shape, generator=g).to(device) for x, _ in data]
    per_t = []
    with torch.no_grad():
        for t in timesteps():
            tt = torch.tensor([t], device=device)
            per_t.append(sum(float(flow.flow_matching_loss(engine, x[None], c[None], e[None], tt)[0])
                             for (x, c), e in zip(data, eps)) / len(data))
    return per_t


def run_numerics(name, args, deadline) -> dict:
    """--steps steps of NUM_BATCH samples from the fixed pool, in order; the held-out loss at the end."""
    import torch

    spec = PARTS[name]
    engine, cfg, device, dtype = build(args, spec["fp8"] and not args.smoke, args.num_layers)
    train, val = numerics_data(cfg, device, dtype, args.smoke)
    row = {"part": name, "fp8": spec["fp8"] and not args.smoke, "seed": spec["seed"], "num_layers": cfg.num_layers,
           "losses": [], "status": "ok"}
    n = 2 if args.smoke else NUM_BATCH
    eval_s, t_start = 0.0, time.monotonic()
    for step in range(args.steps):
        # keep time for the held-out pass (about 8 forwards per held-out sample) after the last step
        if step and time.monotonic() + eval_s + (time.monotonic() - t_start) / step > deadline:
            row.update(status="partial", error=f"budget spent after {step} of {args.steps} steps")
            break
        idx = [(step * n + j) % len(train) for j in range(n)]
        batch = {"latent": [train[i][0] for i in idx], "text": [train[i][1] for i in idx], "index": idx}
        losses = train_step(engine, batch, device, dtype, spec["seed"], step)
        row["losses"].append(round(float(losses.mean()), 6))
        if not torch.isfinite(losses).all():
            row.update(status="crash", error=f"non-finite loss at step {step}")
            return row
        if step == 0:
            eval_s = 4 * (time.monotonic() - t_start) * len(val)  # a rough bound: 8 forwards ~ 4 train steps
    row["steps"] = len(row["losses"])
    row["heldout_per_t"] = [round(v, 6) for v in heldout_loss(engine, val, device)]
    row["heldout"] = round(sum(row["heldout_per_t"]) / len(row["heldout_per_t"]), 6)
    return row


def verdict(by: dict):
    """(fp8 within the bf16 seed spread?, |fp8 - bf16 s0|, |bf16 s1 - bf16 s0|), None where a run is missing."""
    runs = [by.get(p, {}).get("heldout") for p in GROUPS["numerics"]]
    if None in runs or len({by[p].get("steps") for p in GROUPS["numerics"]}) != 1:
        return None  # a run missing, or one cut short by the budget: the losses are not comparable
    b0, b1, f0 = runs
    return abs(f0 - b0) <= abs(b1 - b0), abs(f0 - b0), abs(b1 - b0)


def hardware_name(env) -> str:
    dev = env.get("device", "cpu")
    if dev == "cpu":
        return "CPU"
    return "1x " + ("H200" if "H200" in dev else "H100 80GB" if "H100" in dev else dev)


def speed_rows(by, common, csv):
    """Per shape: step ms and MFU of bf16 and fp8 (fp8's MFU labelled bf16-equivalent), and fp8's speed-up."""
    for name in GROUPS["speed"]:
        r = by.get(name)
        if r is None:
            continue
        variant = "fp8 linear" if r["fp8"] else "bf16"
        for sname, res in r["shapes"].items():
            base = dict(common, variant=f"{variant}, {sname}", note=f"{res['samples']} sample(s), {res['tokens']:,} "
                        f"tokens per micro-batch; {len(res['step_s'])} timed steps after 2 warm-up")
            if "ms" not in res:
                harness.record(csv, metric="step time", unit="ms", value=None, **{
                    **base, "status": res["status"] if res["status"] != "ok" else "not-measured",
                    "note": base["note"] + "; " + res.get("error", "no timed step in the budget")})
                continue
            harness.record(csv, metric="step time", unit="ms", value=res["ms"], **base)
            harness.record(csv, metric="MFU (bf16-equivalent)" if r["fp8"] else "MFU", unit="%",
                           value=round(100 * res["mfu"], 2), **base)
            if res["peak_gib"] is not None:  # CUDA only
                harness.record(csv, metric="peak memory", unit="GiB", value=res["peak_gib"], **base)
    bf, f8 = by.get("speed-bf16"), by.get("speed-fp8")
    for sname in (bf or {}).get("shapes", {}):
        a, b = bf["shapes"][sname].get("ms"), (f8 or {}).get("shapes", {}).get(sname, {}).get("ms")
        if a and b:
            harness.record(csv, metric="step time, fp8 vs bf16", unit="ms", value=b, baseline=a,
                           **dict(common, variant=f"fp8 linear vs bf16, {sname}", note="baseline: bf16"))
        elif a and (f8 or {}).get("status") == "crash":  # the fp8 run died before any shape: a crash, said so
            harness.record(csv, metric="step time, fp8 vs bf16", unit="ms", value=None, baseline=a, status="crash",
                           **dict(common, variant=f"fp8 linear vs bf16, {sname}",
                                  note=f"baseline: bf16; the fp8 run crashed: {f8.get('error', '')}"))


def numerics_rows(by, common, csv):
    """Per run: the held-out loss and the last 20 steps' training loss; then fp8's distance from bf16 seed 0 against
    the seed spread (status ok either way; the note says whether fp8 is within it)."""
    for name in GROUPS["numerics"]:
        r = by.get(name)
        if r is None:
            continue
        base = dict(common, variant=name.replace("numerics-", ""), better="lower",
                    note=f"{r.get('steps', 0)} steps, {r['num_layers']} blocks, status {r['status']}"
                         + (f": {r['error']}" if r.get("error") else ""))
        if "heldout" not in r:
            harness.record(csv, metric="held-out loss (8 fixed t)", unit="x", value=None,
                           **{**base, "status": "crash" if r["status"] == "crash" else "not-measured"})
            continue
        harness.record(csv, metric="held-out loss (8 fixed t)", unit="x", value=r["heldout"], **base)
        tail = r["losses"][-20:]
        harness.record(csv, metric="training loss, mean of the last 20 steps", unit="x",
                       value=round(sum(tail) / len(tail), 6), **base)
    v = verdict(by)
    if v is not None:
        within, gap, spread = v
        harness.record(csv, metric="held-out loss, |fp8 s0 - bf16 s0|", unit="x", value=round(gap, 6),
                       baseline=round(spread, 6) or None, better="lower",
                       **dict(common, variant="fp8 vs bf16 seed spread",
                              note=f"baseline: |bf16 s1 - bf16 s0|; fp8 {'within' if within else 'OUTSIDE'} the "
                                   f"bf16 seed spread"))


def record_rows(rows, args, raw_file, env):
    csv = args.csv or os.path.join(args.out, "results-staging.csv")
    by = {r["part"]: r for r in rows}
    command = f"python bench/model/fp8_bench.py --parts {','.join(by)}"
    command += f" --steps {args.steps}" if any(PARTS[p]["kind"] == "numerics" for p in by) else ""
    command += f" --num-layers {args.num_layers}" if args.num_layers else ""
    common = dict(experiment="fp8-linear", hardware=args.hardware or hardware_name(env), section="training",
                  zero_stage=2, model="wan_tiny" if args.smoke else os.path.basename(args.model_config)[:-5],
                  raw_file=raw_file, command=command)
    speed_rows(by, common, csv)
    numerics_rows(by, common, csv)
    return csv


def run_part(name, args) -> dict:
    deadline = time.monotonic() + args.budget_s
    return (run_speed if PARTS[name]["kind"] == "speed" else run_numerics)(name, args, deadline)


def child_argv(name, args, budget) -> list:
    argv = [os.path.relpath(__file__, ROOT), "--part", name, "--budget-s", str(max(budget, 1))]
    for flag in ("shapes", "timed_steps", "steps", "config", "model_config", "compile_blocks", "checkpoint_policy",
                 "attention", "peak_tflops", "out"):
        argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    argv += ["--num-layers", str(args.num_layers)] if args.num_layers else []
    return argv + (["--smoke"] if args.smoke else [])


def earlier_runs(out: str, have: set) -> list:
    """The numerics runs an earlier command wrote to the same --out (one run per 10-minute command), for the
    verdict: those this command did not run."""
    rows = []
    for name in GROUPS["numerics"]:
        path = os.path.join(out, f"fp8-{name}.json")
        if name not in have and os.path.isfile(path):
            with open(path) as f:
                rows.append(json.load(f))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:  # child
        print(PREFIX + json.dumps(run_part(args.part, args)), flush=True)
        return 0
    parts = [p for g in args.parts.split(",") if g for p in GROUPS.get(g, [g])]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"error: --parts: unknown {bad}; choose from speed, numerics, {', '.join(PARTS)}")
    if args.smoke:
        args.steps, args.timed_steps = min(args.steps, 3), min(args.timed_steps, 1)
        parts = [p for p in parts if not PARTS[p]["fp8"] or PARTS[p]["kind"] == "numerics"]  # no fp8 on a CPU
    os.makedirs(args.out, exist_ok=True)
    t_end, rows = time.monotonic() + args.budget_s, []
    for i, name in enumerate(parts):
        share = (t_end - time.monotonic()) / (len(parts) - i)
        row, proc = harness.run_part(child_argv(name, args, share - 10), PREFIX,
                                     os.path.join(args.out, f"fp8-{name}.log"))
        rows.append(row or {"part": name, "fp8": PARTS[name]["fp8"], "status": "crash", "shapes": {},
                            "num_layers": args.num_layers, "error": harness.last_error(proc.stderr)})
        with open(os.path.join(args.out, f"fp8-{name}.json"), "w") as f:
            json.dump(rows[-1], f)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    rows += earlier_runs(args.out, {r["part"] for r in rows})
    v = verdict({r["part"]: r for r in rows})
    if v is not None:
        print(f"fp8 held-out loss {'IS' if v[0] else 'is NOT'} within the bf16 seed spread: |fp8 s0 - bf16 s0| = "
              f"{v[1]:.6f}, |bf16 s1 - bf16 s0| = {v[2]:.6f}", flush=True)
    elif any(PARTS[r["part"]]["kind"] == "numerics" for r in rows):
        print("no verdict: it needs bf16 s0, bf16 s1 and fp8 s0 with the same number of steps (a run cut short by "
              "the budget: fewer --steps or --num-layers)", flush=True)
    kinds = "-".join(dict.fromkeys(PARTS[p]["kind"] for p in parts))  # speed and numerics runs: files of their own
    harness.save_parts(args.out, f"fp8-{kinds}", rows, args, record_rows, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
