"""Balance measured on one device: an epoch planned for W virtual ranks, every planned micro-batch (or those of S
sampled steps) run through the trainer's engine and micro-step on this one device and timed, then the lockstep wall,
idle and speed-up over equal-tokens computed from the measured times beside the cost model's predicted ones.

Under ZeRO-2/3 a step costs the sum over its G micro-batch rounds of the slowest rank's micro-batch, plus
communication. Communication is not measured here (one device): the output gives a predicted reduce-scatter and
all-gather time from the parameter bytes and --bus-gbps instead. Each virtual rank's step ends with its optimizer
step, timed apart from the micro-batches (the measured "fixed" part of a step, beside the profile's step_fixed_ms).

    python bench/e2e/replay.py --deepspeed_config configs/ds_zero2_bf16.json --model-config configs/wan_1_3b.yaml \\
        --mix video-heavy --samples 2000 --ranks 8:2 --grad-accum 1 --budget-tokens 76000 --compile-blocks regions \\
        --checkpoint-policy attention --repeat 2 --out OUT
    python bench/e2e/replay.py --deepspeed_config configs/ds_tiny_cpu.json --model-config configs/wan_tiny.yaml \\
        --mix tiny --samples 64 --ranks 4:2 --grad-accum 1,2 --repeat 2 --out /tmp/replay     # CPU mechanics
    python bench/e2e/replay.py --rescore bench/results/replay-2026-12-07-video-heavy-h100.json --out /tmp/rescored
"""
import argparse
import dataclasses
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
MEASURED_AS = "each micro-batch's least time over the --repeat runs (best_of)"
BASELINE = "equal-tokens"


# -- arithmetic (pure: the test checks it against hand-computed numbers) -------------------------------------------

def lockstep(costs, fixed):
    """costs[step][rank][g] (ms), fixed[step] (ms added once per step) -> {"wall_ms": [per step], "rank_ms":
    [[per rank]], "idle_fraction"}: a step's wall is fixed + the sum over rounds g of the slowest rank's micro-batch;
    idle = 1 - sum of mean rank time / sum of wall (Plan.summary's definition)."""
    walls, ranks = [], []
    for step, f in zip(costs, fixed):
        walls.append(f + sum(max(rank[g] for rank in step) for g in range(len(step[0]))))
        ranks.append([f + sum(rank) for rank in step])
    busy = sum(sum(r) / len(r) for r in ranks)
    total = sum(walls)
    return {"wall_ms": walls, "rank_ms": ranks, "idle_fraction": max(0.0, 1 - busy / total) if total else 0.0}


def quantiles(xs, qs=QUANTILES):
    """Nearest-rank quantiles of xs ({"p5": ..., "max": ...})."""
    s = sorted(xs)
    if not s:
        return {}
    return {("max" if q == 1.0 else f"p{round(q * 100)}"): s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]
            for q in qs}


def comm_ms(num_params, ranks, bus_gbps, grad_bytes=2):
    """Predicted ring reduce-scatter (every micro-batch under ZeRO-2's lockstep) and all-gather (after the update)
    of the parameters' bytes at a bus bandwidth of bus_gbps GB/s: bytes * (W-1)/W / bandwidth."""
    moved = num_params * grad_bytes * (ranks - 1) / ranks
    per = moved / (bus_gbps * 1e9) * 1000
    return {"reduce_scatter_ms_per_micro_batch": per, "all_gather_ms_per_step": per, "bus_gbps": bus_gbps,
            "bytes_per_collective": moved}


def chosen_steps(n_steps, sample, seed):
    """Indices of the steps to run: all of them, or `sample` of them drawn with the seed (sorted)."""
    if not sample or sample >= n_steps:
        return list(range(n_steps))
    return sorted(random.Random(f"replay/{seed}").sample(range(n_steps), sample))


