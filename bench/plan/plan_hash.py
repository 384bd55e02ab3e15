"""A sha256 of packed's plans of 1M openvid-720p samples at 1024 ranks (lockstep, calibrated H200 profile) per
CLIPSxG case, and its CPU seconds: run on two checkouts (PYTHONPATH set to each) to check that a faster planner makes
the same plans at the planning-time benchmark's size, which tests/test_plan_digests.py (3,000 samples) does not reach.

    PYTHONPATH=. python bench/plan/plan_hash.py 1x1 1x4 2x1 2x4 3x1 3x4 4x1 4x4 5x1 5x4 6x1 6x4
"""
import argparse
import hashlib
import time

from plan_bench import CALIBRATED, packed_plan

from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.profile import CostProfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", metavar="CLIPSxG")
    ap.add_argument("--samples", type=int, default=1000000)
    args = ap.parse_args()
    samples = make_mix("openvid-720p", args.samples)
    base = CostProfile.load(CALIBRATED)
    for case in args.cases:
        clips, g = map(int, case.split("x"))
        t = time.process_time()
        plan = packed_plan(samples, base, clips, g)
        cpu = time.process_time() - t
        digest = hashlib.sha256(repr((plan.steps, sorted(plan.pad))).encode()).hexdigest()
        print(f"{case} {digest[:16]} {cpu:.2f} s of CPU", flush=True)


if __name__ == "__main__":
    main()
