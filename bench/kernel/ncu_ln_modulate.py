"""Nsight Compute look at the op's forward, backward and reduce kernels, beside an elementwise kernel that moves
the forward's bytes (x read, y written), at the shapes asked: DRAM throughput, issue activity and warp stall
reasons (where the time goes). Default: the small per-sample shapes that #18 leaves under target.

    python bench/kernel/ncu_ln_modulate.py --out DIR [--shapes 2x16380x1536,...] [--clock-control none]
        [--sections SourceCounters,...] [--fwd-tiles]   # writes DIR/ncu.txt
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
SUMMARY = re.compile(r"^  [a-z_].*\(|DRAM Throughput|Duration|Issue Slots|Achieved Occupancy|Registers Per|"
                     r"Waves Per SM|Grid Size|Block Size|Stall|One or More|No Eligible")
SHAPES = "2x16380x1536,8x4680x1536,32x1560x1536,1x32760x1536"
# The op's kernels (tiles, flat row space, general and reduce ones) and torch's elementwise reference.
KERNELS = "regex:fwd_|bwd_|reduce_|elementwise"


def target(shapes, fwd_tiles=False):
    """The profiled region: per shape, the second iteration (the first loads the op and warms up). fwd_tiles: the
    forward alone under each compile-time tile of the shape's D instead (the tile is in the kernel's name)."""
    import torch

    sys.path.insert(0, ROOT)
    import ln_tuning as _tuning  # bench/kernel, beside this script
    from ds_adaptiveload.ops import ln_modulate

    if fwd_tiles:
        return tile_target(shapes, torch, _tuning, ln_modulate)
    for shape in shapes:
        B, S, D = shape
        x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        sc = torch.randn(B, 1, D, device="cuda", requires_grad=True)
        sh = torch.randn(B, 1, D, device="cuda", requires_grad=True)
        dy, z = torch.randn_like(x), torch.empty_like(x)

        def step():
            torch.autograd.grad(ln_modulate(x, sc, sh), [x, sc, sh], dy)
            torch.mul(x.detach(), 1.0, out=z)  # an elementwise kernel on the forward's bytes (copy_ would be a memcpy)

        profile_second(torch, step)


def profile_second(torch, fn):
    """fn once as a warm-up (the first call loads the op), then once inside the profiled region."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def tile_target(shapes, torch, _tuning, ln_modulate):
    """Per shape and forward tile of its D: one warm-up call, then one profiled call (bf16, no autograd)."""
    for B, S, D in shapes:
        x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)
        sc, sh = torch.randn(B, 1, D, device="cuda"), torch.randn(B, 1, D, device="cuda")
        for i, tile in enumerate(_tuning.fast_tiles(False)):
            if tile[0] != D:
                continue
            with _tuning.tuned(tile=(i, -1)):
                profile_second(torch, lambda: ln_modulate(x, sc, sh))


def find_ncu():
    found = shutil.which("ncu")
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda*/nsight-compute*/ncu"):
        found = found or next(iter(sorted(glob.glob(pattern))), None)
    return found


def parse_shapes(text):
    try:
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        raise SystemExit(f"--shapes: expected BxSxD[,BxSxD...], got {text!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES, help="comma list of BxSxD (bf16 x, fp32 [B,1,D] modulation)")
    # ncu locks the SM clock at base (1.47 GHz on the H200) by default; none profiles at the clock training runs at.
    ap.add_argument("--clock-control", choices=("base", "none"), default="base")
    ap.add_argument("--sections", default="", help="more ncu sections, comma list (SourceCounters: stalls per line)")
    ap.add_argument("--fwd-tiles", action="store_true", help="the forward alone under each compile-time tile")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    if args.target:
        return target(shapes, args.fwd_tiles)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ncu.txt")
    ncu = find_ncu()
    if not ncu:
        print("ncu: not found on this machine")
        open(path, "w").write("ncu: not found on this machine\n")
        return 0
    cmd = [ncu, "--target-processes", "all", "--profile-from-start", "off", "--clock-control", args.clock_control,
           "-k", KERNELS]
    sections = SECTIONS + tuple(s for s in args.sections.split(",") if s)
    cmd += [a for s in sections for a in ("--section", s)]
    cmd += [sys.executable, os.path.abspath(__file__), "--target", "--shapes", args.shapes]
    cmd += ["--fwd-tiles"] if args.fwd_tiles else []
    with open(path, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"ncu rc={rc}")
    with open(path, errors="replace") as f:
        print("".join([ln for ln in f if SUMMARY.search(ln)][:400]), end="")
    return rc


if __name__ == "__main__":
    sys.exit(main())