def step_fixed(rank_ms, costs):
    """Per step, the profile's fixed ms (step_fixed_ms): a rank's predicted step total less its micro-batches' costs
    (rank_ms[step][rank], costs[step][rank][g])."""
    return [ranks[0] - sum(pc[0]) for ranks, pc in zip(rank_ms, costs)]


def best_of(runs):
    """Per micro-batch, the least of its times over the repeats (runs[rep][step][rank][g]): the first run of a
    micro-batch whose shape no earlier one had includes compiling the regions for it (4.7 s more than its repeat on
    the H100, 2026-12-07), which a training run pays once and a replay of a few steps would count as imbalance."""
    return [[[min(ts) for ts in zip(*ranks)] for ranks in zip(*steps)] for steps in zip(*runs)]


def score(pred_costs, fixed, measured, opt_ms, n_planned, plan_wall_s=None):
    """The measured and predicted lockstep of the run steps (predicted: the plan's micro-batch costs and the profile's
    fixed ms per step), the epoch wall, and the distribution of measured / predicted per micro-batch.

    The epoch: predicted, the plan's own wall of all its steps (plan_wall_s); measured, that wall times measured over
    predicted on the run steps, which is the measured epoch when every step ran. A few random steps scaled by count
    say more about which steps were drawn (light or heavy) than about the policy. Without plan_wall_s (raw files from
    before it was kept) the run steps are scaled by count."""
    pred, meas = lockstep(pred_costs, fixed), lockstep(measured, opt_ms)
    run_pred, run_meas = sum(pred["wall_ms"]), sum(meas["wall_ms"])
    if plan_wall_s is None:
        plan_wall_s = run_pred * n_planned / len(measured) / 1000
    ratios = [m / p for ms, ps in zip(measured, pred_costs) for mr, pr in zip(ms, ps) for m, p in zip(mr, pr) if p]
    return {"measured": {"idle_fraction": meas["idle_fraction"],
                         "epoch_wall_s": plan_wall_s * run_meas / run_pred if run_pred else 0.0,
                         "wall_ms": meas["wall_ms"]},
            "predicted": {"idle_fraction": pred["idle_fraction"], "epoch_wall_s": plan_wall_s,
                          "wall_ms": pred["wall_ms"]},
            "measured_over_predicted": quantiles(ratios)}


def summarize(plan, steps, runs, opt_ms):
    """One policy's numbers (score's) from its runs[rep][step][rank][g] (best_of over the repeats), with mix_tv of
    the plan (by sample count: no time enters it)."""
    from ds_adaptiveload.schedule.planner import mix_tv

    pred_costs = [plan.micro_batch_ms(s) for s in steps]
    fixed = step_fixed([plan.pred_ms[s] for s in steps], pred_costs)
    measured = best_of(runs)
    return {"policy": plan.config.policy, "steps_planned": len(plan.steps), "steps_run": len(steps),
            "micro_batches_run": sum(len(r) for st in measured for r in st), "mix_tv": mix_tv(plan),
            **score(pred_costs, fixed, measured, opt_ms, len(plan.steps), plan.summary()["predicted_wall_s"])}


def rescore(doc):
    """A raw file's numbers computed again from the times it holds (no device): score and speedups of every
    policy of every run, in place; returns doc."""
    for run in doc["runs"]:
        for p in run["policies"]:
            fixed = step_fixed(p["planned_rank_ms"], p["predicted_ms"])
            p.update(score(p["predicted_ms"], fixed, best_of(p["measured_ms"]), p["optimizer_ms"],
                           p["steps_planned"], p.get("plan_summary", {}).get("predicted_wall_s")))
        speedups(run["policies"])
    doc["measured_as"] = MEASURED_AS
    return doc


def speedups(policies):
    """Each policy's epoch wall against equal-tokens', measured and predicted (policies: summarize's dicts)."""
    base = next((p for p in policies if p["policy"] == BASELINE), None)
    if base is None:
        return
    for p in policies:
        for side in ("measured", "predicted"):
            p[side]["speedup_over_equal_tokens"] = base[side]["epoch_wall_s"] / p[side]["epoch_wall_s"]


