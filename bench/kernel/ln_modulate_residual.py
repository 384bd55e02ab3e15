"""Benchmark the gated residual fused with LayerNorm-Modulate (x_new = x + gate * y; out = LN(x_new)*(1+scale)+shift).

    python bench/kernel/ln_modulate_residual.py --out $OUT [--shapes 1x75600x5120,1x1560x1536] [--budget-s 300]

For Wan shapes (dim 1536 and 5120, 1,560..75,600 tokens), bf16 x / y, per-sample fp32 gate / scale / shift, forward
and forward+backward (both outputs get a gradient, as in a block) of: fused (the op), ln_modulate+add (the residual
as one torch expression, then today's ln_modulate op), compiled (torch.compile(dynamic=True) of the eager chain),
eager (the chain as Wan writes it) and QuACK's residual-add RMSNorm then the modulation (where quack-kernels is
installed; a crash is recorded as that provider's error, a missing package gets no row). Byte floor: forward x, y
read, x_new and out written; backward d_out, d_x_new, x_new, y read, dx, dy written (modulation vectors are
negligible); % of copy bandwidth = floor bytes / time / copy bandwidth. Medians of CUDA events. Writes the raw
JSON OUT/ln_modulate_residual-DATE-GPU.json and OUT/staging.csv (harness rows; merge with
`python bench/harness.py merge OUT/staging.csv`)."""
import argparse
import datetime
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, ".."), HERE]
import harness  # noqa: E402  (bench/)
from ln_modulate import bench_ms, copy_bandwidth  # noqa: E402  (bench/kernel/)
from ds_adaptiveload.ops import ln_modulate  # noqa: E402
from ds_adaptiveload.ops import layernorm_modulate as lnm  # noqa: E402
from ds_adaptiveload.ops.ln_modulate_residual import ln_modulate_residual  # noqa: E402

SHAPES = [(1, 75600, 5120), (1, 32760, 1536), (1, 1560, 1536), (8, 4680, 1536), (4, 18900, 5120)]
EXPERIMENT = "Gated residual + LN-Modulate op, {shape} bf16, per-sample modulation"
COMMAND = "python3 bench/device/run.py --wheels .whl --budget-s 590 --stages env,resid=340 --out $OUT"
EPS = 1e-6


def eager_chain(x, y, gate, scale, shift):
    """As a Wan block writes it: the gated add in fp32 rounded to x's dtype, then LN in fp32 and the modulation."""
    x_new = (x.float() + gate * y.float()).to(x.dtype)
    ln = torch.nn.functional.layer_norm(x_new.float(), (x.shape[-1],), eps=EPS)
    return (ln * (1 + scale) + shift).to(x.dtype), x_new


def unfused(x, y, gate, scale, shift):
    x_new = (x.float() + gate * y.float()).to(x.dtype)
    return ln_modulate(x_new, scale, shift, eps=EPS), x_new


def quack_residual(x, y, gate, scale, shift):
    """QuACK's fused residual-add RMSNorm (quack-kernels: out = RMSNorm(gate * y + x), x_new = that sum) after a
    torch gate multiply, then the modulation as one addcmul. RMSNorm, not LayerNorm: it skips the mean, so it is an
    anchor from below on work, and the gate costs it one more pass."""
    from quack.rmsnorm import rmsnorm

    out, x_new = rmsnorm((gate * y.float()).to(x.dtype), None, residual=x, eps=EPS, prenorm=True)
    return torch.addcmul(shift.to(x.dtype), out, 1 + scale.to(x.dtype)), x_new


def providers():
    compiled = torch.compile(eager_chain, dynamic=True)
    return {"fused": lambda *a: ln_modulate_residual(*a, eps=EPS), "ln_modulate+add": unfused,
            "compiled": compiled, "eager": eager_chain, "quack_rmsnorm_residual+mod": quack_residual}


