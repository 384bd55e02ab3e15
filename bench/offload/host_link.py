"""Pinned host <-> device copy bandwidth, what activation offload's block inputs cross (memory.host_link_bytes_per_s):
the same measurement calibrate makes (ds_adaptiveload/calibrate/host_link.py), alone and with more repeats.

    python bench/offload/host_link.py --out $OUT        # one GPU, under a minute: raw JSON + OUT/staging.csv

Rows: each direction's median over 16, 64 and 256 MiB (each size's median of --repeats copies after one untimed),
and the slower direction's, which calibrate writes into the profile. The planner's default without it is 25e9 B/s.
"""
import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # harness

COMMAND = "python bench/offload/host_link.py --out $OUT"
EXPERIMENT = "Activation offload host link, pinned host <-> device copies"


def hardware(env) -> str:
    name = env.get("device", "cpu")
    return "1x H100 80GB" if "H100" in name else "1x H200" if "H200" in name else f"1x {name}"


def record_rows(path, got, env, raw_name, repeats) -> None:
    import statistics

    import harness

    common = dict(experiment=EXPERIMENT, unit="GB/s", hardware=hardware(env), command=COMMAND,
                  raw_file=f"bench/results/{raw_name}", section="training", date=env["date"], better="higher",
                  note=f"16, 64, 256 MiB; per size the median of {repeats} copies after one untimed; CUDA events")
    for direction, label in (("d2h", "device to host"), ("h2d", "host to device")):
        harness.record(path, variant=label, metric="median over sizes",
                       value=round(statistics.median(got[direction].values()) / 1e9, 2), **common)
    harness.record(path, variant="slower direction (memory.host_link_bytes_per_s)", metric="median over sizes",
                   value=round(got["bytes_per_s"] / 1e9, 2), **common)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the raw JSON and staging.csv")
    p.add_argument("--repeats", type=int, default=20, help="timed copies per size and direction")
    args = p.parse_args(argv)
    import torch

    import harness
    from ds_adaptiveload.calibrate.host_link import SIZES, cuda_copy_seconds, measure

    if not torch.cuda.is_available():
        print("error: no CUDA device: the host link is a GPU's", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    got = measure(cuda_copy_seconds(torch.device("cuda")), SIZES, args.repeats)
    env = harness.environment(gpu=True)
    raw_name = f"{datetime.date.today().isoformat()}-host-link-{hardware(env).split()[1].lower()}.json"
    with open(os.path.join(args.out, raw_name), "w") as f:
        json.dump({"bench": "host_link", "env": env, "repeats": args.repeats,
                   "bytes_per_s": {d: {str(s): r for s, r in got[d].items()} for d in ("d2h", "h2d")},
                   "slower_bytes_per_s": got["bytes_per_s"]}, f, indent=1)
    record_rows(os.path.join(args.out, "staging.csv"), got, env, raw_name, args.repeats)
    print(f"[host_link] {got['bytes_per_s'] / 1e9:.1f} GB/s (slower direction); wrote {raw_name} and staging.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
