"""Planner benchmark: predicted idle, step composition and wall time per policy, world size and G, on the
video-heavy synthetic mix (ds_adaptiveload/schedule/mixes.py) with the H200 Wan-1.3B profile; plus planning time and
peak memory for 1M samples at 1024 ranks. Pure CPU.

    python bench/plan/plan_bench.py [--samples 200000] [--big 1000000] [--out bench/results/plan-DATE-cpu.json]
    python bench/plan/plan_bench.py --section packed [--out bench/results/plan-packed-DATE-cpu.json]
    python bench/plan/plan_bench.py --section sizes [--out bench/results/plan-sizes-DATE-cpu.json]

--section baselines: every policy and baseline (schedule/policies/baselines.py: runtime LPT, TRL's sum of L^2, an
Open-Sora bucket table) through one checker (schedule/bound.check_plan), each one's gap to the lower bound
(schedule/bound.py), under lockstep with the calibrated H200 profile, on the bench's mixes and the held-out ones, at
memory for --budgets 720p clips (default 1, 2, 3 and 6) and --ranks world sizes (--rank-samples: a larger epoch at a
large world size; --names: some planners only); then, unless --big 0, packed's planning time and peak memory for
--big samples at 1024 ranks per budget. --record FILES... records the rows and prints docs/scheduler.md's table:

    nice -n 10 python bench/plan/plan_bench.py --section baselines --samples 20000 --ranks 8,64,1024 \
        --rank-samples 1024=200000 --budgets 1,2,3,4,5,6 --big 0 [--mixes a,b] [--names packed,equal-tokens]

--section timing: packed's planning time (wall and CPU), load average and peak memory for --big samples at 1024 ranks,
per budget and G = 1 and 4 (record the raw file with --record-timing RAW):

    nice -n 10 python bench/plan/plan_bench.py --section timing --big 1000000 --big-budgets 1,2,3,4,5,6

--section composition: packed's heavy_mix (0 to 0.2) against mix_tv, gap to the bound and idle, beside equal-tokens'
mix_tv, at one clip of memory, G = 1, lockstep (record the raw file with --record-composition RAW):

    nice -n 10 python bench/plan/plan_bench.py --section composition --samples 20000 --big 200000

--section replicate: packed's light runs as it chooses them, always on and always off, beside equal-tokens, on the
baselines section's cases (same --mixes, --budgets, --ranks, --rank-samples; record with --record-replicate RAW):

    nice -n 10 python bench/plan/plan_bench.py --section replicate --samples 20000 --ranks 8,64,1024 \
        --rank-samples 1024=200000 --budgets 1,2,3,4,5,6

--section packed: the packed policy against equal-tokens and balanced under lockstep (ZeRO-3) with the
calibrated H200 profile, memory for about six 720p clips (453,600 tokens) and for one (75,693: one
81x720x1280 clip and its memory.sample_tokens), on the video-heavy and image-heavy mixes; at the one-clip
budget also packed with replicate off (rows with "replicate": false). --section sizes: packed against balanced
at the one-clip budget on epochs of 10,000-40,000 samples (8 ranks).
"""
import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time

from ds_adaptiveload.schedule.bound import check_plan
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, baseline_plan, make_plan
from ds_adaptiveload.schedule.policies import POLICIES
from ds_adaptiveload.schedule.policies.baselines import BASELINES
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "tests/data/h200-wan1.3b-blocks.yaml"


CALIBRATED = "configs/profiles/h200-wan1.3b-zero3.yaml"
PACKED_BUDGETS = (453600, 75693)  # about six 720p clips per micro-batch; one (75,600 + sample_tokens)
PACKED_MIXES = ("video-heavy", "image-heavy")
SWEEP_MIXES = ("video-heavy", "image-heavy", "openvid-720p", "worldmodel", "panda-web")
NAMES = ("equal-tokens", "balanced", "packed", *BASELINES)
CLIP = 75600  # one 81x720x1280 clip
COMPOSITION_MIXES = (0.0, 0.02, 0.05, 0.1, 0.2)  # --section composition: the heavy_mix values tried
SAMPLE_TOKENS = 93  # the calibrated profile's memory.sample_tokens (92.5), rounded up


def clips_budget(clips):
    """budget_tokens for memory of `clips` 720p clips: each clip and its per-sample share."""
    return clips * CLIP + SAMPLE_TOKENS


