"""Benchmark the fused LayerNorm-Modulate op against the baselines users would reach for.

    python bench/kernel/ln_modulate.py --out bench/results/ln_modulate-$(date +%F)-h200.json [--apex-src DIR]

One run measures: device copy bandwidth (the ceiling); for each shape, x dtype and modulation layout (per-sample
[B,1,D] or per-token [B,S,D], fp32), forward and forward+backward through autograd of: ours (default kernels),
ours_grid (the per-sample grid of 2026-11-30 at B >= 2, for A-B), ours_v2 (the 2026-11-29 baseline kernels),
the Wan eager chain (LN_fp32(x).to(x.dtype).float() * (1 + scale) + shift -> x.dtype), torch.compile(dynamic=True)
of it, and LN then modulate with F.layer_norm, Liger's LayerNorm, apex contrib's FastLayerNorm (built from
--apex-src) and QuACK's LayerNorm (quack-kernels, where installed). A crashing baseline is reported as its error.
Then host overhead per call (a tiny shape, where the GPU is idle) and what torch.compile and CUDA graphs make of
small shapes. Ours is also timed kernel-only: one replay of a CUDA graph (ours_kernel), and in a stream of launches
(ours_stream, beside copy_stream); --tile-sweep times only every compile-time tile of each shape's width in a stream.
Byte floor: bytes that must move (forward: x read + y written + the modulation read; backward: x and dy read, dx
written, the modulation read and its gradients written) over the copy bandwidth. Medians of CUDA-event timings;
inputs rotate between two sets when one set fits in L2."""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import ln_tuning as _tuning  # noqa: E402  (bench/kernel, beside this script)
from ds_adaptiveload.ops import ln_modulate  # noqa: E402
from ds_adaptiveload.ops import layernorm_modulate as lnm  # noqa: E402

SHAPES = [(1, 75600, 5120), (1, 32760, 1536), (2, 16380, 1536), (8, 4680, 1536), (32, 1560, 1536),
          (300, 1560, 1536), (4, 18900, 5120)]
EPS = 1e-6


def bench_ms(fn, warmup=10, rep=40):
    """Median ms over CUDA events around each call (back to back: a host-bound call measures its host time)."""
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


def modulate(ln, scale, shift, dtype):
    """The strongest plain-PyTorch modulate after an LN kernel: one fused kernel (addcmul) in x's dtype. (The
    2026-12-01 run used fp32 math, ln.float() * (1 + scale) + shift -> x.dtype: four full passes, so the LN
    baselines read 4.2-4.5 ms at (1, 75600, 5120) fwd where apex's LN alone takes ~0.4 ms.)"""
    return torch.addcmul(shift.to(dtype), ln, 1 + scale.to(dtype))


# Providers that are ours under other kernel choices (_tuning), set around the whole timed pass (the backward
# launches after the forward returns): the per-sample grid of 2026-11-30 and the 2026-11-29 baseline kernels.
TUNED = {"ours_grid": {"batch_path": "grid"}, "ours_v2": {"variant": (2, 2)}}


def apex_provider(mod):
    """apex contrib FastLayerNorm (gamma = 1, beta = 0) then the modulation, as an autograd Function."""
    class ApexLN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, gamma, beta):
            z, mu, rs = mod.ln_fwd(x.reshape(-1, x.shape[-1]), gamma, beta, EPS)
            ctx.save_for_backward(x, mu, rs, gamma, beta)
            return z.view(x.shape)

        @staticmethod
        def backward(ctx, dz):
            x, mu, rs, gamma, beta = ctx.saved_tensors
            out = mod.ln_bwd(dz.reshape(-1, x.shape[-1]).contiguous(), x.reshape(-1, x.shape[-1]), mu, rs, gamma,
                             beta, False)
            return out[0].view(x.shape), None, None

    def ln(x):
        D = x.shape[-1]
        ones, zeros = torch.ones(D, device=x.device, dtype=x.dtype), torch.zeros(D, device=x.device, dtype=x.dtype)
        return ApexLN.apply(x, ones, zeros)
    return ln


