"""Self-attention kernels at the Wan 1.3B model's shapes (issue #21: attention is about three quarters of a video
micro-batch's GPU time): forward and forward+backward ms and TFLOP/s of torch SDPA's cuDNN and flash backends
against FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels with an SM90 path), called directly in the
model's [B, S, heads, head_dim] layout and, where torch can register it, as SDPA's flash backend. Each backend's
output and gradients are compared with cuDNN's, and at the image shape with an fp32 reference.

    python3 bench/model/attn_backends.py --out OUT [--shapes 720p81,480p81,img32] [--backends ...]
    python3 bench/device/run.py --fa4 .fa4 --stages attn_backends ...     # on the device: FA4 from carried wheels
    ATTN_SMOKE=1 python3 bench/model/attn_backends.py --out /tmp/ab      # CPU: tiny shapes, torch's backends

FA4 needs the flash-attn-4 package (pip install flash-attn-4; bench/device/run.py --fa4 installs it there).
Writes OUT/attn-backends.json (every timing, the errors, the env)."""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/, for harness
import harness  # noqa: E402

SMOKE = os.environ.get("ATTN_SMOKE") == "1"
HEADS, HEAD_DIM = (2, 16) if SMOKE else (12, 128)
# shape -> (samples, tokens per sample): one 720p / 480p 81-frame clip, 32 images at 480x832
SHAPES = ({"720p81": (1, 96), "480p81": (1, 64), "img32": (4, 16)} if SMOKE else
          {"720p81": (1, 75600), "480p81": (1, 32760), "img32": (32, 1560)})
BACKENDS = ("cudnn", "flash", "fa4", "fa4-sdpa", "math")


def flops(b, s, fwd_bwd):
    """Model FLOPs of non-causal attention: 4 B H S^2 D forward (QK^T and PV), 2.5x that more in backward."""
    f = 4.0 * b * HEADS * s * s * HEAD_DIM
    return f * 3.5 if fwd_bwd else f


def make_fn(name):
    """(q, k, v) [B, S, H, D] -> out [B, S, H, D] through backend `name`."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "fa4":
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v)
            return out[0] if isinstance(out, tuple) else out
        return fa4
    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                    "fa4-sdpa": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[name]

    def sdpa(q, k, v):  # the model's call (model/wan.sdpa_attention): transposed views of [B, S, H, D]
        with sdpa_kernel(sdpa_backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)
    return sdpa if name != "math" else (lambda q, k, v: sdpa(q.float(), k.float(), v.float()).to(q.dtype))


def activate_fa4_sdpa(log):
    """torch's FA4 registration (torch.nn.attention.activate_flash_attention_impl), where this torch has it."""
    import torch.nn.attention as A

    if not hasattr(A, "activate_flash_attention_impl"):
        raise RuntimeError("this torch has no torch.nn.attention.activate_flash_attention_impl")
    log(f"flash attention impls: {A.list_flash_attention_impls()}")
    A.activate_flash_attention_impl("FA4")


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_shape(shape, names, reps, log):
    """Times every backend at one shape (two rounds, the second in reverse order, against clock drift) and compares
    its output and gradients with cuDNN's (with math's at the smallest shape)."""
    import torch

    b, s = SHAPES[shape]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    rows, results = {}, {}
    for name in names:
        row = rows[name] = {"shape": shape, "B": b, "S": s, "backend": name}
        try:
            fn = make_fn(name)
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            t0 = time.time()
            out = fn(qq, kk, vv)
            out.backward(dout)
            row["first_call_s"] = round(time.time() - t0, 2)
            results[name] = (out.detach(), qq.grad, kk.grad, vv.grad)
        except Exception as e:  # a baseline's crash is a result
            row["status"] = f"crashed: {type(e).__name__}: {str(e)[:300]}"
            log(f"{shape} {name}: {row['status']}")
    timing = [n for n in names if "status" not in rows[n] and (n != "math" or SMOKE)]
    for order in (timing, timing[::-1]):
        for name in order:
            fn, row = make_fn(name), rows[name]
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fwd():
                with torch.no_grad():
                    fn(qq, kk, vv)

            def fwd_bwd():
                fn(qq, kk, vv).backward(dout)
                qq.grad = kk.grad = vv.grad = None
            timer = harness.time_cuda if dev == "cuda" else harness.time_cpu
            for part, f in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
                r = timer(f, warmup=2 if dev == "cuda" else 1, rep=reps)
                row.setdefault(f"{part}_ms_rounds", []).append(round(r["median"], 3))
    for name in timing:
        row = rows[name]
        for part in ("fwd", "fwdbwd"):
            ms = min(row[f"{part}_ms_rounds"])
            row[f"{part}_ms"] = ms
            row[f"{part}_tflops"] = round(flops(b, s, part == "fwdbwd") / ms / 1e9, 1)
        row["status"] = "ok"
    for ref_name in ("cudnn", "math"):
        ref = results.get(ref_name)
        for name, got in results.items():
            if ref is not None and name != ref_name:
                rows[name][f"err_vs_{ref_name}"] = {
                    t: round(rel_err(a, r), 6) for t, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    for name in names:
        log(json.dumps(rows[name]))
    return list(rows.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--backends", default="cudnn,flash,fa4,fa4-sdpa,math",
                    help=f"comma list of {', '.join(BACKENDS)} (math: the fp32 reference, run at img32 only)")
    ap.add_argument("--reps", type=int, default=3 if SMOKE else 10)
    a = ap.parse_args(argv)
    shapes = harness.comma_choices(ap, "--shapes", a.shapes, SHAPES)
    names = harness.comma_choices(ap, "--backends", a.backends, BACKENDS)
    os.makedirs(a.out, exist_ok=True)

    def log(msg):
        print(f"[attn_backends] {msg}", flush=True)

    notes = {}
    import torch

    rows = []
    first = [n for n in names if n != "fa4-sdpa"]
    for shape in shapes:
        rows += run_shape(shape, [n for n in first if n != "math" or shape == "img32"], a.reps, log)
    if "fa4-sdpa" in names:  # last: the registration replaces SDPA's flash kernels for the rest of the process
        try:
            activate_fa4_sdpa(log)
        except Exception as e:
            notes["fa4-sdpa"] = f"not registered: {type(e).__name__}: {str(e)[:300]}"
        else:
            for shape in shapes:  # cuDNN again beside it, as this round's reference
                rows += run_shape(shape, ["cudnn", "fa4-sdpa"], a.reps, log)
    env = harness.environment()
    env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels"):
        env[dist] = harness._version(dist)
    env["gpu"] = harness.gpu_query()
    with open(os.path.join(a.out, "attn-backends.json"), "w") as f:
        json.dump({"heads": HEADS, "head_dim": HEAD_DIM, "rows": rows, "notes": notes, "env": env}, f, indent=1)
    log(f"wrote {a.out}/attn-backends.json")


if __name__ == "__main__":
    main()