def budget_clips(budget):
    """The 720p clips of memory a clips_budget stands for."""
    return round((budget - SAMPLE_TOKENS) / CLIP)


def packed_plan(samples, base, clips, g, ranks=1024):
    """packed's lockstep plan of `samples` at `clips` clips of memory with profile `base` (the planning-time case of
    the timing section, bench/plan/plan_phases.py and plan_hash.py)."""
    profile = dataclasses.replace(base, budget_tokens=clips_budget(clips))
    return make_plan(samples, profile, PlanConfig("packed", ranks, grad_accum=g, lockstep=True))


def plan_row(samples, profile, policy, ranks, g, lockstep=False, **extra):
    t0 = time.perf_counter()
    plan = make_plan(samples, profile, PlanConfig(policy, ranks, grad_accum=g, lockstep=lockstep, **extra))
    return {**plan.summary(), "plan_seconds": time.perf_counter() - t0, **extra}


def big_run(n, ranks, g, policy="balanced", profile=PROFILE, budget=None, lockstep=False, mix="video-heavy"):
    """In a fresh process so that its peak RSS is the planner's own."""
    code = (f"import json,time,resource,dataclasses\nfrom ds_adaptiveload.schedule.mixes import make_mix\n"
            f"from ds_adaptiveload.schedule.planner import PlanConfig, make_plan\n"
            f"from ds_adaptiveload.schedule.profile import CostProfile\n"
            f"s = make_mix('{mix}', {n}); p = CostProfile.load('{profile}')\n"
            + (f"p = dataclasses.replace(p, budget_tokens={budget})\n" if budget else "") +
            f"rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"load = __import__('os').getloadavg()[0]\n"
            f"t, c = time.perf_counter(), time.process_time()\n"
            f"plan = make_plan(s, p, PlanConfig('{policy}', {ranks}, grad_accum={g}, lockstep={lockstep}))\n"
            f"dt, dc = time.perf_counter() - t, time.process_time() - c\n"
            f"print(json.dumps({{**plan.summary(), 'plan_seconds': dt, 'plan_cpu_seconds': dc, "
            f"'load_avg_1min': [load, __import__('os').getloadavg()[0]], 'rss_before_MiB': rss0 / 1024, "
            f"'peak_rss_MiB': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def packed_section(args):
    """packed vs equal-tokens and balanced under lockstep, per mix, budget, world size and G."""
    base = CostProfile.load(CALIBRATED)
    rows = []
    for mix in PACKED_MIXES:
        small, big = make_mix(mix, args.samples), make_mix(mix, args.big)
        for budget in PACKED_BUDGETS:
            profile = dataclasses.replace(base, budget_tokens=budget)
            for ranks in ((8, 64, 1024) if budget == PACKED_BUDGETS[0] else (8, 64)):
                for g in (1, 4):
                    # packed chooses replicate itself (runs of R at the one-clip budget); the row with
                    # replicate off shows what the runs change there
                    variants = [("equal-tokens", {}), ("balanced", {}), ("packed", {})]
                    if budget == PACKED_BUDGETS[1]:
                        variants.append(("packed", {"replicate": False}))
                    for policy, extra in variants:
                        row = {**plan_row(small if ranks < 1024 else big, profile, policy, ranks, g, True, **extra),
                               "mix": mix, "budget_tokens": budget, "lockstep": True}
                        rows.append(row)
                        name = policy + ("/no-runs" if extra else "")
                        print(f"{mix:11s} budget={budget} ranks={ranks:5d} G={g} {name:16s} "
                              f"idle={row['idle_fraction']:.4f} mix_tv={row['mix_tv']:.3f} "
                              f"wall={row['predicted_wall_s']:.0f}s plan={row['plan_seconds']:.1f}s", flush=True)
    timing = [big_run(args.big, 1024, g, "packed", CALIBRATED, PACKED_BUDGETS[0], True) for g in (4, 1)]
    for t in timing:
        print(f"packed, 1024 ranks, {args.big} samples, G={t['grad_accum']}: plan {t['plan_seconds']:.1f}s, "
              f"peak RSS {t['peak_rss_MiB']:.0f} MiB", flush=True)
    # one clip per micro-batch at 1024 ranks (video-heavy): packed's runs of 1024 against balanced
    one_clip_1024 = [big_run(args.big, 1024, g, policy, CALIBRATED, PACKED_BUDGETS[1], True)
                     for g in (1, 4) for policy in ("balanced", "packed")]
    for t in one_clip_1024:
        print(f"one clip, 1024 ranks, G={t['grad_accum']} {t['policy']:9s} idle={t['idle_fraction']:.4f} "
              f"mix_tv={t['mix_tv']:.3f} wall={t['predicted_wall_s']:.0f}s plan {t['plan_seconds']:.1f}s", flush=True)
    return {
        "what": "Predicted balance under lockstep (ZeRO-3: a step costs the sum over its G rounds of the slowest "
                "micro-batch) of packed, balanced and equal-tokens with the calibrated H200 Wan-1.3B profile at "
                "budget_tokens 453,600 (about six 720p clips) and 75,693 (one). idle_fraction = 1 - sum(mean rank "
                "time) / sum(step wall); mix_tv = mean per-step total-variation distance of class shares.",
        "profile": CALIBRATED, "samples": args.samples, "samples_1024": args.big, "rows": rows,
        "timing_1024": timing, "one_clip_1024": one_clip_1024,
    }


def sweep_row(samples, profile, name, cfg):
    """One policy's or baseline's plan, checked, as a row with its gap to the lower bound."""
    t0 = time.perf_counter()
    if name in POLICIES:
        plan = make_plan(samples, profile, dataclasses.replace(cfg, policy=name))
    else:
        plan = baseline_plan(name, samples, profile, cfg)
    seconds = time.perf_counter() - t0
    check_plan(plan, profile)
    return {**plan.summary(), "policy": name, "plan_seconds": seconds, "bound": plan.bound}


def sweep_cases(args):
    """(mix, clips, profile, samples, cfg) for every case of the sweep: --mixes x --budgets (720p clips of memory) x
    --ranks x G = 1 and 4, lockstep, the calibrated profile; each mix's epochs made once per size (--rank-samples)."""
    base = CostProfile.load(CALIBRATED)
    sizes = {int(r): int(n) for r, n in (kv.split("=") for kv in args.rank_samples.split(",") if kv)}
    for mix in args.mixes.split(","):
        epochs = {n: make_mix(mix, n) for n in {sizes.get(int(r), args.samples) for r in args.ranks.split(",")}}
        for clips in map(int, args.budgets.split(",")):
            profile = dataclasses.replace(base, budget_tokens=clips_budget(clips))
            for ranks in map(int, args.ranks.split(",")):
                for g in (1, 4):
                    yield (mix, clips, profile, epochs[sizes.get(ranks, args.samples)],
                           PlanConfig("packed", ranks, grad_accum=g, lockstep=True))


def baselines_section(args):
    """Every policy and baseline against the lower bound, per mix, budget, world size and G (lockstep)."""
    rows = []
    names = args.names.split(",") if args.names else NAMES
    for mix, clips, profile, samples, cfg in sweep_cases(args):
        ranks, g = cfg.dp_size, cfg.grad_accum
        for name in names:
            row = {**sweep_row(samples, profile, name, cfg), "mix": mix, "budget_tokens": profile.budget_tokens}
            rows.append(row)
            print(f"{mix:12s} clips={clips} ranks={ranks:4d} G={g} {name:12s} gap={row['bound_gap']:.4f} "
                  f"idle={row['idle_fraction']:.4f} mix_tv={row['mix_tv']:.3f} "
                  f"wall={row['predicted_wall_s']:.0f}s plan={row['plan_seconds']:.1f}s", flush=True)
    timing = []
    for clips in (map(int, args.big_budgets.split(",")) if args.big else ()):
        for g in (1, 4):
            t = {**big_run(args.big, 1024, g, "packed", CALIBRATED, clips_budget(clips), True, args.big_mix),
                 "budget_tokens": clips_budget(clips), "mix": args.big_mix}
            timing.append(t)
            print(f"packed, {args.big_mix}, 1024 ranks, {args.big} samples, {clips} clips, G={g}: plan "
                  f"{t['plan_seconds']:.1f}s, peak RSS {t['peak_rss_MiB']:.0f} MiB, gap {t['bound_gap']:.4f}", flush=True)
    return {"what": "Predicted epoch wall time under lockstep (ZeRO-2/3) of every policy and baseline against a lower "
                    "bound (schedule/bound.py), calibrated H200 Wan-1.3B profile; budget_tokens = clips * 75,600 + 93. "
                    "bound_gap = wall / bound - 1; mix_tv = mean per-step total-variation distance of class shares. "
                    "Baselines tuned over their knob on the same epoch (schedule/policies/baselines.py).",
            "profile": CALIBRATED, "samples": args.samples, "samples_1024": args.big, "rows": rows, "timing_1024": timing,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def record_baselines(*raws):
    """results.csv rows from --section baselines raw files (merged; a later file's row for the same case wins): per
    mix, world size and planner, the worst gap to the lower bound over budgets and G (predicted); packed's planning
    time for the big epoch where a file has it. Prints the Markdown table docs/scheduler.md shows ("-": not run)
    and where a baseline beats packed or packed's mix_tv is above equal-tokens'."""
    from bench.harness import forget, record

    res, cases = {}, {}
    for raw in raws:
        with open(raw) as f:
            res[raw] = json.load(f)
        for r in res[raw]["rows"]:
            cases[(r["mix"], r["dp_size"], r["budget_tokens"], r["grad_accum"], r["policy"])] = (r, raw)
    groups = {}
    for (mix, ranks, _, _, name), (r, raw) in cases.items():
        groups.setdefault((mix, ranks), {}).setdefault(name, []).append((r, raw))
    forget(metric="worst gap to the lower bound (predicted)", section="scheduler")  # the sweep's rows, any key
    print("| mix | ranks | " + " | ".join(NAMES) + " |\n|---|---|" + "---|" * len(NAMES))
    order = {m: j for j, m in enumerate(SWEEP_MIXES)}
    for (mix, ranks), by in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0])):
        cells = []
        eq = {(r["budget_tokens"], r["grad_accum"]): r["mix_tv"] for r, _ in by.get("equal-tokens", ())}
        for name in NAMES:
            if name not in by:
                cells.append("-")
                continue
            rows = [r for r, _ in by[name]]
            worst = max(rows, key=lambda r: r["bound_gap"])
            tv_over = sum(r["mix_tv"] > eq.get((r["budget_tokens"], r["grad_accum"]), 1) + 1e-9 for r in rows)
            clips = sorted({budget_clips(r["budget_tokens"]) for r in rows})
            first, raw = by[name][0]
            n = first.get("samples_total", res[raw]["samples"])  # older raw files hold fewer columns
            cells.append(f"{100 * worst['bound_gap']:.2f}% / {max(r['mix_tv'] for r in rows):.2f}")
            record(experiment=f"plan_bench.py --section baselines, {mix} mix, {n:,} samples, "
                              f"{_span(clips)} clips of memory, G = 1 and 4, lockstep",
                   variant=name, metric="worst gap to the lower bound (predicted)", unit="%",
                   value=round(100 * worst["bound_gap"], 3), status="predicted", hardware=f"{ranks}x H200",
                   gpus=ranks, policy=name if name in POLICIES else "", model="Wan2.1 1.3B",
                   command=_sweep_cmd(res[raw], clips, mix, ranks, n),
                   raw_file=";".join(sorted({w for _, w in by[name]})),
                   section="scheduler", better="lower", date=res[raw]["date"],
                   note=f"at {worst['budget_tokens']:,} tokens, G={worst['grad_accum']}; mean gap "
                        f"{100 * sum(r['bound_gap'] for r in rows) / len(rows):.2f}%; mix_tv up to "
                        f"{max(r['mix_tv'] for r in rows):.3f}, above equal-tokens' in {tv_over} of {len(rows)}")
        print(f"| {mix} | {ranks} | " + " | ".join(cells) + " |")
    _print_wins(cases)
    for raw in raws:
        if res[raw].get("timing_1024"):
            record_timing(raw, _sweep_cmd(res[raw], [1, 6]).replace("--big 0", "--big 1000000 --big-budgets 1"))