def inputs(B, S, D, grad):
    mk = lambda *s, dt=torch.float32: torch.randn(*s, device="cuda", dtype=dt).requires_grad_(grad)  # noqa: E731
    return [mk(B, S, D, dt=torch.bfloat16), mk(B, S, D, dt=torch.bfloat16), mk(B, 1, D), mk(B, 1, D), mk(B, 1, D)]


def time_provider(fn, B, S, D):
    """(forward ms, forward+backward ms) or the error text."""
    try:
        a = inputs(B, S, D, False)
        fwd = bench_ms(lambda: fn(*a))
        g = inputs(B, S, D, True)
        d_out, d_xn = torch.randn_like(g[0]), torch.randn_like(g[0])

        def step():
            out, x_new = fn(*g)
            torch.autograd.backward((out, x_new), (d_out, d_xn))
        return fwd, bench_ms(step)
    except Exception as err:  # noqa: BLE001 - a failing baseline is a result, not a crash
        return f"{type(err).__name__}: {str(err)[:200]}"


def shape_row(B, S, D, provs, bw):
    n = B * S * D * 2  # one bf16 [B, S, D] tensor
    floor = {"fwd": 4 * n, "fwdbwd": 4 * n + 6 * n}
    row = {"shape": f"{B}x{S}x{D}", "floor_bytes": floor, "providers": {}}
    for name, fn in provs.items():
        got = time_provider(fn, B, S, D)
        if isinstance(got, str):
            row["providers"][name] = {"error": got}
        else:
            row["providers"][name] = {f"{k}_ms": ms for k, ms in zip(("fwd", "fwdbwd"), got)}
            row["providers"][name].update({f"{k}_pct_copy": 100 * floor[k] / (ms * 1e-3) / bw for k, ms in
                                           zip(("fwd", "fwdbwd"), got)})
        torch.cuda.empty_cache()
    return row


def record_rows(path, rows, env, raw_name):
    hw = "1x H100 80GB" if "H100" in env.get("device", "") else "1x H200" if "H200" in env.get("device", "") else \
        f"1x {env.get('device', 'GPU')}"
    for row in rows:
        for name, got in row["providers"].items():
            for mode, label in (("fwd", "forward"), ("fwdbwd", "forward+backward")):
                common = dict(experiment=EXPERIMENT.format(shape=row["shape"]), variant=name, hardware=hw,
                              command=COMMAND, raw_file=f"bench/results/{raw_name}", section="kernel",
                              date=env["date"])
                if "ModuleNotFoundError" in got.get("error", ""):
                    continue  # an optional anchor that is not installed there: no result either way
                if "error" in got:
                    harness.record(path, metric=f"{label}, ms", unit="ms", status="crash", note=got["error"], **common)
                    continue
                harness.record(path, metric=f"{label}, ms", unit="ms", value=round(got[f"{mode}_ms"], 4),
                               better="lower", **common)
                harness.record(path, metric=f"{label}, % of copy bandwidth", unit="%", better="higher",
                               value=round(got[f"{mode}_pct_copy"], 1), **common)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the raw JSON and staging.csv")
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 1x75600x5120,1x1560x1536")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device: this benchmark times GPU kernels", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")
    assert lnm.load_op() is not None, lnm.op_error()
    t0, bw = time.time(), copy_bandwidth()
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    env = harness.environment(gpu=True)
    raw_name = f"ln_modulate_residual-{datetime.date.today()}-{env.get('device', 'gpu').replace(' ', '-').lower()}.json"
    res = {"what": __doc__.strip().splitlines()[0], "env": env, "copy_TBps": bw / 1e12, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    provs = providers()
    for B, S, D in shapes:
        if time.time() - t0 > args.budget_s:
            break
        res["rows"].append(shape_row(B, S, D, provs, bw))
        print(json.dumps(res["rows"][-1]), flush=True)
        with open(os.path.join(args.out, raw_name), "w") as f:
            json.dump(res, f, indent=1)
    record_rows(os.path.join(args.out, "staging.csv"), res["rows"], env, raw_name)
    print(f"wrote {raw_name} and staging.csv under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
