"""Benchmark the fused LayerNorm-Modulate op against the baselines users would reach for.

    python bench/kernel/ln_modulate.py --out bench/results/ln_modulate-$(date +%F)-h200.json

One run measures: device copy bandwidth (the ceiling), then for each shape and x dtype, forward and
forward+backward of: ours; the Wan eager chain (LN_fp32(x).to(x.dtype).float() * (1 + scale) + shift ->
x.dtype, scale/shift fp32 [B,1,D]); torch.compile of that chain (a crash is reported as its error string);
apex FusedLayerNorm + modulate (if apex imports); F.layer_norm with the affine trick (weight = 1 + scale,
bias = shift; exact only for B = 1); Liger LayerNorm with the same trick (if liger_kernel imports).
Byte floor: bytes that must move (forward: x read + y written; backward: x and dy read, dx written;
scale/shift and their gradients at their own size) over the copy bandwidth. Medians of CUDA-event timings
(triton.testing.do_bench); inputs rotate between two sets when one set fits in L2."""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from ds_adaptiveload.ops import ln_modulate  # noqa: E402
from ds_adaptiveload.ops import layernorm_modulate as lnm  # noqa: E402

SHAPES = [(1, 32760, 1536), (1, 75600, 5120), (8, 4680, 1536), (1, 176400, 5120)]
EPS = 1e-6


