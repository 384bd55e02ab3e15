"""Where packed's planning time goes: CPU seconds per phase (packing, rounds, second opinions, mixing swaps, the
stream, the final costing) for one epoch of --samples openvid-720p samples at 1024 ranks, lockstep, the calibrated
H200 profile, per --clips (720p clips of memory) and --g. Each phase's time includes the phases it calls (pack_step
inside the second opinions is counted there too). Pure CPU:

    nice -n 10 python bench/plan/plan_phases.py --clips 1 --g 1 [--samples 1000000] >> RAW.txt

An A/B of two checkouts runs it in turns with PYTHONPATH set to each, headed "== LABEL, rep N: COMMAND" lines;
--record RAW then records each label's mean CPU time per case into results.csv.
"""
import argparse
import os
import re
import statistics
import time
from collections import defaultdict

from plan_bench import CALIBRATED, clips_budget, packed_plan

from ds_adaptiveload.schedule import planner
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.schedule.policies import common, packed, packed_mix, packed_redeal, packed_slots, packed_stream
from ds_adaptiveload.schedule.profile import CostProfile

PHASES = (
    (packed, ("epoch_stream", "pack_step", "step_rounds", "refine", "even_mix", "_target", "light_sums")),
    (packed_redeal, ("_lpt_steps", "_uneven")), (packed_mix, ("_mean_distance", "_MixState", "_swap_rounds")),
    (packed_slots, ("even_round", "_fill_gaps", "_densify")), (planner, ("_tokens", "lower_bound", "_finish_tail")),
    (packed_stream.Drawer, ("step", "__init__")), (common.Ctx, ("step_costs", "step_pred")),
    (planner.PackedCtx, ("__post_init__",)))


def timed(owner, name, acc):
    """Replace owner.name by a wrapper that adds its CPU seconds to acc[label]."""
    f, label = getattr(owner, name), f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"

    def wrapper(*a, **k):
        t = time.process_time()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.process_time() - t
    setattr(owner, name, wrapper)


def record_ab(raw):
    """results.csv rows: the mean CPU seconds of each label's runs per (samples, clips, G) of an A/B file."""
    from bench.harness import record

    runs, label, cmd = {}, None, None
    with open(raw) as f:
        for line in f:
            if line.startswith("== "):
                label, cmd = re.match(r"== (.+), rep \d+: (.+)", line.strip()).groups()
            elif m := re.match(r"(\d+) samples, (\d+) clips, G=(\d+): ([\d.]+) s of CPU", line):
                runs.setdefault((label, *map(int, m.groups()[:3])), []).append((float(m[4]), cmd))
    for (label, n, clips, g), got in runs.items():
        secs = [t for t, _ in got]
        record(experiment=f"plan_phases.py A/B, packed planning {n:,} openvid-720p samples for 1024 ranks, "
                          f"{clips_budget(clips):,} tokens, G = {g}, lockstep, in turns", variant=label,
               metric="planning CPU time", unit="s", value=round(statistics.mean(secs), 1), better="lower",
               hardware="CPU (2 cores, shared)", gpus=0, policy="packed", section="scheduler", raw_file=raw,
               command=got[0][1], note=f"mean of {len(secs)} runs: {', '.join(f'{t:.1f}' for t in secs)} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clips", type=int, default=1)
    ap.add_argument("--g", type=int, default=1)
    ap.add_argument("--samples", type=int, default=1000000)
    ap.add_argument("--record", metavar="RAW", help="record an A/B file's mean CPU times into results.csv")
    args = ap.parse_args()
    if args.record:
        return record_ab(args.record)
    acc = defaultdict(float)
    for owner, names in PHASES:
        for name in names:
            timed(owner, name, acc)
    samples = make_mix("openvid-720p", args.samples)
    base = CostProfile.load(CALIBRATED)
    load, t = os.getloadavg()[0], time.process_time()
    packed_plan(samples, base, args.clips, args.g)
    print(f"{args.samples} samples, {args.clips} clips, G={args.g}: {time.process_time() - t:.2f} s of CPU "
          f"(load average {load:.1f} before)")
    for label, sec in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {label:28s} {sec:6.2f}")


if __name__ == "__main__":
    main()
