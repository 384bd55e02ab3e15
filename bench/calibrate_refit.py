"""Refit the raw points of a `calibrate --json` file with the current fitting code (no GPU): time and
memory fit/held-out errors and the memory budget for the training world size recorded in the file.

    python bench/calibrate_refit.py bench/results/calibrate-2026-11-29-h200-run3.json [--out REFIT.json]
"""
import argparse
import json

from ds_adaptiveload import calibrate as cal


def refit(doc, safety=0.9):
    points = []
    for d in doc["points"]:
        p = cal.Point(d["B"], tuple(d["shape"]), d["S"], d["s"], role=d["role"])
        p.status, p.ms, p.step_ms, p.peak_bytes, p.note = d["status"], d["ms"], d["step_ms"], d["peak_bytes"], d["note"]
        points.append(p)
    coef = cal.fit_time([p for p in points if p.role != "probe"])
    mem = cal.fit_memory(points)
    # the device capacity, from any point's peak and its peak fraction (fit rows align with the points)
    capacity = next((d["peak_bytes"] / row["peak_frac"] for d, row in zip(doc["points"], doc["fit"]["points"])
                     if d.get("peak_bytes") and row.get("peak_frac")), None)
    rows = cal.report(points, coef, mem, capacity)
    note = doc["fit"]["memory"]
    fixed = cal.train_fixed_bytes(mem[0], doc["meta"]["model"]["params"], note["measured_world_size"],
                                  note["train_world_size"], note.get("zero_bytes_per_param", cal.ZERO_BYTES_PER_PARAM))
    oom = doc["fit"].get("oom_bound_tokens")
    return {
        "source": doc["meta"].get("date"), "time_coef": dict(zip(("fixed", "per_token", "per_token_sq", "floor"), coef)),
        "time_fit": cal.err_summary(rows, "fit"), "time_heldout": cal.err_summary(rows, "heldout"),
        "memory": {"fixed_bytes": mem[0], "bytes_per_token": mem[1], "floor_bytes": mem[2],
                   "capacity_bytes": capacity, "train_fixed_bytes": fixed},
        "memory_fit": cal.err_summary(rows, "fit", "mem_err"),
        "memory_heldout": cal.err_summary(rows, "heldout", "mem_err"),
        "budget_tokens": cal.budget_tokens(capacity, safety, fixed, mem[1]),
        "budget_tokens_with_oom_bound": cal.budget_tokens(capacity, safety, fixed, mem[1], oom),
        "oom_bound_tokens": oom, "rows": rows,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out")
    args = ap.parse_args()
    with open(args.json) as f:
        res = refit(json.load(f))
    for k, v in res.items():
        if k != "rows":
            print(f"{k}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
