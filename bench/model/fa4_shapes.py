"""FlashAttention-4 at every per-sample shape of the synthetic mixes, as the packed model calls it: one call per shape
group, [n, S, 12, 128] bf16 for n = 1 and the most samples of that shape a micro-batch of --budget-tokens holds.
Forward and backward, each call synchronized (so that a kernel fault is pinned to its shape), against SDPA's output
and gradients. Exit 1 if any call raised or differs by more than --tol.

    python3 bench/model/fa4_shapes.py --out OUT [--mixes video-heavy,image-heavy] [--budget-tokens 70000]
    python3 bench/device/run.py --fa4 .fa4 --stages fa4_shapes ...     # on the device: FA4 from carried wheels

Writes OUT/fa4-shapes.json (per call: the shape, n, status, max abs error of out, dq, dk, dv, ms)."""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]
import harness  # noqa: E402  (bench/)
from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402
from ds_adaptiveload.schedule.mixes import MIXES  # noqa: E402

HEADS, HEAD_DIM = 12, 128


def shapes_of(mixes, budget):
    """{tokens S: (frames, h, w) of one such shape} over the mixes' shapes, each with the batch sizes to try."""
    out, geo = {}, Geometry()
    for name in mixes:
        for _, group in MIXES[name]:
            for f, h, w in group:
                s = geo.tokens(f, h, w)
                out.setdefault(s, (f, h, w))
    return {s: (shape, sorted({1, max(1, budget // s)})) for s, shape in sorted(out.items())}


def one_call(n, s, tol):
    import torch

    from ds_adaptiveload.model.attention import fa4_attention
    from ds_adaptiveload.model.wan import sdpa_attention

    g = torch.Generator(device="cuda").manual_seed(s * 131 + n)
    q, k, v = (torch.randn(n, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    dout = torch.randn(n, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    res = {}
    for name, fn in (("sdpa", sdpa_attention), ("fa4", fa4_attention)):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(qq, kk, vv)
        out.backward(dout)
        torch.cuda.synchronize()  # a fault in this call surfaces here, not in a later kernel
        res[name] = (out.detach(), qq.grad, kk.grad, vv.grad, (time.perf_counter() - t0) * 1e3)
    err = {key: float((a - b).abs().max()) for key, a, b in zip(("out", "dq", "dk", "dv"), res["fa4"], res["sdpa"])}
    return {"err_vs_sdpa": err, "fa4_ms": round(res["fa4"][4], 3), "sdpa_ms": round(res["sdpa"][4], 3),
            "status": "ok" if max(err.values()) <= tol else "differs"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mixes", default="video-heavy,image-heavy")
    ap.add_argument("--budget-tokens", type=int, default=70000, help="a micro-batch's tokens (the largest n)")
    ap.add_argument("--tol", type=float, default=0.05, help="max abs difference from SDPA (bf16 inputs of std 1)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows, failed = [], 0
    for s, ((f, h, w), ns) in shapes_of(args.mixes.split(","), args.budget_tokens).items():
        for n in ns:
            row = {"S": s, "frames": f, "height": h, "width": w, "n": n}
            try:
                row.update(one_call(n, s, args.tol))
            except Exception as err:  # noqa: BLE001 - the shape's result; a CUDA fault ends the run after this row
                row["status"] = f"raised: {type(err).__name__}: {str(err)[:300]}"
            failed += row["status"] != "ok"
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "fa4-shapes.json"), "w") as fh:
                json.dump({"env": harness.environment(gpu=True), "rows": rows}, fh, indent=1)
            if row["status"].startswith("raised"):
                return 1
    print(f"{len(rows)} calls, {failed} not ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