def spread(runs):
    """Run-to-run spread of the same micro-batches: per micro-batch |a - b| / mean over the first two runs, as
    quantiles, and the relative difference of the measured walls."""
    if len(runs) < 2:
        return None
    a, b = runs[0], runs[1]
    rel = [abs(x - y) / ((x + y) / 2) for sa, sb in zip(a, b) for ra, rb in zip(sa, sb) for x, y in zip(ra, rb)
           if x + y]
    return quantiles(rel)


# -- execution on the device --------------------------------------------------------------------------------------

def write_data(args, model_cfg, dtype):
    """The mix's samples as a manifest whose samples of one shape share one synthetic latent (written once per
    shape): an epoch for 64 ranks holds thousands of clips, which written one by one would not fit a disk."""
    from ds_adaptiveload.data.latents import write_synthetic
    from ds_adaptiveload.schedule.manifest import write_manifest
    from ds_adaptiveload.schedule.mixes import make_mix

    folder = os.path.join(args.work, "data")
    samples = make_mix(args.mix, args.samples, args.seed)
    first = {}
    for s in samples:
        first.setdefault((s.frames, s.height, s.width), s)
    reps = [dataclasses.replace(s, id=f"shape-{i:03d}") for i, s in enumerate(first.values())]
    write_synthetic(folder, reps, text_dim=model_cfg.text_dim, max_text_len=model_cfg.text_len, seed=args.seed,
                    dtype=dtype)
    by_shape = {(r.frames, r.height, r.width): r.extra for r in reps}
    for s in samples:
        s.extra = by_shape[(s.frames, s.height, s.width)]
    path = os.path.join(folder, "manifest.jsonl")
    write_manifest(path, samples)
    return path


def build_trainer(args):
    """The trainer's engine, model and profile, set up as `train` sets them up (one process), on write_data's
    manifest."""
    import torch

    from ds_adaptiveload import train_cli
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.train import engine as eng

    eng.single_process_env()
    argv = ["--deepspeed_config", args.deepspeed_config, "--model-config", args.model_config, "--data", "-",
            "--output", os.path.join(args.work, "run"), "--max-steps", "1", "--num-workers", "0",
            "--checkpoint-blocks", args.checkpoint_blocks, "--checkpoint-policy", args.checkpoint_policy, "--overwrite"]
    if args.compile_blocks:
        argv += ["--compile-blocks", args.compile_blocks]
    targs = train_cli.parse_args(argv)
    train_cli.check(targs)  # the shipped configs found outside a checkout too
    targs.data = write_data(args, WanConfig.from_yaml(targs.model_config),
                            "bf16" if torch.cuda.is_available() else "fp32")
    from ds_adaptiveload.train.trainer import Trainer

    return Trainer(targs)


def plan_for(trainer, policy, ranks, grad_accum, budget_tokens=None):
    """The epoch plan of the trainer's samples for `ranks` virtual ranks with `policy` (the run's other keys)."""
    from ds_adaptiveload.schedule.planner import make_plan
    from ds_adaptiveload.train.config import zero_stage
    from ds_adaptiveload.train.setup import plan_checkpoint

    stage = zero_stage(trainer.ds_cfg)
    cfg = trainer.al.plan_config(ranks, 1, grad_accum, stage, **plan_checkpoint(trainer.args, stage))
    cfg = dataclasses.replace(cfg, policy=policy, pack_tokens=cfg.pack_tokens if policy == "packed" else None)
    return make_plan(trainer.samples, profile_for(trainer, budget_tokens), cfg)


def profile_for(trainer, budget_tokens):
    """The run's profile, its micro-batch budget lowered to budget_tokens where given (None: as it is)."""
    if budget_tokens is None:
        return trainer.profile
    return dataclasses.replace(trainer.profile, budget_tokens=min(budget_tokens, trainer.profile.budget_tokens))


