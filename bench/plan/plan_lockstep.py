"""Lockstep (ZeRO-2/3) planning: predicted idle, wall and step composition of equal-tokens and balanced
rounds (and the balanced window trade-off) on the video-heavy mix, with the calibrated ZeRO-3 profile and
memory for one 720p clip per micro-batch. Pure CPU, seconds.

    python bench/plan/plan_lockstep.py [--out bench/results/plan-lockstep-DATE-cpu.json]
"""
import argparse
import dataclasses
import datetime
import json
import platform

from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.profile import CostProfile

PROFILE = "bench/plan/profiles/h200-wan1.3b-calibrated-2026-11-29.yaml"  # the profile of the committed results
BUDGET = 75600
# (ranks, samples): 2 ranks is the end-to-end run's data size x 2.7; larger ones at 400 samples per rank (epochs
# of ~30 steps at G = 4: shorter ones make the ratio noisy, 1.49-1.76x at 64 per rank and 8 ranks over 3 seeds).
SIZES = ((2, 320), (8, 3200), (64, 25600), (1024, 409600))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=PROFILE)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    profile = dataclasses.replace(CostProfile.load(args.profile), budget_tokens=BUDGET)
    rows = []
    for ranks, n in SIZES:
        samples = make_mix("video-heavy", n)
        for policy, window in (("equal-tokens", None), ("balanced", None), ("balanced", 16), ("balanced", 4),
                               ("balanced", 2), ("balanced", 1)):
            cfg = PlanConfig(policy, ranks, grad_accum=args.grad_accum, lockstep=True, window=window)
            s = make_plan(samples, profile, cfg).summary()
            rows.append({**s, "window": window, "samples": n})
            print(f"ranks={ranks:5d} {policy:13s} window={window or 'epoch':5} idle={s['idle_fraction']:.3f} "
                  f"wall={s['predicted_wall_s']:.0f}s mix_tv={s['mix_tv']:.3f} micro_batches={s['micro_batches']}",
                  flush=True)
    result = {"what": __doc__.split("\n")[0], "date": datetime.date.today().isoformat(),
              "python": platform.python_version(), "profile": args.profile, "budget_tokens": BUDGET,
              "grad_accum": args.grad_accum, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