def _span(clips):
    return f"{clips[0]} to {clips[-1]}" if clips == list(range(clips[0], clips[-1] + 1)) and len(clips) > 2 else \
        " and ".join(map(str, clips))


def _sweep_cmd(res, clips, mix="", ranks=0, n=0):
    """The command that plans one row group again (one mix at one world size, its epoch size where not --samples)."""
    cmd = (f"nice -n 10 python bench/plan/plan_bench.py --section baselines --samples {res['samples']} "
           f"--budgets {','.join(map(str, clips))} --big 0")
    if mix:
        cmd += f" --mixes {mix} --ranks {ranks}" + (f" --rank-samples {ranks}={n}" if n != res["samples"] else "")
    return cmd


def _print_wins(cases):
    """The cases where a baseline predicts less wall time than packed, and where packed's mix_tv is above
    equal-tokens'."""
    for (mix, ranks, budget, g, name), (r, _) in sorted(cases.items()):
        p = cases.get((mix, ranks, budget, g, "packed"), (None,))[0]
        if p is None or name == "packed":
            continue
        clips = budget_clips(budget)
        if r["predicted_wall_s"] < p["predicted_wall_s"]:
            print(f"{name} beats packed: {mix}, {ranks} ranks, {clips} clips, G={g}: gap {100 * r['bound_gap']:.2f}% "
                  f"vs {100 * p['bound_gap']:.2f}%, mix_tv {r['mix_tv']:.3f} vs {p['mix_tv']:.3f}")
        if name == "equal-tokens" and p["mix_tv"] > r["mix_tv"] + 1e-9:
            print(f"packed mix_tv above equal-tokens': {mix}, {ranks} ranks, {clips} clips, G={g}: "
                  f"{p['mix_tv']:.3f} vs {r['mix_tv']:.3f} (gap {100 * p['bound_gap']:.2f}%)")


