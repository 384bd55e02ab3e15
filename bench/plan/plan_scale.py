"""Planning at scale: time and peak memory (RSS of a fresh process) for one epoch of N samples of the
video-heavy mix at R ranks, G = 4, balanced. The samples list is built in the same process (as a loaded
manifest would be), so the peak includes it.

    python bench/plan/plan_scale.py [--samples 10000000] [--ranks 1024] [--out bench/results/plan-scale-DATE-cpu.json]
"""
import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.harness import environment  # noqa: E402
from ds_adaptiveload.schedule.mixes import make_mix  # noqa: E402
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan  # noqa: E402
from ds_adaptiveload.schedule.profile import CostProfile  # noqa: E402


def measure(n, ranks, g=4):
    t0 = time.perf_counter()
    samples = make_mix("video-heavy", n)
    t1 = time.perf_counter()
    rss_samples = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plan = make_plan(samples, CostProfile.load("tests/data/h200-wan1.3b-blocks.yaml"),
                     PlanConfig("balanced", ranks, grad_accum=g))
    t2 = time.perf_counter()
    s = plan.summary()
    return {"samples": n, "ranks": ranks, "grad_accum": g, "build_samples_s": t1 - t0, "plan_s": t2 - t1,
            "peak_rss_after_samples_MiB": rss_samples,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "idle_fraction": s["idle_fraction"], "mix_tv": s["mix_tv"], "steps": s["steps"],
            "samples_planned": s["samples_planned"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--out")
    args = ap.parse_args()
    row = measure(args.samples, args.ranks)
    row.update(environment())  # date, machine, cpus, python, versions, git commit
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