def bench_ms(fn, warmup=10, rep=40):
    """Median ms over CUDA events around each call (L2 flushed by the rotating inputs, not here)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth():
    n = 1 << 30  # 2 GiB of bf16 read + 2 GiB written
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), warmup=5, rep=20)
    del a, b
    return 2 * n * 2 / (ms * 1e-3)


def wan_chain(x, scale, shift):
    return (F.layer_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype).float() * (1 + scale) + shift).to(x.dtype)


def wan_chain_dyn(x, scale, shift):
    """wan_chain under its own code object, so that torch.compile(dynamic=True) keeps its own cache: static
    compiles of wan_chain crash in backward with [1, 1, D] scale/shift (torch 2.11); dynamic ones run."""
    return wan_chain(x, scale, shift)


def affine_trick(x, scale, shift):
    D = x.shape[-1]
    return F.layer_norm(x, (D,), (1 + scale).reshape(D).to(x.dtype), shift.reshape(D).to(x.dtype), EPS)


def with_variant(op, v):
    """ln_modulate with kernel choice v (op.set_variant(v, v)) for its forward and backward."""
    def fn(x, sc, sh):
        op.set_variant(v, v)
        return ln_modulate(x, sc, sh)
    return fn


def providers(B, op=None, variants=()):
    out = {"ours": with_variant(op, 0) if op is not None else ln_modulate}
    out.update({f"ours_v{v}": with_variant(op, v) for v in variants if v != 0})
    out.update({"wan_eager": wan_chain, "wan_compile": torch.compile(wan_chain),
                "wan_compile_dynamic": torch.compile(wan_chain_dyn, dynamic=True)})
    try:
        from apex.normalization import FusedLayerNorm  # noqa: F401
        from apex.normalization.fused_layer_norm import fused_layer_norm

        out["apex_fused"] = lambda x, sc, sh: (fused_layer_norm(x, (x.shape[-1],), EPS).float() * (1 + sc) + sh).to(x.dtype)
    except Exception:  # noqa: BLE001
        pass
    if B == 1:
        out["torch_ln_affine"] = affine_trick
        try:
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            def liger(x, sc, sh):
                D = x.shape[-1]
                return LigerLayerNormFunction.apply(x, (1 + sc).reshape(D).to(x.dtype), sh.reshape(D).to(x.dtype), EPS)

            out["liger_affine"] = liger
        except Exception as err:  # noqa: BLE001
            print("liger unavailable:", err)
    return out


def floor_bytes(B, S, D, esize):
    mod = 2 * B * D * 4  # fp32 [B,1,D] scale + shift
    fwd = 2 * B * S * D * esize + mod
    bwd = 3 * B * S * D * esize + mod + mod  # read x, dy; write dx; read scale; write dscale, dshift
    return fwd, fwd + bwd


def measure(fn, xs, scs, shs, dys, mode):
    """fn over rotating input sets; mode 'fwd' or 'fwdbwd'."""
    n = len(xs)
    i = [0]

    def fwd():
        k = i[0] = (i[0] + 1) % n
        with torch.no_grad():
            fn(xs[k], scs[k], shs[k])

    def fwdbwd():
        k = i[0] = (i[0] + 1) % n
        y = fn(xs[k], scs[k], shs[k])
        torch.autograd.grad(y, [xs[k], scs[k], shs[k]], dys[k])

    return bench_ms(fwd if mode == "fwd" else fwdbwd)


def tuning_sweep(op, B, S, D, dtype, bw):
    """Kernel times per kernel choice (op.set_variant(v, v)): 2 = the baseline kernels (with the cp.async
    row stream, stages 3, and a vpt override; saved vs recomputed statistics), 1 = the general kernels
    (forward fwd_v1_kernel; its backward is the baseline's), 0 = the default: the compile-time tiles, each
    tile of the table timed (op.set_tile picks it). Rows record what was timed (None elsewhere)."""
    x = torch.randn(B * S, D, device="cuda").to(dtype)
    sc, sh = torch.randn(B, 1, D, device="cuda"), torch.randn(B, 1, D, device="cuda")
    dy = torch.randn(B * S, D, device="cuda").to(dtype)
    fb, fbb = floor_bytes(B, S, D, x.element_size())
    code = lnm._DTYPE_CODE[dtype]
    before = tuple(op.get_variant())

    def fwd(vpt):
        return op.forward(x, sc, sh, None, None, B, S, D, 0, 0, 0, EPS, code, True, vpt, -1)

    def bwd(vpt, mean, rstd):
        return op.backward(dy, x, sc, None, None, mean, rstd, B, S, D, 0, 1, 1, False, False, EPS, vpt, -1)

    rows = []

    def add(variant, stages, vpt, f=None, b=None, b_rec=None, tile=None):
        row = {"shape": [B, S, D], "dtype": str(dtype), "variant": variant, "stages": stages, "vpt": vpt,
               "fwd_ms": f, "bwd_saved_ms": b, "bwd_recompute_ms": b_rec}
        if tile is not None:
            row["tile"] = list(tile)  # (D, vpt, wpr, rows ahead)
        if f:
            row["fwd_bw%"] = round(100 * fb / (f * 1e-3) / bw, 1)
        if b:
            row["bwd_saved_bw%"] = round(100 * (fbb - fb) / (b * 1e-3) / bw, 1)
        if f and b:
            row["fwdbwd_saved_bw%"] = round(100 * fbb / ((f + b) * 1e-3) / bw, 1)
        rows.append(row)
        print("sweep", row, flush=True)

    op.set_variant(2, 2)
    for stages, vpt in [(0, -1), (3, -1), (0, 2 if D > 2048 else 4)]:
        op.set_stages(stages, stages)
        _, mean, rstd = fwd(vpt)
        add(2, stages, vpt, bench_ms(lambda: fwd(vpt)), bench_ms(lambda: bwd(vpt, mean, rstd)),
            bench_ms(lambda: bwd(vpt, None, None)))
    op.set_stages(-1, -1)
    op.set_variant(1, 1)
    for vpt in (-1,) + ((2, 4) if D > 2048 else (4, 8)):
        add(1, 0, vpt, f=bench_ms(lambda: fwd(vpt)))
    op.set_variant(0, 0)
    # every tile of the op's own tables at this D (op.set_tile(index); the default first); none: -1
    fv, bv = ([i for i, t in enumerate(op.fast_tiles(bwd_)) if t[0] == D] or [-1] for bwd_ in (False, True))
    _, mean, rstd = fwd(-1)
    for t in fv:
        op.set_tile(t, -1)
        add(0, 0, -1, f=bench_ms(lambda: fwd(-1)), tile=op.fast_tiles(False)[t] if t >= 0 else None)
    for t in bv:
        op.set_tile(-1, t)
        add(0, 0, -1, b=bench_ms(lambda: bwd(-1, mean, rstd)), tile=op.fast_tiles(True)[t] if t >= 0 else None)
    op.set_tile(-1, -1)
    op.set_variant(*before)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/ln_modulate-{datetime.date.today()}-h200.json")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip remaining baselines after this many seconds")
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 1x75600x5120,8x4680x1536")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-shapes", default="1x75600x5120,1x32760x1536", help="shapes of the kernel sweep (bf16)")
    ap.add_argument("--variants", default="0,2", help="kernel choices timed: ours (0, the default) and ours_vN "
                    "columns (1 = general kernels only, 2 = the 2026-11-29 baseline kernels)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--baseline-dtypes", default="bfloat16", help="dtypes timed against the baselines too "
                    "(others: ours only, to save device time)")
    args = ap.parse_args()
    t0 = time.time()
    os.environ.setdefault("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")
    op = lnm.load_op()
    assert op is not None, lnm.op_error()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    res = {"what": __doc__.strip().splitlines()[0], "date": str(datetime.date.today()),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "copy_TBps": bw / 1e12, "rows": [], "sweep": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def parse(text):
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]

    shapes = SHAPES if args.shapes == "all" else parse(args.shapes)
    if not args.no_sweep:
        for shp in parse(args.sweep_shapes):
            res["sweep"] += tuning_sweep(op, *shp, torch.bfloat16, bw)
        save()
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for B, S, D in shapes:
            esize = torch.empty(0, dtype=dtype).element_size()
            nsets = 2 if B * S * D * esize < 256 * 2**20 else 1
            xs = [torch.randn(B, S, D, device="cuda").to(dtype).requires_grad_() for _ in range(nsets)]
            scs = [(0.5 * torch.randn(B, 1, D, device="cuda")).requires_grad_() for _ in range(nsets)]
            shs = [(0.5 * torch.randn(B, 1, D, device="cuda")).requires_grad_() for _ in range(nsets)]
            dys = [torch.randn(B, S, D, device="cuda").to(dtype) for _ in range(nsets)]
            fb, fbb = floor_bytes(B, S, D, esize)
            row = {"B": B, "S": S, "D": D, "dtype": str(dtype).replace("torch.", ""),
                   "floor_fwd_ms": fb / bw * 1e3, "floor_fwdbwd_ms": fbb / bw * 1e3}
            variants = [int(v) for v in args.variants.split(",")]
            provs = providers(B, op, variants)
            for name, fn in provs.items():
                for mode in ("fwd", "fwdbwd"):
                    key = f"{name}_{mode}_ms"
                    ours = name.startswith("ours")
                    if not ours and str(dtype).replace("torch.", "") not in args.baseline_dtypes.split(","):
                        row[key] = "skipped: ours only for this dtype"
                        continue
                    if time.time() - t0 > args.budget_s and not ours:
                        row[key] = "skipped: time budget"
                        continue
                    try:
                        row[key] = measure(fn, xs, scs, shs, dys, mode)
                    except Exception as err:  # noqa: BLE001 - a crashing baseline is a result
                        row[key] = f"error: {type(err).__name__}: {str(err)[:160]}"
                    torch.cuda.empty_cache()
            for name in [n for n in provs if n.startswith("ours")]:
                for mode, floor in (("fwd", fb), ("fwdbwd", fbb)):
                    t = row.get(f"{name}_{mode}_ms")
                    if isinstance(t, float):
                        row[f"{name}_{mode}_bw%"] = round(100 * floor / (t * 1e-3) / bw, 1)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
            del xs, scs, shs, dys
            torch.cuda.empty_cache()
    op.set_variant(0, 0)
    print(markdown(res))


def markdown(res):
    ours = sorted({k[:-len("_fwd_ms")] for r in res["rows"] for k in r if k.startswith("ours") and k.endswith("_fwd_ms")})
    cols = ours + ["wan_eager", "wan_compile", "wan_compile_dynamic", "apex_fused", "torch_ln_affine", "liger_affine"]
    lines = [f"Copy bandwidth {res['copy_TBps']:.2f} TB/s, {res['device']}, torch {res['torch']}, {res['date']}. "
             "Times in ms (median); bw% = byte floor / time / copy bandwidth.", "",
             "| shape | dtype | pass | floor | " + " | ".join(cols) + " | ours bw% |",
             "|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in res["rows"]:
        for mode in ("fwd", "fwdbwd"):
            cells = []
            for c in cols:
                v = r.get(f"{c}_{mode}_ms", "n/a")
                cells.append(f"{v:.3f}" if isinstance(v, float) else ("crash" if str(v).startswith("error") else str(v)))
            lines.append(f"| {r['B']}x{r['S']}x{r['D']} | {r['dtype']} | {mode} | {r[f'floor_{mode}_ms']:.3f} | "
                         + " | ".join(cells) + f" | {r.get(f'ours_{mode}_bw%', 'n/a')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