def set_grad_accum(trainer, grad_accum):
    """The engine's accumulation window set to the replay's G (DeepSpeed's set_train_batch_size)."""
    engine = trainer.engine
    engine.set_train_batch_size(grad_accum * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    trainer.G = grad_accum


def rank_steps(trainer, plan, step):
    """Each virtual rank's loader.Step of plan step `step`: its micro-batches read by the trainer's dataset and
    built by the trainer's loader (loss weight, checkpoint counts) as in training."""
    from ds_adaptiveload.data.latents import PlannedStep
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler

    out = []
    for r in range(plan.config.dp_size):
        sampler = AdaptiveSampler(trainer.samples, trainer.profile, plan.config, r)
        sampler._plan = plan  # the plan already made, not planned again per rank
        ps = PlannedStep(sampler.step_batch(step), plan.epoch, None)
        batches = [trainer.dataset.__getitems__(list(mb)) for mb in ps.micro_batches]
        out.append(trainer.loader._step(ps, batches))
    return out


def run_rank_step(trainer, step_no, rank_step, executed):
    """Forward+backward of one virtual rank's G micro-batches through the trainer's micro-step, each timed (and its
    peak memory on CUDA), then its optimizer step, timed apart. -> (ms per micro-batch, peak GiB each, optimizer ms)."""
    import torch

    cuda = trainer.device.type == "cuda"
    times, peaks = [], []
    for g, mb in enumerate(rank_step):
        if cuda:
            torch.cuda.reset_peak_memory_stats(trainer.device)
        t0 = trainer.sync_clock()
        trainer.forward_backward(mb)
        trainer.after_micro_batch(step_no, g)  # DeepSpeed's step inside the window (no update), synchronize
        times.append((time.perf_counter() - t0) * 1000)
        peaks.append(torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None)
        executed.append(tuple(mb.indices))
    t0 = trainer.sync_clock()
    trainer.engine.step()  # the update closing the window
    trainer.accel.synchronize()
    return times, peaks, (time.perf_counter() - t0) * 1000


def replay_policy(trainer, plan, steps, repeat, deadline=None):
    """Every micro-batch of every virtual rank of the chosen steps, each step `repeat` times over (the noise
    check: the same micro-batches back to back); no further step once `deadline` (time.monotonic) is past. ->
    (runs of measured costs[step][rank][g], optimizer ms per step, peak GiB, the indices executed in the first run,
    the steps run)."""
    runs, opt, peaks, executed, done = [[] for _ in range(repeat)], [], [], [], []
    for s in steps:
        if done and deadline is not None and time.monotonic() > deadline:
            break
        ranks = rank_steps(trainer, plan, s)
        for rep in range(repeat):
            per_rank = [run_rank_step(trainer, s, rs, executed if rep == 0 else []) for rs in ranks]
            runs[rep].append([t for t, _, _ in per_rank])
            if rep == 0:
                peaks.append([p for _, p, _ in per_rank])
                opt.append(sum(o for _, _, o in per_rank) / len(per_rank))
        done.append(s)
    return runs, opt, peaks, executed, done


def warm_up(trainer, plan):
    """The first step of the first rank run once, untimed: compiled regions and DeepSpeed's buffers are built."""
    first = rank_steps(trainer, plan, 0)[0]
    run_rank_step(trainer, 0, first, [])


def replay(trainer, args, ranks, sample_steps, grad_accum):
    """Every policy's plan for `ranks` virtual ranks replayed at G = grad_accum: per policy, summarize's numbers,
    the noise check, the measured and predicted times per micro-batch."""
    set_grad_accum(trainer, grad_accum)
    plans = {p: plan_for(trainer, p, ranks, grad_accum, args.budget_tokens) for p in args.policies}
    warm_up(trainer, plans[args.policies[0]])
    out = []
    for policy, plan in plans.items():
        steps = chosen_steps(len(plan.steps), sample_steps, trainer.al.seed)
        work_s = args.repeat * sum(sum(map(sum, plan.micro_batch_ms(s))) for s in steps) / 1000
        print(f"{policy:13s} W={ranks} G={grad_accum}: {len(steps)} of {len(plan.steps)} steps, predicted compute "
              f"{work_s:.0f} s (every rank's micro-batches, {args.repeat}x)", flush=True)
        t0 = time.perf_counter()
        deadline = time.monotonic() + args.policy_s if args.policy_s else None
        runs, opt, peaks, executed, steps = replay_policy(trainer, plan, steps, args.repeat, deadline)
        doc = summarize(plan, steps, runs, opt)
        doc.update(run_s=time.perf_counter() - t0, steps=steps, optimizer_ms=opt, measured_ms=runs, peak_gib=peaks,
                   predicted_ms=[plan.micro_batch_ms(s) for s in steps], executed=executed, run_to_run=spread(runs),
                   planned=[plan.steps[s] for s in steps], planned_wall_ms=[plan.pred_wall_ms[s] for s in steps],
                   planned_rank_ms=[plan.pred_ms[s] for s in steps], plan_summary=plan.summary())
        out.append(doc)
        print(f"{policy:13s} W={ranks} G={grad_accum} steps {len(steps)}/{len(plan.steps)} ({doc['run_s']:.0f} s): "
              f"idle measured {doc['measured']['idle_fraction']:.4f} predicted {doc['predicted']['idle_fraction']:.4f};"
              f" measured/predicted {({k: round(v, 3) for k, v in doc['measured_over_predicted'].items()})}",
              flush=True)
    speedups(out)
    return {"ranks": ranks, "grad_accum": grad_accum, "sample_steps": sample_steps, "mix": args.mix,
            "budget_tokens": profile_for(trainer, args.budget_tokens).budget_tokens,
            "policies": out, "communication": comm_ms(trainer.model_cfg.num_params(), ranks, args.bus_gbps)}


def document(trainer, args, runs):
    import harness

    return {"what": __doc__.split("\n")[0], "env": harness.environment(), "argv": sys.argv, "mix": args.mix,
            "samples": args.samples, "repeat": args.repeat, "measured_as": MEASURED_AS, "profile": trainer.profile.meta,
            "communication": f"not measured (one device): excluded from every time here; each run gives a predicted "
                             f"ring reduce-scatter / all-gather of the bf16 parameter bytes at an assumed "
                             f"{args.bus_gbps} GB/s (--bus-gbps)",
            "optimizer": "one optimizer step per virtual rank per step, timed apart from the micro-batches; the "
                         "measured lockstep adds its mean per step where the prediction adds step_fixed_ms",
            "runs": runs}


def record_rows(run, raw, staging, hardware, command):
    """The results rows of one (W, G) run on a GPU: idle and speed-up over equal-tokens per policy, measured and
    predicted, and the median of measured / predicted per micro-batch (p5, p95 and max in the note)."""
    import harness

    exp = (f"Replay on one GPU, W={run['ranks']} virtual ranks, G={run['grad_accum']}, {run['mix']}, micro-batches "
           f"<= {run['budget_tokens']} tokens")
    for p in run["policies"]:
        common = dict(experiment=exp, variant=p["policy"], hardware=hardware, section="replay", zero_stage=2,
                      policy=p["policy"], model="wan 1.3b", command=command, raw_file=raw)
        note = (f"{p['steps_run']} of {p['steps_planned']} steps, each micro-batch's best of "
                f"{len(p['measured_ms'])} runs; communication excluded")
        epoch = ("; epoch wall: the plan's predicted one, measured: times measured / predicted over the steps run"
                 if p.get("plan_summary") else "")
        for status, side in (("ok", "measured"), ("predicted", "predicted")):
            harness.record(staging, metric="idle", unit="%", value=round(100 * p[side]["idle_fraction"], 2),
                           status=status, note=note, better="lower", **common)
            if "speedup_over_equal_tokens" in p[side]:
                harness.record(staging, metric="speed-up over equal-tokens", unit="x", status=status, note=note + epoch,
                               value=round(p[side]["speedup_over_equal_tokens"], 3), **common)
        q = p["measured_over_predicted"]
        harness.record(staging, metric="measured / predicted micro-batch time, median", unit="x",
                       value=round(q["p50"], 3),
                       note=f"p5 {q['p5']:.3f}, p95 {q['p95']:.3f}, max {q['max']:.3f}", **common)
        if p.get("run_to_run"):  # the noise check: the same micro-batches run again
            n = p["run_to_run"]
            harness.record(staging, metric="run-to-run difference per micro-batch, median", unit="%",
                           value=round(100 * n["p50"], 2), better="lower", **common,
                           note=f"p95 {100 * n['p95']:.2f}%, max {100 * n['max']:.2f}% (the first run of a shape "
                                f"includes its compile)")


def rank_list(text):
    """--ranks: comma-separated W or W:S (S: steps sampled from the epoch; none: every step) -> [(W, S or None)]."""
    from ds_adaptiveload.errors import UserError

    out = []
    for item in text.split(","):
        w, _, sample = item.strip().partition(":")
        if not w.isdigit() or int(w) < 1 or (sample and (not sample.isdigit() or int(sample) < 1)):
            raise UserError(f"--ranks {text}: {item!r} is not W or W:S (positive integers)")
        out.append((int(w), int(sample) if sample else None))
    return out


def int_list(text, flag):
    from ds_adaptiveload.errors import UserError

    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) > 0 for t in items):
        raise UserError(f"{flag} {text}: give positive integers separated by commas")
    return [int(t) for t in items]