def record_timing(raw, cmd):
    """results.csv rows of packed's planning time for the big epoch at 1024 ranks, per budget and G."""
    from bench.harness import record

    with open(raw) as f:
        tim = json.load(f)
    for t in tim["timing_1024"]:
        cpu = f"{t['plan_cpu_seconds']:.1f} s of CPU; " if "plan_cpu_seconds" in t else ""
        load = (f"load average {t['load_avg_1min'][0]:.1f} before, {t['load_avg_1min'][1]:.1f} after; "
                if "load_avg_1min" in t else "")
        common = dict(experiment=f"plan_bench.py --section baselines, packed planning {t['samples_total']:,} "
                                 f"{t.get('mix', 'openvid-720p')} samples for 1024 ranks, "
                                 f"{t.get('budget_tokens', 75693):,} tokens, lockstep",
                      variant=f"packed, G={t['grad_accum']}", unit="s", hardware="CPU (2 cores, shared)", gpus=0,
                      policy="packed", command=cmd, raw_file=raw, section="scheduler", date=tim["date"],
                      note=f"{cpu}{load}peak RSS {t['peak_rss_MiB']:.0f} MiB; gap to the bound "
                           f"{100 * t['bound_gap']:.2f}%; {t.get('uptime_after', tim.get('uptime', ''))}")
        record(metric="planning time", value=round(t["plan_seconds"], 1), **common)
        if "plan_cpu_seconds" in t:  # the machine is shared: CPU time is the planner's own cost
            record(metric="planning CPU time", value=round(t["plan_cpu_seconds"], 1), better="lower", **common)


