"""Refit the raw points of a `calibrate --json` file with the current fitting code (no GPU): time and
memory fit/held-out errors and the memory budget for the training world size recorded in the file; with
--profile-out, the profile YAML the calibrate command now writes from those points.

    python bench/plan/calibrate_refit.py bench/results/calibrate-2026-11-30-h200x2gpu0-run6.json [--out REFIT.json]
        [--profile-out PROFILE.yaml] [--oom 303x1560,...]

--oom adds micro-batches (B x per-GPU tokens s) that ran out of memory in other runs of the same setup (same
GPUs, DeepSpeed config and world size) as bounds on the budget, as calibrate does with its own.
"""
import argparse
import json
import os
import statistics
import sys

import yaml

# the repository, as in the other bench/ scripts: `python bench/plan/calibrate_refit.py` runs without an install
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_adaptiveload import calibrate as cal  # noqa: E402


def refit(doc, safety=0.9, capacity=None, extra_oom=()):
    points = []
    for d in doc["points"]:
        p = cal.Point(d["B"], tuple(d["shape"]), d["S"], d["s"], role=d["role"])
        p.status, p.ms, p.step_ms, p.peak_bytes, p.note = d["status"], d["ms"], d["step_ms"], d["peak_bytes"], d["note"]
        points.append(p)
    coef = cal.fit_time([p for p in points if p.role != "probe"])
    mem = cal.fit_memory(points)
    # the device capacity, from any point's peak and its peak fraction (fit rows align with the points)
    capacity = capacity or next((d["peak_bytes"] / row["peak_frac"] for d, row in zip(doc["points"], doc["fit"]["points"])
                     if d.get("peak_bytes") and row.get("peak_frac")), None)
    rows = cal.report(points, coef, mem, capacity)
    note = doc["fit"]["memory"]
    fixed = cal.train_fixed_bytes(mem[0], doc["meta"]["model"]["params"], note["measured_world_size"],
                                  note["train_world_size"], note.get("zero_bytes_per_param", cal.ZERO_BYTES_PER_PARAM))
    ooms = [p for p in points if p.status == "oom"]
    for B, s in extra_oom:
        ooms.append(cal.Point(B, (), s, s, role="oom elsewhere"))
    # each OOM bounds the training budget (its tokens, its samples' own, the shards this run held beyond it)
    bounded = min([cal.budget_tokens(capacity, safety, fixed, mem[1])]
                  + [cal.budget_after_oom(capacity, safety, mem, fixed, p) for p in ooms])
    return {
        "source": doc["meta"].get("date"), "time_coef": dict(zip(("fixed", "per_token", "per_token_sq", "floor"), coef)),
        "time_model": f"(floor^q + line^q)^(1/q), q = {cal.TIME_FLOOR_Q} (calibrate.predict_ms)",
        "time_fit": cal.err_summary(rows, "fit"), "time_heldout": cal.err_summary(rows, "heldout"),
        "memory": {"fixed_bytes": mem[0], "bytes_per_token": mem[1], "floor_bytes": mem[2],
                   "bytes_per_sample": mem[3], "sample_tokens": cal.sample_tokens(mem), "capacity_bytes": capacity,
                   "train_fixed_bytes": fixed},
        "memory_fit": cal.err_summary(rows, "fit", "mem_err"),
        "memory_heldout": cal.err_summary(rows, "heldout", "mem_err"),
        "budget_tokens": cal.budget_tokens(capacity, safety, fixed, mem[1]),
        "budget_tokens_with_oom_bound": bounded,
        "oom_micro_batches": [f"{p.B}x{p.s}" for p in ooms], "rows": rows,
    }


def refit_profile(doc, res, source, path, safety=0.9):
    """Write the profile of `res` (refit) with the raw run's meta; the run's points stay the evidence."""
    from ds_adaptiveload.schedule.geometry import Geometry

    c, m = res["time_coef"], res["memory"]
    ok = [p for p in doc["points"] if p["status"] == "ok"]
    sizes = [p["s"] for p in ok if p["role"] == "fit"]
    meta = {**doc["meta"], "refit": f"bench/plan/calibrate_refit.py on {source}: the points this calibrate run "
                                    "measured, fitted by the current fit code"}
    fit = {"method": "NNLS, relative weighting; medians of timed steps after one warm-up; time floor (fit_time)",
           "time_model": res["time_model"],
           **{k: res[k] for k in ("time_fit", "time_heldout", "memory_fit", "memory_heldout")},
           "time_coef_measured": c, "budget_oom_bounds": res["oom_micro_batches"], "points": res["rows"]}
    prof = cal.build_profile(Geometry(), (c["fixed"], c["per_token"], c["per_token_sq"], c["floor"]),
                             statistics.median(v for p in ok for v in p["step_ms"]),
                             (m["train_fixed_bytes"], m["bytes_per_token"], m["bytes_per_sample"]),
                             m["capacity_bytes"], safety,
                             res["budget_tokens_with_oom_bound"], meta, fit, dual_range=(min(sizes), max(sizes)),
                             dual_sizes=sizes)
    prof.to_yaml(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out")
    ap.add_argument("--profile-out", help="write the profile YAML the calibrate command now makes of these points")
    ap.add_argument("--oom", default="", help="micro-batches BxS (per-GPU tokens) that ran out of memory in "
                    "other runs of the same setup, comma-separated: bounds on the budget")
    ap.add_argument("--run-profile", help="the run's own profile YAML: its memory.capacity_bytes is the device's "
                    "(else it is estimated from the points' peaks and rounded peak fractions)")
    args = ap.parse_args()
    with open(args.json) as f:
        doc = json.load(f)
    capacity = None
    if args.run_profile:
        capacity = yaml.safe_load(open(args.run_profile))["memory"]["capacity_bytes"]
    extra = [tuple(int(v) for v in t.split("x")) for t in args.oom.split(",") if t]
    res = refit(doc, capacity=capacity, extra_oom=extra)
    if args.profile_out:
        refit_profile(doc, res, args.json, args.profile_out)
    for k, v in res.items():
        if k != "rows":
            print(f"{k}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