def parse_args(argv=None):
    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.flags import positive_float, positive_int
    from ds_adaptiveload.schedule.mixes import MIXES
    from ds_adaptiveload.schedule.policies import REGISTRY

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed_config", default="configs/ds_zero2_bf16.json")
    ap.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    ap.add_argument("--mix", default="video-heavy", choices=sorted(MIXES))
    ap.add_argument("--samples", type=positive_int, default=320, help="samples of the synthetic epoch")
    ap.add_argument("--seed", type=int, default=0, help="the mix's samples and the sampled steps")
    ap.add_argument("--ranks", default="8", help="virtual data-parallel ranks: W or W:S (S steps sampled), "
                                                 "comma-separated (default %(default)s)")
    ap.add_argument("--grad-accum", default="4", help="G: micro-batches per rank per step, comma-separated")
    ap.add_argument("--policies", default="packed,balanced,equal-tokens",
                    help=f"comma-separated, of {', '.join(REGISTRY)}")
    ap.add_argument("--repeat", type=positive_int, default=1, help="runs of the same micro-batches (2: noise check)")
    ap.add_argument("--bus-gbps", type=positive_float, default=360.0,
                    help="assumed collective bus bandwidth in GB/s for the predicted communication (default: "
                         "%(default)s)")
    ap.add_argument("--budget-tokens", type=positive_int, default=None,
                    help="plan micro-batches of at most this many tokens (below the profile's budget: more, shorter "
                         "micro-batches, so a step of W ranks fits one device's time)")
    ap.add_argument("--budget-s", type=positive_float, default=None,
                    help="seconds for the whole replay: each policy of each (W, G) gets an equal share and runs no "
                         "further step once its share is spent (steps_run in the output; at least one step each)")
    ap.add_argument("--checkpoint-blocks", default="auto", help="the trainer's --checkpoint-blocks (default auto)")
    ap.add_argument("--checkpoint-policy", default="full", choices=("full", "attention"),
                    help="the trainer's --checkpoint-policy (the README's ZeRO-2 command: attention)")
    ap.add_argument("--compile-blocks", nargs="?", const="auto", default=None, help="the trainer's --compile-blocks")
    ap.add_argument("--out", required=True, help="folder of the raw JSON (and the staging CSV with --record)")
    ap.add_argument("--work", help="folder of the synthetic data (default: replay-work in the temporary folder)")
    ap.add_argument("--rescore", metavar="RAW", help="compute a raw file's numbers again from its times and print "
                    "them (no device); with --record, its rows too")
    ap.add_argument("--record", metavar="CSV", help="record results rows into this staging table (GPU runs only)")
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in args.policies if p not in REGISTRY]
    if bad:
        raise UserError(f"--policies {','.join(bad)}: not a policy; choose from {', '.join(REGISTRY)}")
    args.ranks, args.grad_accum = rank_list(args.ranks), int_list(args.grad_accum, "--grad-accum")
    # the synthetic shards (120 MB for 2,000 video-heavy samples) are not results: outside --out
    args.keep_work = bool(args.work)
    args.policy_s = None
    return args