def timing_section(args):
    """packed's planning time, CPU time and peak memory for --big samples of --big-mix at 1024 ranks, per budget of
    --big-budgets (720p clips) and G = 1 and 4, lockstep, each in a fresh process."""
    timing = []
    for clips in map(int, args.big_budgets.split(",")):
        for g in (1, 4):
            t = {**big_run(args.big, 1024, g, "packed", CALIBRATED, clips_budget(clips), True, args.big_mix),
                 "budget_tokens": clips_budget(clips), "mix": args.big_mix}
            timing.append(t)
            print(f"packed, {args.big_mix}, 1024 ranks, {args.big} samples, {clips} clips, G={g}: plan "
                  f"{t['plan_seconds']:.1f}s ({t['plan_cpu_seconds']:.1f}s CPU, load {t['load_avg_1min'][0]:.1f}), "
                  f"peak RSS {t['peak_rss_MiB']:.0f} MiB, gap {t['bound_gap']:.4f}", flush=True)
    return {"what": "packed's planning time (wall and CPU) and peak RSS (the planning process, manifest included) "
                    "at 1024 ranks, lockstep, calibrated H200 Wan-1.3B profile; budget_tokens = clips * 75,600 + 93",
            "profile": CALIBRATED, "samples_1024": args.big, "timing_1024": timing,
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def sizes_section(args):
    """packed against balanced at the one-clip budget on smaller epochs (8 ranks, lockstep): where the runs'
    remainders weigh more."""
    profile = dataclasses.replace(CostProfile.load(CALIBRATED), budget_tokens=PACKED_BUDGETS[1])
    rows = []
    for n in (10000, 20000, 40000):
        for mix in PACKED_MIXES:
            samples = make_mix(mix, n)
            for g in (1, 4):
                for policy in ("balanced", "packed"):
                    row = {**plan_row(samples, profile, policy, 8, g, True), "mix": mix,
                           "budget_tokens": PACKED_BUDGETS[1], "lockstep": True}
                    rows.append(row)
                    print(f"{mix:11s} samples={n} G={g} {policy:9s} idle={row['idle_fraction']:.5f} "
                          f"mix_tv={row['mix_tv']:.3f}", flush=True)
    return {"what": "packed vs balanced at budget_tokens 75,693 (one 720p 81f clip), 8 ranks, lockstep, on epochs of "
                    "10,000-40,000 samples", "profile": CALIBRATED, "rows": rows}


def composition_section(args):
    """packed's heavy_mix against its mix_tv, gap to the lower bound and idle, with equal-tokens' mix_tv beside it,
    per mix at 64 ranks and (video-heavy, image-heavy) at 1024, memory for one 720p clip, G = 1, lockstep."""
    profile = dataclasses.replace(CostProfile.load(CALIBRATED), budget_tokens=clips_budget(1))
    cases = [(mix, 64, args.samples) for mix in SWEEP_MIXES] + [(m, 1024, args.big) for m in PACKED_MIXES]
    rows = []
    for mix, ranks, n in cases:
        samples = make_mix(mix, n)
        cfg = PlanConfig("packed", ranks, lockstep=True)
        eq_tv = sweep_row(samples, profile, "equal-tokens", cfg)["mix_tv"]
        for f in COMPOSITION_MIXES:
            row = {**sweep_row(samples, profile, "packed", dataclasses.replace(cfg, heavy_mix=f)), "mix": mix,
                   "heavy_mix": f, "equal_tokens_mix_tv": eq_tv, "budget_tokens": profile.budget_tokens}
            rows.append(row)
            print(f"{mix:12s} ranks={ranks:4d} heavy_mix={f:.2f} mix_tv={row['mix_tv']:.4f} (equal-tokens "
                  f"{eq_tv:.4f}) gap={row['bound_gap']:.4f} idle={row['idle_fraction']:.4f}", flush=True)
    return {"what": "packed's heavy_mix (the share of a heavy round's slots left to light samples): step composition "
                    "(mix_tv, mean per-step total-variation distance of class shares by sample count) against balance "
                    "(bound_gap = wall / lower bound - 1; idle_fraction) under lockstep, G = 1, calibrated H200 "
                    "Wan-1.3B profile, budget_tokens 75,693 (one 720p clip); equal_tokens_mix_tv: equal-tokens' on "
                    "the same epoch", "profile": CALIBRATED, "samples": args.samples, "samples_1024": args.big,
            "rows": rows, "command": "nice -n 10 python " + " ".join(sys.argv),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def record_composition(raw):
    """results.csv rows from a --section composition raw file: per mix and world size, the smallest heavy_mix whose
    mix_tv is at most equal-tokens' (else the largest tried) and its gap to the lower bound."""
    from bench.harness import record

    with open(raw) as f:
        res = json.load(f)
    cases = {}
    for r in res["rows"]:
        cases.setdefault((r["mix"], r["dp_size"]), []).append(r)
    for (mix, ranks), rows in cases.items():
        rows.sort(key=lambda r: r["heavy_mix"])
        r = next((r for r in rows if r["mix_tv"] <= r["equal_tokens_mix_tv"]), rows[-1])
        first = rows[0]
        record(experiment=f"plan_bench.py --section composition, {mix} mix, {r['samples_total']:,} samples, "
                          f"75,693 tokens (one 720p clip), G = 1, lockstep",
               variant=f"packed, heavy_mix {r['heavy_mix']}", metric="gap to the lower bound (predicted)", unit="%",
               value=round(100 * r["bound_gap"], 3), status="predicted", hardware=f"{ranks}x H200", gpus=ranks,
               policy="packed", model="Wan2.1 1.3B", command="nice -n 10 python bench/plan/plan_bench.py --section "
               f"composition --samples {res['samples']} --big {res['samples_1024']}", raw_file=raw,
               section="scheduler", better="lower", date=res["date"],
               note=f"mix_tv {r['mix_tv']:.3f} against equal-tokens' {r['equal_tokens_mix_tv']:.3f}"
                    + ("" if r["mix_tv"] <= r["equal_tokens_mix_tv"] else " (above it at every heavy_mix tried)")
                    + f"; at heavy_mix 0: mix_tv {first['mix_tv']:.3f}, gap {100 * first['bound_gap']:.2f}%")


REPLICATE = (("auto", None), ("on", True), ("off", False))  # --section replicate: packed's replicate settings


def meets(r) -> bool:
    """Both of issue 58's targets: within 1% of the lower bound, mix_tv at most equal-tokens' on the same epoch."""
    return r["bound_gap"] <= 0.01 and r["mix_tv"] <= r["equal_tokens_mix_tv"] + 1e-9


def replicate_section(args):
    """packed with light runs (replicate) chosen by the planner, always on and always off, beside equal-tokens, on
    the sweep's cases: how far the runs' choice alone moves step composition (mix_tv) against balance."""
    rows = []
    for mix, clips, profile, samples, cfg in sweep_cases(args):
        eq = sweep_row(samples, profile, "equal-tokens", cfg)
        for label, rep in REPLICATE:
            row = {**sweep_row(samples, profile, "packed", dataclasses.replace(cfg, replicate=rep)),
                   "mix": mix, "budget_tokens": profile.budget_tokens, "replicate": label,
                   "equal_tokens_mix_tv": eq["mix_tv"], "equal_tokens_gap": eq["bound_gap"]}
            rows.append(row)
            print(f"{mix:12s} clips={clips} ranks={cfg.dp_size:4d} G={cfg.grad_accum} replicate={label:4s} "
                  f"gap={row['bound_gap']:.4f} mix_tv={row['mix_tv']:.3f} (equal-tokens {eq['mix_tv']:.3f})",
                  flush=True)
    return {"what": "packed's light runs (replicate: auto, on, off) against the lower bound (bound_gap = wall / bound "
                    "- 1) and step composition (mix_tv), with equal-tokens' mix_tv on the same epoch; lockstep, "
                    "calibrated H200 Wan-1.3B profile, budget_tokens = clips * 75,600 + 93",
            "profile": CALIBRATED, "samples": args.samples, "rows": rows, "command": "nice -n 10 python " +
            " ".join(sys.argv), "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


def record_replicate(raw):
    """results.csv rows from a --section replicate raw file: per mix and world size, the cases (budgets and G) where
    packed is within 1% of the bound with mix_tv at most equal-tokens', for each replicate setting and for the
    better of on and off per case."""
    from bench.harness import record

    with open(raw) as f:
        res = json.load(f)
    groups = {}
    for r in res["rows"]:
        groups.setdefault((r["mix"], r["dp_size"]), {}).setdefault((r["budget_tokens"], r["grad_accum"]), {})[
            r["replicate"]] = r

    for (mix, ranks), cases in groups.items():
        runs = list(cases.values())
        clips = sorted({budget_clips(b) for b, _ in cases})
        counts = {f"replicate {label}": [c[label] for c in runs] for label, _ in REPLICATE}
        counts["replicate on or off, the better per case"] = [
            next((c[k] for k in ("on", "off") if meets(c[k])), c["auto"]) for c in runs]
        for variant, rows in counts.items():
            record(experiment=f"plan_bench.py --section replicate, {mix} mix, {rows[0]['samples_total']:,} samples, "
                              f"{_span(clips)} clips of memory, G = 1 and 4, lockstep",
                   variant=f"packed, {variant}", unit="x", value=sum(map(meets, rows)), status="predicted",
                   metric="cases within 1% of the bound with mix_tv at most equal-tokens' (predicted)",
                   hardware=f"{ranks}x H200", gpus=ranks, policy="packed", model="Wan2.1 1.3B",
                   command=res["command"], raw_file=raw, section="scheduler", better="higher", date=res["date"],
                   note=f"of {len(rows)} cases; within 1% of the bound in {sum(r['bound_gap'] <= 0.01 for r in rows)}, "
                        f"mix_tv at most equal-tokens' in "
                        f"{sum(r['mix_tv'] <= r['equal_tokens_mix_tv'] + 1e-9 for r in rows)}")


def all_section(args):
    """Every policy on the video-heavy mix with the block profile at 8, 64 and 1024 ranks, at memory for one clip and
    (8 ranks) for three, and balanced's planning time for --big samples at 1024 ranks."""
    profile = CostProfile.load(PROFILE)
    samples = make_mix("video-heavy", args.samples)
    big = make_mix("video-heavy", args.big)
    rows = []
    for ranks in (8, 64, 1024):
        data = samples if ranks < 1024 else big
        for g in (1, 4):
            for policy in POLICIES:
                row = plan_row(data, profile, policy, ranks, g)
                rows.append(row)
                print(f"ranks={ranks:5d} G={g} {policy:13s} idle={row['idle_fraction']:.3f} "
                      f"mix_tv={row['mix_tv']:.3f} wall={row['predicted_wall_s']:.0f}s "
                      f"plan={row['plan_seconds']:.1f}s", flush=True)
    # The paper's regime: memory for several long clips per micro-batch (3 x 75,600 tokens).
    roomy = CostProfile.from_dict({**profile.to_dict(), "memory": {"budget_tokens": 3 * 75600}})
    for g in (1, 4):
        for policy in POLICIES:
            row = {**plan_row(samples, roomy, policy, 8, g), "budget_tokens": roomy.budget_tokens}
            rows.append(row)
            print(f"budget 226800 ranks=8 G={g} {policy:13s} idle={row['idle_fraction']:.3f} "
                  f"mix_tv={row['mix_tv']:.3f} wall={row['predicted_wall_s']:.0f}s", flush=True)
    timing = [big_run(args.big, 1024, g) for g in (4, 1)]
    for t in timing:
        print(f"1024 ranks, {args.big} samples, G={t['grad_accum']}: plan {t['plan_seconds']:.1f}s, "
              f"peak RSS {t['peak_rss_MiB']:.0f} MiB", flush=True)
    result = {
        "what": "Predicted balance of each policy on the video-heavy mix with the H200 Wan-1.3B block profile "
                "(budget 75,600 tokens unless budget_tokens is given). idle_fraction = 1 - sum(mean rank time) / "
                "sum(max rank time) over steps; mix_tv = mean per-step total-variation distance of class shares.",
        "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "profile": PROFILE,
        "samples": args.samples, "samples_1024": args.big, "rows": rows, "timing_1024": timing,
    }
    return result


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("--big", type=int, default=1000000)
    ap.add_argument("--section", choices=("all", "packed", "sizes", "baselines", "timing", "composition",
                                          "replicate"),
                    default="all")
    ap.add_argument("--mixes", default=",".join(SWEEP_MIXES), help="--section baselines, replicate: mixes to plan")
    ap.add_argument("--budgets", default="1,2,3,6", help="--section baselines, replicate: budgets, in 720p clips")
    ap.add_argument("--ranks", default="8,64", help="--section baselines, replicate: world sizes")
    ap.add_argument("--rank-samples", default="", metavar="R=N,...",
                    help="--section baselines, replicate: epoch size N at world size R instead of --samples "
                         "(e.g. 1024=200000)")
    ap.add_argument("--names", help="--section baselines: the policies and baselines to plan (default: all)")
    ap.add_argument("--big-budgets", default="1,6", help="--section baselines, timing: budgets of the --big timing")
    ap.add_argument("--big-mix", default="openvid-720p", help="--section baselines, timing: mix of the --big timing")
    ap.add_argument("--out")
    ap.add_argument("--record", nargs="+", metavar="RAW",
                    help="record --section baselines raw files (merged, a later file's case wins) into results.csv")
    ap.add_argument("--record-timing", metavar="RAW", help="record a --section timing raw file into results.csv")
    ap.add_argument("--record-composition", metavar="RAW",
                    help="record a --section composition raw file into results.csv")
    ap.add_argument("--record-replicate", metavar="RAW", help="record a --section replicate raw file into results.csv")
    return ap.parse_args()


def bench_env() -> dict:
    """Where and when a section ran: date, CPU, Python and the load beside it (the raw file's header)."""
    return {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1min": os.getloadavg()[0]}


def main():
    args = parse_args()
    if args.record_replicate:
        return record_replicate(args.record_replicate)
    if args.record_composition:
        return record_composition(args.record_composition)
    if args.record_timing:
        return record_timing(args.record_timing, "nice -n 10 python bench/plan/plan_bench.py --section timing "
                                                 "--big 1000000 --big-budgets 1,2,3,4,5,6")
    if args.record:
        return record_baselines(*args.record)
    env = bench_env()
    if args.section != "all":
        section = {"packed": packed_section, "sizes": sizes_section, "baselines": baselines_section,
                   "timing": timing_section, "composition": composition_section,
                   "replicate": replicate_section}[args.section]
        result = {**section(args), **env}
        out = args.out or f"bench/results/plan-{args.section}-{result['date']}-cpu.json"
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", out)
        return
    result = all_section(args)
    out = args.out or f"bench/results/plan-{result['date']}-cpu.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
