"""Load a GPU with bf16 GEMMs until a file appears (or a time limit), so that a benchmark starts timing on a GPU
already at its steady power state (an H200 holds ~1,850-1,940 MHz for its first 2-3 minutes of load, then
~1,660-1,720 MHz at its 700 W cap: docs/history/benchmarks.md, fourteenth session).

    python3 bench/gpu_soak.py --until FILE [--max-s 300] [--device cuda]

bench/mfu.py --e2e-soak-s runs it beside each e2e variant until the variant's step log has its first line: the
trainer's start-up and step 1 (compiles; never counted) overlap the soak, and step 2 on runs at the cap. Prints a
line "SOAK <JSON>" when the load starts, and one when it stops: seconds run, GEMMs done, and why. Without CUDA (and
--device cuda) it stops at once."""
import argparse
import json
import os
import time


def stop_reason(until: str, t0: float, max_s: float):
    if os.path.exists(until) and os.path.getsize(until) > 0:
        return "file"
    if time.monotonic() - t0 >= max_s:
        return "max-s"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--until", required=True, help="stop once this file exists and is not empty")
    ap.add_argument("--max-s", type=float, default=300.0, help="stop after this many seconds in any case")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (tests: small GEMMs)")
    ap.add_argument("--size", type=int, default=0, help="GEMM side (default 8192 on CUDA, 256 on CPU)")
    args = ap.parse_args(argv)
    import torch

    t0, gemms = time.monotonic(), 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("SOAK " + json.dumps({"soak_s": 0.0, "gemms": 0, "stopped": "no CUDA"}), flush=True)
        return 0
    n = args.size or (8192 if args.device == "cuda" else 256)
    # bf16 on the GPU, as training runs; fp32 on CPU, where bf16 GEMMs are slow and only the stop logic is tested
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    out = torch.empty_like(a)
    print("SOAK " + json.dumps({"soaking": args.device, "size": n}), flush=True)
    while (why := stop_reason(args.until, t0, args.max_s)) is None:
        for _ in range(20):  # ~20 x 1.1 TFLOP: about 40 ms per check on an H200
            torch.matmul(a, b, out=out)
        if args.device == "cuda":
            torch.cuda.synchronize()
        gemms += 20
    print("SOAK " + json.dumps({"soak_s": round(time.monotonic() - t0, 1), "gemms": gemms, "stopped": why}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