def main(argv=None):
    from ds_adaptiveload.errors import UserError

    try:
        args = parse_args(argv)
        if args.rescore:
            return rescore_file(args)
        if args.record:
            import torch

            if not torch.cuda.is_available():
                raise UserError(f"--record {args.record}: results rows come from GPU runs only; leave it out on a CPU")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    args.work = args.work or tempfile.mkdtemp(prefix="replay-work-")
    t0 = time.monotonic()
    trainer = build_trainer(args)
    if args.budget_s:  # what setup (model build, first compile) left, shared equally
        left = args.budget_s - (time.monotonic() - t0)
        args.policy_s = max(1.0, left / (len(args.ranks) * len(args.grad_accum) * len(args.policies)))
    name = f"replay-{datetime.date.today().isoformat()}-{args.mix}.json"
    raw, runs = os.path.join(args.out, name), []
    for w, sample in args.ranks:
        for g in args.grad_accum:
            runs.append(replay(trainer, args, w, sample, g))
            doc = document(trainer, args, runs)
            with open(raw, "w") as f:  # after every run: a call cut later keeps what ran
                json.dump(doc, f, indent=1)
            if args.record:
                from shipped_configs import hardware

                record_rows(runs[-1], f"bench/results/{name}", args.record, hardware(doc["env"]["device"]),
                            " ".join(["python3", *sys.argv]))
            comm = runs[-1]["communication"]
            print(f"wrote {raw}; communication excluded: predicted reduce-scatter "
                  f"{comm['reduce_scatter_ms_per_micro_batch']:.1f} ms per micro-batch at W={w}, {args.bus_gbps} "
                  f"GB/s (assumed)", flush=True)
    if not args.keep_work:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


def rescore_file(args):
    """--rescore RAW: the raw file's numbers computed again (rescore) into OUT/<its name>, printed, and recorded
    with --record under the command that measured them."""
    from ds_adaptiveload.errors import UserError

    try:
        with open(args.rescore) as f:
            doc = rescore(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--rescore {args.rescore}: not a replay raw file ({type(e).__name__}: {e})")
    os.makedirs(args.out, exist_ok=True)
    name = os.path.basename(args.rescore)
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(doc, f, indent=1)
    for run in doc["runs"]:
        for p in run["policies"]:
            print(f"{p['policy']:13s} W={run['ranks']} G={run['grad_accum']}: idle measured "
                  f"{p['measured']['idle_fraction']:.4f} predicted {p['predicted']['idle_fraction']:.4f}; speed-up "
                  f"over equal-tokens measured {p['measured'].get('speedup_over_equal_tokens', 0):.3f} predicted "
                  f"{p['predicted'].get('speedup_over_equal_tokens', 0):.3f}")
        if args.record:
            from shipped_configs import hardware

            record_rows(run, f"bench/results/{name}", args.record, hardware(doc["env"]["device"]),
                        " ".join(["python3", *doc["argv"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