def ln_providers(apex_mod, apex_err):
    """LN kernels alone (x -> LN(x) in x's dtype, no affine): the baselines' LN half, for the record."""
    out = {"torch_ln": lambda x: F.layer_norm(x, (x.shape[-1],), eps=EPS)}
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        def liger(x):
            D = x.shape[-1]
            ones, zeros = torch.ones(D, device=x.device, dtype=x.dtype), torch.zeros(D, device=x.device, dtype=x.dtype)
            return LigerLayerNormFunction.apply(x, ones, zeros, EPS)
        out["liger_ln"] = liger
    except Exception as err:  # noqa: BLE001 - reported as that provider's error
        out["liger_ln"] = f"error: {type(err).__name__}: {err}"
    out["apex_fast_ln"] = apex_provider(apex_mod) if apex_mod is not None else f"error: {apex_err}"
    try:
        out["quack_ln"] = quack_ln()
    except Exception as err:  # noqa: BLE001 - not installed or cannot run here: reported as its error
        out["quack_ln"] = f"error: {type(err).__name__}: {err}"
    return out


def quack_ln():
    """QuACK's LayerNorm (quack-kernels, CuTe DSL: layernorm_fwd / layernorm_bwd) as x -> LN(x), no affine; its
    weight must be fp32, so ones in fp32 (its backward also reduces that weight's gradient, which it always does)."""
    from quack.rmsnorm import layernorm_bwd, layernorm_fwd

    class QuackLN(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x2 = x.reshape(-1, x.shape[-1])
            w = torch.ones(x.shape[-1], device=x.device, dtype=torch.float32)
            out, rstd, mean = layernorm_fwd(x2, w, None, EPS, return_rstd=True, return_mean=True)
            ctx.save_for_backward(x2, w, rstd, mean)
            return out.view(x.shape)

        @staticmethod
        def backward(ctx, dz):
            x2, w, rstd, mean = ctx.saved_tensors
            dx, _, _ = layernorm_bwd(x2, w, dz.reshape(x2.shape).contiguous(), rstd, mean, has_bias=False)
            return dx.view(dz.shape)
    return QuackLN.apply


def providers(apex_mod, apex_err):
    out = {"ours": ln_modulate, "ours_grid": ln_modulate, "ours_v2": ln_modulate,
           "ours_customop": lambda x, sc, sh: lnm.ln_modulate_op(x, sc, sh, None, None, EPS, x.dtype)[0],
           "wan_eager": wan_chain, "wan_compile_dynamic": torch.compile(wan_chain, dynamic=True)}
    for name, ln in ln_providers(apex_mod, apex_err).items():  # each LN kernel, then the fused modulate
        out[name + "_mod"] = ln if isinstance(ln, str) else (lambda x, sc, sh, ln=ln: modulate(ln(x), sc, sh, x.dtype))
    return out


def floor_bytes(B, S, D, esize, layout):
    mod_rows = B if layout == "sample" else B * S
    mod = 2 * mod_rows * D * 4  # fp32 scale + shift
    fwd = 2 * B * S * D * esize + mod
    bwd = 3 * B * S * D * esize + mod // 2 + mod  # read x, dy; write dx; read scale; write dscale, dshift
    return fwd, fwd + bwd


def make_inputs(B, S, D, dtype, layout, nsets):
    mshape = (B, 1, D) if layout == "sample" else (B, S, D)
    # A generator of its own: a failed CUDA-graph capture leaves the default one expecting a capture ("Offset
    # increment outside graph capture", which ended the 2026-12-01 benchmark at the next randn).
    gen = torch.Generator(device="cuda")
    gen.manual_seed(B * 131 + S)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    xs = [rnd(B, S, D).to(dtype).requires_grad_() for _ in range(nsets)]
    scs = [(0.5 * rnd(*mshape)).requires_grad_() for _ in range(nsets)]
    shs = [(0.5 * rnd(*mshape)).requires_grad_() for _ in range(nsets)]
    dys = [rnd(B, S, D).to(dtype) for _ in range(nsets)]
    return xs, scs, shs, dys


def measure(fn, sets, mode, ln=False):
    """fn over rotating input sets; mode 'fwd' or 'fwdbwd'; ln: gradients for x only (an LN without modulation)."""
    xs, scs, shs, dys = sets
    n, i = len(xs), [0]

    def fwd():
        k = i[0] = (i[0] + 1) % n
        with torch.no_grad():
            fn(xs[k], scs[k], shs[k])

    def fwdbwd():
        k = i[0] = (i[0] + 1) % n
        y = fn(xs[k], scs[k], shs[k])
        torch.autograd.grad(y, [xs[k]] if ln else [xs[k], scs[k], shs[k]], dys[k])

    return bench_ms(fwd if mode == "fwd" else fwdbwd)


def shape_row(B, S, D, dtype, layout, provs, bw, args, t0):
    esize = torch.empty(0, dtype=dtype).element_size()
    nsets = 2 if B * S * D * esize < 256 * 2**20 else 1
    sets = make_inputs(B, S, D, dtype, layout, nsets)
    fb, fbb = floor_bytes(B, S, D, esize, layout)
    row = {"B": B, "S": S, "D": D, "dtype": str(dtype).replace("torch.", ""), "layout": layout,
           "floor_fwd_ms": fb / bw * 1e3, "floor_fwdbwd_ms": fbb / bw * 1e3}
    baselines = f"{row['dtype']}:{layout}" in args.baseline_groups
    row.update(ours_direct(sets, layout))
    # One copy kernel of x's bytes at this size: what a single bandwidth-bound launch reaches here (launch and
    # ramp are a visible share of the small shapes' ~50 us floors).
    buf = torch.empty_like(sets[0][0])
    row["copy_x_ms"] = bench_ms(lambda: buf.copy_(sets[0][0]))
    row["copy_x_bw%"] = round(100 * 2 * buf.numel() * esize / (row["copy_x_ms"] * 1e-3) / bw, 1)
    del buf
    row.update(ours_stream(B, S, D, dtype, layout))
    if isinstance(row.get("copy_stream_ms"), float):
        row["copy_stream_bw%"] = round(100 * 2 * B * S * D * esize / (row["copy_stream_ms"] * 1e-3) / bw, 1)
    if baselines and time.time() - t0 <= args.budget_s:
        row.update(ln_only(sets, args.ln_provs))
    for name, fn in provs.items():
        for mode in ("fwd", "fwdbwd"):
            key = f"{name}_{mode}_ms"
            if not name.startswith("ours") and (not baselines or time.time() - t0 > args.budget_s):
                continue
            if isinstance(fn, str):
                row[key] = fn
                continue
            try:
                with _tuning.tuned(**TUNED.get(name, {})):
                    row[key] = measure(fn, sets, mode)
            except Exception as err:  # noqa: BLE001 - a crashing baseline is a result
                row[key] = f"error: {type(err).__name__}: {str(err)[:200]}"
            torch.cuda.empty_cache()
    for name in [*provs, "ours_kernel", "ours_graph", "ours_stream"]:
        for mode, floor in (("fwd", fb), ("fwdbwd", fbb)):
            t = row.get(f"{name}_{mode}_ms")
            if isinstance(t, float):
                row[f"{name}_{mode}_bw%"] = round(100 * floor / (t * 1e-3) / bw, 1)
    return row


def graph_replay_ms(fn, k=1, side=None):
    """fn captured k times in one CUDA graph: median ms per call over replays, i.e. GPU time without the host's
    per-call cost. Warm-up and capture on one side stream (torch's documented pattern), `side` if given."""
    if side is None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        for _ in range(k):
            fn()
    return bench_ms(g.replay, warmup=3, rep=20) / k


def direct_calls(x, sc, sh, dy):
    """The compiled module's forward and backward on one input set, without autograd or the Python wrapper:
    (x as [B*S, D], fwd(), bwd()). Runs the forward once for the statistics the backward reads."""
    op = lnm.load_op()
    x, sc, sh, dy = (t.detach() for t in (x, sc, sh, dy))
    B, S, D = x.shape
    x2, dy2 = x.reshape(B * S, D), dy.reshape(B * S, D)
    sc_mode, sb, ss, sc_t = lnm._layout(sc, B, S, D, 3)
    sh_mode, hb, hs, sh_t = lnm._layout(sh, B, S, D, 3)
    code = lnm._DTYPE_CODE[x.dtype]

    def fwd():
        return op.forward(x2, sc_t, sh_t, None, None, B, S, sb, ss, hb, hs, EPS, code, True, -1, -1, None)
    _, mean, rstd = fwd()

    def bwd():
        return op.backward(dy2, x2, sc_t, None, None, mean, rstd, B, S, sb, ss, sc_mode, sh_mode, False, False, EPS,
                           -1, -1, None)
    return x2, fwd, bwd


def ours_direct(sets, layout):
    """ours' kernels without autograd or the Python wrapper (direct_calls) replayed from a CUDA graph (kernel-only,
    ms per call; 8 calls per graph for small shapes, run from L2 there), and the autograd pass fwd+bwd through a
    CUDA graph. Errors are recorded, never raised."""
    out = {}
    k = 8 if sets[0][0].numel() < 2**25 else 1
    try:
        _, fwd, bwd = direct_calls(*(t[0] for t in sets))
        out["ours_kernel_fwd_ms"] = graph_replay_ms(fwd, k)
        out["ours_kernel_bwd_ms"] = graph_replay_ms(bwd, k)
        out["ours_kernel_fwdbwd_ms"] = out["ours_kernel_fwd_ms"] + out["ours_kernel_bwd_ms"]
    except Exception as err:  # noqa: BLE001 - a result, not a crash of the benchmark
        out["ours_kernel_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    for mode in ("fwd", "fwdbwd"):
        try:
            out[f"ours_graph_{mode}_ms"] = graph_ms(ln_modulate, sets, mode)
        except Exception as err:  # noqa: BLE001
            out[f"ours_graph_{mode}_ms"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    return out


def ours_stream(B, S, D, dtype, layout, k=8, nsets=4, tune=None):
    """Kernel time in a stream of launches: k forward (backward) calls captured in one CUDA graph over nsets input
    sets in turn, so each call reads inputs last touched nsets - 1 calls before (three calls' bytes, at least
    ~300 MB here, against a 50 MB L2). One replay of a one-kernel graph (ours_kernel at these shapes) also times the
    graph's own launch, a few us against the small shapes' ~50 us floors; a training step runs these kernels back to
    back in a stream. The copy of x (copy_stream) is timed the same way, as the like-for-like reference. tune: kernel
    choices (_tuning.tuned) for the timed calls."""
    flat = [direct_calls(*one) for one in zip(*make_inputs(B, S, D, dtype, layout, nsets))]
    out = {}
    i = [0]

    def turn(pick):  # each call takes the next set
        def call():
            pick(i[0] % nsets)
            i[0] += 1
        return call
    try:
        with _tuning.tuned(**(tune or {})):  # the backward's statistics above come from the default forward
            out["ours_stream_fwd_ms"] = graph_replay_ms(turn(lambda j: flat[j][1]()), k)
            out["ours_stream_bwd_ms"] = graph_replay_ms(turn(lambda j: flat[j][2]()), k)
        out["ours_stream_fwdbwd_ms"] = out["ours_stream_fwd_ms"] + out["ours_stream_bwd_ms"]
        if tune is None:
            bufs = [torch.empty_like(f[0]) for f in flat]
            out["copy_stream_ms"] = graph_replay_ms(turn(lambda j: bufs[j].copy_(flat[j][0])), k)
    except Exception as err:  # noqa: BLE001 - a result, not a crash of the benchmark
        out["ours_stream_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return out


def tile_sweep(B, S, D, dtype, layout, bw, waves=(1,), batch_paths=("auto",), passes=("fwd", "bwd")):
    """--tile-sweep: every compile-time tile of width D, forward and backward, timed in a stream (ours_stream under
    _tuning's tile choice); % of the forward's and the backward's byte floors. The default tile is the first per D.
    batch_paths: each tile under each of these (_tuning batch_path; "flat" puts every B on the flat row space);
    waves: on the paths other than "auto", the forward at each of these grid sizes (_tuning waves: the flat row
    space's grid in waves of resident CTAs). Rows other than "auto" carry "waves" and "batch_path"."""
    esize = torch.empty(0, dtype=dtype).element_size()
    fb, fbb = floor_bytes(B, S, D, esize, layout)
    rows = []
    for backward, floor in ((False, fb), (True, fbb - fb)):
        if ("bwd" if backward else "fwd") not in passes:
            continue
        for i, (d, vpt, wpr, pf) in enumerate(_tuning.fast_tiles(backward)):
            if d != D:
                continue
            for batch_path, w in [(bp, w) for bp in batch_paths
                                  for w in ((0,) if backward or bp == "auto" else waves)]:
                tune = {"tile": (-1, i) if backward else (i, -1), "batch_path": batch_path, "waves": w}
                r = ours_stream(B, S, D, dtype, layout, tune=tune)
                key = "ours_stream_bwd_ms" if backward else "ours_stream_fwd_ms"
                row = {"B": B, "S": S, "D": D, "dtype": str(dtype).replace("torch.", ""), "layout": layout,
                       "pass": "bwd" if backward else "fwd", "tile": [vpt, wpr, pf],
                       "ms": r.get(key, r.get("ours_stream_error"))}
                if batch_path != "auto":
                    row.update(waves=w, batch_path=batch_path)
                if isinstance(row["ms"], float):
                    row["bw%"] = round(100 * floor / (row["ms"] * 1e-3) / bw, 1)
                rows.append(row)
                print("tile", json.dumps(row), flush=True)
    return rows


def ln_only(sets, provs):
    """The LN kernels alone, fwd and fwd+bwd through autograd (ms)."""
    out = {}
    xs, _, _, dys = sets
    for name, fn in provs.items():
        for mode in ("fwd", "fwdbwd"):
            if isinstance(fn, str):
                out[f"{name}_{mode}_ms"] = fn
                continue
            try:
                out[f"{name}_{mode}_ms"] = measure(lambda x, sc, sh, fn=fn: fn(x), (xs, xs, xs, dys), mode, ln=True)
            except Exception as err:  # noqa: BLE001
                out[f"{name}_{mode}_ms"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    return out


def host_us(fn, sets, mode, n=200):
    """Host time per call (us): a loop of n calls without synchronizing. At a tiny shape the GPU idles, so this
    is the host's cost (Python, autograd, dispatch, launches); at large shapes the loop waits on the GPU."""
    xs, scs, shs, dys = sets

    def call():
        if mode == "fwd":
            with torch.no_grad():
                fn(xs[0], scs[0], shs[0])
        else:
            torch.autograd.grad(fn(xs[0], scs[0], shs[0]), [xs[0], scs[0], shs[0]], dys[0])
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def graph_ms(fn, sets, mode):
    """The autograd pass captured in one CUDA graph (torch.cuda.graph, static inputs) and replayed: GPU time
    without the host. Leaves are made, warmed up and captured on one side stream: leaves first used on the
    default stream tie their AccumulateGrad nodes to it, and the capture was invalidated (2026-12-01)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x, sc, sh = (t[0].detach().clone().requires_grad_() for t in sets[:3])
        dy = sets[3][0].clone()

    def step():
        if mode == "fwd":
            with torch.no_grad():
                fn(x, sc, sh)
        else:
            torch.autograd.grad(fn(x, sc, sh), [x, sc, sh], dy)
    return graph_replay_ms(step, 1, side)


def host_overhead(bw):
    """Small shapes: eager (autograd Function), the custom op called eagerly, torch.compile of the op call
    (default and reduce-overhead, i.e. CUDA graphs), and a hand-captured CUDA graph of the eager pass. One input
    set (CUDA graphs replay fixed addresses), so small shapes run from L2: read the times as host-vs-GPU splits."""
    def op_call(x, sc, sh):
        return ln_modulate(x, sc, sh)
    paths = {"eager": ln_modulate,
             # The floor any autograd path pays: F.layer_norm then modulate in x's dtype (two kernels each way).
             "torch_ln": lambda x, sc, sh: F.layer_norm(x, x.shape[-1:], eps=EPS) * (1 + sc.to(x.dtype)) + sh.to(x.dtype),
             "customop": lambda x, sc, sh: lnm.ln_modulate_op(x, sc, sh, None, None, EPS, x.dtype)[0],
             "compiled": torch.compile(op_call, fullgraph=True, dynamic=True),
             "compiled_cudagraphs": torch.compile(op_call, fullgraph=True, dynamic=True, mode="reduce-overhead")}
    rows = []
    for B, S, D in [(1, 8, 1536), (2, 1560, 1536), (1, 32760, 1536)]:
        try:
            rows.append(host_row(paths, B, S, D, bw))
        except Exception as err:  # noqa: BLE001 - one shape's failure never ends the benchmark or its JSON
            rows.append({"B": B, "S": S, "D": D, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print("host", json.dumps(rows[-1]), flush=True)
    host_profile()
    return rows


def host_profile(B=1, S=8, D=1536, n=50):
    """Where the eager fwd+bwd's host time goes: torch.profiler's CPU table over n calls at a tiny shape (log only)."""
    xs, scs, shs, dys = make_inputs(B, S, D, torch.bfloat16, "sample", 1)
    for _ in range(10):
        torch.autograd.grad(ln_modulate(xs[0], scs[0], shs[0]), [xs[0], scs[0], shs[0]], dys[0])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            torch.autograd.grad(ln_modulate(xs[0], scs[0], shs[0]), [xs[0], scs[0], shs[0]], dys[0])
        torch.cuda.synchronize()
    print(f"host profile, eager fwd+bwd x{n} at ({B},{S},{D}):", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


def host_row(paths, B, S, D, bw):
    """One host-overhead shape: each path's ms and host us per call, then the CUDA graphs (last: a failed capture
    must not disturb the others)."""
    sets = make_inputs(B, S, D, torch.bfloat16, "sample", 1)
    fb, fbb = floor_bytes(B, S, D, 2, "sample")
    row = {"B": B, "S": S, "D": D, "floor_fwd_ms": fb / bw * 1e3, "floor_fwdbwd_ms": fbb / bw * 1e3}
    for name, fn in paths.items():
        for mode in ("fwd", "fwdbwd"):
            try:
                row[f"{name}_{mode}_ms"] = measure(fn, sets, mode)
                row[f"{name}_{mode}_host_us"] = round(host_us(fn, sets, mode), 1)
            except Exception as err:  # noqa: BLE001
                row[f"{name}_{mode}_ms"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    row.update(ours_direct(sets, "sample"))
    return row


def build_apex(src):
    """apex contrib FastLayerNorm from its sources (apex/contrib/csrc/layer_norm), flags as measured on the H200
    (/work/shared/device/NOTES.md). Returns (module, seconds, error)."""
    from torch.utils.cpp_extension import load

    t = time.time()
    try:
        srcs = [os.path.join(src, f) for f in ("ln_api.cpp", "ln_fwd_cuda_kernel.cu", "ln_bwd_semi_cuda_kernel.cu")]
        flags = ["-O3", "--use_fast_math", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                 "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                 "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                 "--expt-relaxed-constexpr", "--expt-extended-lambda", "-gencode=arch=compute_90,code=sm_90"]
        mod = load("fast_layer_norm_bench", srcs, extra_cflags=["-O3"], extra_cuda_cflags=flags,
                   extra_include_paths=[src], verbose=False)
        return mod, time.time() - t, None
    except Exception as err:  # noqa: BLE001 - the baseline is then reported as a crash
        return None, time.time() - t, f"{type(err).__name__}: {str(err)[-300:]}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"bench/results/ln_modulate-{datetime.date.today()}-h200.json")
    ap.add_argument("--apex-src", default=None, help="folder with apex/contrib/csrc/layer_norm's files")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip remaining baselines after this many seconds")
    ap.add_argument("--baselines", default="all", help="the groups that time the baselines (within --budget-s): "
                    "'all', 'none' or e.g. bfloat16:sample,float16:token")
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 1x75600x5120,8x4680x1536")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--layouts", default="sample,token")
    ap.add_argument("--no-host", action="store_true", help="skip the host-overhead / compile / CUDA-graph part")
    ap.add_argument("--apex-only", action="store_true", help="only build apex (warms its JIT cache) and exit")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="only time every compile-time tile of each shape's width in a stream (fwd and bwd)")
    ap.add_argument("--waves", default="0", help="--tile-sweep: the forward at these grid sizes off the auto path, "
                    "e.g. 0,1,8 (0: the op's rule)")
    ap.add_argument("--batch-paths", default="auto", help="--tile-sweep: each tile under these _tuning batch paths "
                    "(auto, grid, flat), e.g. auto,flat")
    ap.add_argument("--passes", default="fwd,bwd", help="--tile-sweep: fwd, bwd or both")
    args = ap.parse_args(argv)
    groups_ok = {f"{d}:{lay}" for d in args.dtypes.split(",") for lay in args.layouts.split(",")}
    asked = set(args.baselines.split(","))
    bad = sorted(asked - groups_ok - {"all", "none"})
    if bad:  # checked before any GPU work: a typo would otherwise time no baseline, silently
        raise SystemExit(f"--baselines: {','.join(bad)} is not 'all', 'none' or one of {sorted(groups_ok)}")
    args.baseline_groups = groups_ok if args.baselines == "all" else asked - {"none", "all"}  # parsed once
    t0 = time.time()
    if args.apex_only:
        mod, secs, err = build_apex(args.apex_src)
        print(f"apex build: {'ok' if mod else err} in {secs:.0f} s")
        return
    os.environ.setdefault("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")
    assert lnm.load_op() is not None, lnm.op_error()
    apex_mod, apex_s, apex_err = build_apex(args.apex_src) if args.apex_src else (None, 0.0, "no --apex-src given")
    print(f"apex: {'built' if apex_mod else apex_err} ({apex_s:.0f} s)", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    res = {"what": __doc__.strip().splitlines()[0], "date": str(datetime.date.today()),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "copy_TBps": bw / 1e12, "apex_build_s": apex_s, "apex_error": apex_err, "rows": [], "host": []}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    provs = providers(apex_mod, apex_err)
    args.ln_provs = ln_providers(apex_mod, apex_err)
    groups = [(lay, getattr(torch, d)) for lay in args.layouts.split(",") for d in args.dtypes.split(",")]
    if args.tile_sweep:
        res["tiles"] = [row for layout, dtype in groups for B, S, D in shapes
                        for row in tile_sweep(B, S, D, dtype, layout, bw, [int(w) for w in args.waves.split(",")],
                                              args.batch_paths.split(","), args.passes.split(","))]
        save()
        return
    for k, (layout, dtype) in enumerate(groups):
        for B, S, D in shapes:
            row = shape_row(B, S, D, dtype, layout, provs, bw, args, t0)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
            torch.cuda.empty_cache()
        if k == 0 and not args.no_host:  # after the first group: a run cut short still has these
            res["host"] = host_overhead(bw)
            save()
    print(markdown(res))


def cell_text(v):
    """A baseline's error as a table cell: a missing package is not a crash of the baseline."""
    if "ModuleNotFoundError" in v:
        return "not installed"
    return "crash" if v.startswith("error") else v


def markdown(res):
    cols = ["ours", "ours_kernel", "ours_graph", "ours_stream", "ours_grid", "ours_v2", "ours_customop",
            "wan_eager", "wan_compile_dynamic", "torch_ln_mod", "liger_ln_mod", "apex_fast_ln_mod", "quack_ln_mod",
            "torch_ln", "liger_ln", "apex_fast_ln", "quack_ln"]
    lines = [f"Copy bandwidth {res['copy_TBps']:.2f} TB/s, {res['device']}, torch {res['torch']}, {res['date']}. "
             "Times in ms (median); bw% = byte floor / time / copy bandwidth.", "",
             "| shape | dtype | layout | pass | floor | " + " | ".join(cols) + " | ours bw% |",
             "|---|---|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in res["rows"]:
        for mode in ("fwd", "fwdbwd"):
            cells = []
            for c in cols:
                v = r.get(f"{c}_{mode}_ms", "-")
                cells.append(f"{v:.3f}" if isinstance(v, float) else cell_text(str(v)))
            lines.append(f"| {r['B']}x{r['S']}x{r['D']} | {r['dtype']} | {r['layout']} | {mode} | "
                         f"{r[f'floor_{mode}_ms']:.3f} | " + " | ".join(cells) + f" | {r.get(f'ours_{mode}_bw%', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
