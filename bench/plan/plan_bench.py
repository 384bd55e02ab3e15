"""Planner benchmark: predicted idle, step composition and wall time per policy, world size and G, on the
video-heavy synthetic mix (ds_adaptiveload/schedule/mixes.py) with the H200 Wan-1.3B profile; plus planning time and
peak memory for 1M samples at 1024 ranks. Pure CPU.

    python bench/plan/plan_bench.py [--samples 200000] [--big 1000000] [--out bench/results/plan-DATE-cpu.json]
"""
import argparse
import datetime
import json
import platform
import resource
import subprocess
import sys
import time

from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import POLICIES, PlanConfig, make_plan
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "configs/profiles/h200-wan1.3b-blocks.yaml"


def plan_row(samples, profile, policy, ranks, g):
    t0 = time.perf_counter()
    plan = make_plan(samples, profile, PlanConfig(policy, ranks, grad_accum=g))
    return {**plan.summary(), "plan_seconds": time.perf_counter() - t0}


def big_run(n, ranks, g):
    """In a fresh process so that its peak RSS is the planner's own."""
    code = (f"import json,time,resource\nfrom ds_adaptiveload.schedule.mixes import make_mix\n"
            f"from ds_adaptiveload.schedule.planner import PlanConfig, make_plan\n"
            f"from ds_adaptiveload.schedule.profile import CostProfile\n"
            f"s = make_mix('video-heavy', {n}); p = CostProfile.load('{PROFILE}')\n"
            f"rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"t = time.perf_counter(); plan = make_plan(s, p, PlanConfig('balanced', {ranks}, grad_accum={g}))\n"
            f"dt = time.perf_counter() - t\n"
            f"print(json.dumps({{**plan.summary(), 'plan_seconds': dt, 'rss_before_MiB': rss0 / 1024, "
            f"'peak_rss_MiB': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200000)
    ap.add_argument("--big", type=int, default=1000000)
    ap.add_argument("--out")
    args = ap.parse_args()
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
        "cpus": __import__("os").cpu_count(), "python": platform.python_version(), "profile": PROFILE,
        "samples": args.samples, "samples_1024": args.big, "rows": rows, "timing_1024": timing,
    }
    out = args.out or f"bench/results/plan-{result['date']}-cpu.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
