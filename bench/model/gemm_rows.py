"""The Wan-1.3B block's GEMMs over a packed micro-batch's rows against the same rows as separate micro-batches
(issue #19): an earlier profile put 33 ms of the mixed pack's deficit in cuBLAS kernels at 203k rows.
Times each projection's forward (x @ W^T + b) and its two backward GEMMs (dx = dy @ W, dW = dy^T @ x) at the
packed row count and summed over the separate ones, with cuBLAS and with cuBLASLt preferred, and with the packed
rows cut into chunks of at most --chunk rows. bf16, CUDA events, L2 not flushed (the tensors are far larger).

    python3 bench/model/gemm_rows.py --out OUT [--rows 203520] [--parts 75600,65520,62400] [--chunk 81920]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for harness
import harness  # noqa: E402

# (name, in, out, count per block) of WanBlock's token-row projections at dim 1536, ffn_dim 8960
PROJ = (("qkvo+cross q,o", 1536, 1536, 6), ("ffn up", 1536, 8960, 1), ("ffn down", 8960, 1536, 1))


def gemm_ms(rows, k, n, reps):
    """(fwd, dx, dw) ms of one projection over `rows` rows: the median of reps CUDA-event timings each."""
    import torch

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    fns = (lambda: torch.nn.functional.linear(x, w, b), lambda: dy @ w, lambda: dy.t() @ x)
    return [harness.time_cuda(f, warmup=3, rep=reps)["median"] for f in fns]


def sweep(rows_list, reps):
    """Per projection: (fwd, dx, dw) ms summed over rows_list, weighted by the projection's count per block."""
    out = {}
    for name, k, n, count in PROJ:
        per = [gemm_ms(r, k, n, reps) for r in rows_list]
        out[name] = [round(count * sum(p[i] for p in per), 4) for i in range(3)]
    out["block"] = round(sum(sum(v) for v in out.values()), 4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=203520, help="the packed micro-batch's rows (the mixed pack)")
    ap.add_argument("--parts", default="75600,65520,62400", help="the separate micro-batches' rows")
    ap.add_argument("--chunk", type=int, default=81920, help="packed rows cut into chunks of at most this many")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--libs", default="cublas,cublaslt")
    args = ap.parse_args(argv)
    import torch

    parts = [int(p) for p in args.parts.split(",")]
    chunks = [min(args.chunk, args.rows - i) for i in range(0, args.rows, args.chunk)]
    res = {"env": harness.environment(), "rows": args.rows, "parts": parts, "chunks": chunks, "runs": []}
    for lib in args.libs.split(","):
        torch.backends.cuda.preferred_blas_library(lib)
        for case, rows_list in (("packed", [args.rows]), ("separate", parts), ("chunked", chunks)):
            got = sweep(rows_list, args.reps)
            res["runs"].append({"blas": lib, "case": case, "ms_per_block": got})
            print(f"GEMM {lib:9s} {case:9s} block {got['block']:.3f} ms " +
                  " ".join(f"{k}={v}" for k, v in got.items() if k != "block"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm-rows.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
