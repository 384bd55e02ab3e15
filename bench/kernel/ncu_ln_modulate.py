"""Nsight Compute look at the op's forward and backward kernels at (1, 75600, 5120) bf16, beside torch's copy
kernel on the same bytes: DRAM throughput, issue activity and warp stall reasons (where the time goes).

    python bench/kernel/ncu_ln_modulate.py --out DIR     # after the op is built; writes DIR/ncu.txt
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats", "SchedulerStats")
SUMMARY = re.compile(r"^  [a-z_].*\(|DRAM Throughput|Duration|Issue Slots|Achieved Occupancy|Registers Per|Stall|"
                     r"One or More|No Eligible")


def target():
    """The profiled region: the second iteration (the first loads the op and warms up)."""
    import torch

    sys.path.insert(0, ROOT)
    from ds_adaptiveload.ops import ln_modulate

    x = torch.randn(1, 75600, 5120, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sc = torch.randn(1, 1, 5120, device="cuda", requires_grad=True)
    sh = torch.randn(1, 1, 5120, device="cuda", requires_grad=True)
    dy, z = torch.randn_like(x), torch.empty_like(x)
    for it in range(2):
        if it == 1:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        torch.autograd.grad(ln_modulate(x, sc, sh), [x, sc, sh], dy)
        z.copy_(x)  # the copy kernel, same bytes as the forward
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def find_ncu():
    found = shutil.which("ncu")
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda*/nsight-compute*/ncu"):
        found = found or next(iter(sorted(glob.glob(pattern))), None)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.target:
        return target()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ncu.txt")
    ncu = find_ncu()
    if not ncu:
        print("ncu: not found on this machine")
        open(path, "w").write("ncu: not found on this machine\n")
        return 0
    cmd = [ncu, "--target-processes", "all", "--profile-from-start", "off", "-k", "regex:fwd_vec|bwd_vec|copy"]
    cmd += [a for s in SECTIONS for a in ("--section", s)] + [sys.executable, os.path.abspath(__file__), "--target"]
    with open(path, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"ncu rc={rc}")
    with open(path, errors="replace") as f:
        print("".join([ln for ln in f if SUMMARY.search(ln)][:60]), end="")
    return rc


if __name__ == "__main__":
    sys.exit(main())
