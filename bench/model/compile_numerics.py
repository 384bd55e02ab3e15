"""Which of eager and compiled Wan blocks computes the right gradients on the GPU, and where do they part?

One 480p 81f sample through the 1.3B Wan DiT (fewer blocks by default, --layers), the same weights for every
variant, gradients of a flow-matching-like loss. The reference is the fp32 model run eagerly with SDPA's
memory-efficient kernel (exact fp32 attention). Each bf16 variant is compared with it parameter by parameter:
the overall relative error, the error per parameter kind (block index dropped) and per block, and the worst
parameters. Variants split the pipeline: dynamo alone (backend eager), dynamo + AOT autograd (aot_eager),
inductor, and each SDPA kernel, eagerly and compiled. bench/mfu.py saw compiled gradient norms 22x eager's
on the H200 (2026-12-01) with the same loss; this says which side is wrong and in which operation.

    python bench/model/compile_numerics.py --out OUT [--variants eager,compile,...] [--layers 6]
"""
import argparse
import contextlib
import dataclasses
import json
import os
import glob
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ds_adaptiveload.model import WanConfig, WanModel, wan  # noqa: E402
from ds_adaptiveload.model.compile import compile_blocks, uncompile_blocks  # noqa: E402

SDPA = wan.sdpa_attention
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# variant -> (torch.compile backend or None for eager, SDPA kernel or None for the default, checkpoint policy
# or None for no checkpointing, attention outside the compiled graph, static shapes)
VARIANTS = {
    "eager": (None, None, None, False, False),
    "eager-flash": (None, "flash", None, False, False),
    "eager-efficient": (None, "efficient", None, False, False),
    "eager-ckpt": (None, None, "full", False, False),
    "dynamo": ("eager", None, None, False, False),
    "aot": ("aot_eager", None, None, False, False),
    "compile": ("inductor", None, None, False, False),
    "compile-static": ("inductor", None, None, False, True),
    "compile-flash": ("inductor", "flash", None, False, False),
    "compile-efficient": ("inductor", "efficient", None, False, False),
    "compile-sdpa-eager": ("inductor", None, None, True, False),
    "compile-attn": ("inductor", None, "attention", False, False),
    "compile-ckpt": ("inductor", None, "full", False, False),
}
# variant -> config patches (module, {key: value}) in effect while it compiles and runs: which inductor pass is at fault
PATCHES = {
    "compile-nosplit": ("inductor", {"split_reductions": False}),
    "compile-nopersist": ("inductor", {"triton.persistent_reductions": False}),
    "compile-noreuse": ("inductor", {"allow_buffer_reuse": False, "inplace_buffers": False}),
    "compile-nodonate": ("functorch", {"donated_buffer": False}),
}
VARIANTS.update({name: VARIANTS["compile"] for name in PATCHES})
DEFAULT = ("eager,eager-flash,eager-efficient,dynamo,aot,compile,compile-static,compile-flash,compile-efficient,"
           "compile-sdpa-eager,compile-attn,compile-nosplit,compile-nopersist,compile-noreuse,compile-nodonate")


def grads_of(model, inputs, kernel):
    """(loss, prediction, {name: fp32 gradient})."""
    x, t, ctx, target = inputs
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([KERNELS[kernel]]) if kernel else contextlib.nullcontext():
        pred = model(x, t, ctx)
        loss = (pred.float() - target).pow(2).mean()
        loss.backward()
    return float(loss), pred.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                if p.grad is not None}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(grads, ref):
    """Relative errors against the reference: overall, per parameter kind, per block, worst parameters."""
    num, den = defaultdict(float), defaultdict(float)
    per_block_num, per_block_den, worst = defaultdict(float), defaultdict(float), []
    tot_num = tot_den = 0.0
    for name, g in grads.items():
        r = ref[name]
        d2, r2 = float((g - r).pow(2).sum()), float(r.pow(2).sum())
        kind = re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        num[kind] += d2
        den[kind] += r2
        m = re.match(r"^blocks\.(\d+)\.", name)
        if m:
            per_block_num[int(m.group(1))] += d2
            per_block_den[int(m.group(1))] += r2
        tot_num, tot_den = tot_num + d2, tot_den + r2
        worst.append((d2 ** 0.5 / max(r2 ** 0.5, 1e-30), name, r2 ** 0.5, float(g.norm())))
    worst.sort(reverse=True)
    return {"grad_rel_err": (tot_num / max(tot_den, 1e-30)) ** 0.5,
            "per_kind": {k: round((num[k] / max(den[k], 1e-30)) ** 0.5, 5) for k in sorted(num)},
            "per_block": [round((per_block_num[b] / max(per_block_den[b], 1e-30)) ** 0.5, 5)
                          for b in sorted(per_block_num)],
            "worst": [{"param": n, "rel_err": round(e, 5), "ref_norm": rn, "norm": gn} for e, n, rn, gn in worst[:6]]}


def build(args, device):
    cfg = WanConfig.from_yaml(os.path.join(ROOT, args.config))
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    torch.manual_seed(0)
    model = WanModel(cfg)
    with torch.no_grad():  # the zero-initialised head would leave every other gradient zero
        model.head.head.weight.normal_(std=0.02)
    g = torch.Generator(device=device).manual_seed(1)
    lat = [int(v) for v in args.latent.split("x")]
    x = torch.randn(1, cfg.in_dim, *lat, generator=g, device=device)
    inputs = (x, torch.full((1,), 500.0, device=device),
              torch.randn(1, cfg.text_len, cfg.text_dim, generator=g, device=device),
              torch.randn(1, cfg.out_dim, *lat, generator=g, device=device))
    return model.to(device), inputs, lat


def reference(model, inputs, device):
    """fp32, eager, exact attention (memory-efficient kernel on CUDA, math on CPU), every block checkpointed."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model.set_checkpointing(True, 0, policy="full")
    loss, pred, grads = grads_of(model, inputs, "efficient" if device == "cuda" else None)
    model.set_checkpointing(False, 0)
    return loss, pred, grads


def poison():
    """Fill the CUDA caching allocator's free blocks (small and large pools) with NaN, so that a kernel which
    reads memory it never wrote gives non-finite gradients."""
    small = [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(2048)]  # 512 KiB: small pool
    free = torch.cuda.mem_get_info()[0]
    large = [torch.full((1 << 28,), float("nan"), device="cuda") for _ in range(int(free * 0.6) >> 30)]
    del small, large


def patched(name):
    if name not in PATCHES:
        return contextlib.nullcontext()
    where, values = PATCHES[name]
    mod = torch._inductor.config if where == "inductor" else torch._functorch.config
    return mod.patch(values)


def run_variant(model, inputs, name, ref, calls=3):
    backend, kernel, policy, attn_out, static = VARIANTS[name]
    uncompile_blocks(model)
    torch._dynamo.reset()  # no graph of an earlier variant (an SDPA kernel choice is not part of the guards)
    wan.sdpa_attention = torch.compiler.disable(SDPA) if attn_out else SDPA
    model.set_attention(wan.sdpa_attention)
    if backend:
        compile_blocks(model, dynamic=not static, backend=backend)
    model.set_checkpointing(policy is not None, 0, policy=policy or "full")
    row = {"variant": name, "backend": backend or "none", "sdpa": kernel or "default",
           "checkpoint": policy or "none", "patch": PATCHES.get(name)}
    try:
        t0 = time.time()
        row["calls"] = []
        with patched(name):
            for call in range(calls):  # the first compiles; does the error change from call to call?
                if call == calls - 1 and torch.cuda.is_available():
                    poison()
                loss, pred, grads = grads_of(model, inputs, kernel)
                row["calls"].append({"grad_rel_err": compare(grads, ref[2])["grad_rel_err"],
                                     "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
                                     "poisoned": call == calls - 1 and torch.cuda.is_available()})
        flat_norm = sum(float(g.pow(2).sum()) for g in grads.values()) ** 0.5
        row.update(loss=loss, grad_norm=flat_norm, finite=all(bool(torch.isfinite(g).all()) for g in grads.values()),
                   pred_rel_err=rel(pred, ref[1]), s=round(time.time() - t0, 1), **compare(grads, ref[2]))
    except Exception as err:  # noqa: BLE001 - a failing variant is a result
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    finally:
        wan.sdpa_attention = SDPA
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=DEFAULT, help=", ".join(VARIANTS))
    ap.add_argument("--config", default="configs/wan_1_3b.yaml")
    ap.add_argument("--layers", type=int, default=6, help="blocks (0: the config's)")
    ap.add_argument("--latent", default="21x60x104", help="F x H x W of the latent (480p 81f)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ADAPTIVELOAD_LN_MODULATE", "torch")  # as bench/mfu.py's compiled rows
    code_dir = os.path.join(args.out, "inductor_code")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="numerics-inductor-")
    model, inputs, lat = build(args, args.device)
    t0 = time.time()
    ref = reference(model, inputs, args.device)
    head = {"variant": "reference-fp32", "loss": ref[0], "grad_norm": sum(float(g.pow(2).sum()) for g in
                                                                          ref[2].values()) ** 0.5,
            "s": round(time.time() - t0, 1)}
    print("[numerics]", json.dumps(head), flush=True)
    rows = [head]
    model = model.to(torch.bfloat16)
    bf_inputs = tuple(v.bfloat16() if i in (0, 2) else v for i, v in enumerate(inputs))
    for name in args.variants.split(","):
        row = run_variant(model, bf_inputs, name, ref)
        print("[numerics]", json.dumps(row), flush=True)
        rows.append(row)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    keep_code(cache, code_dir)
    with open(os.path.join(args.out, "compile_numerics.json"), "w") as f:
        json.dump({"torch": torch.__version__, "triton": _version("triton"),
                   "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "config": args.config, "layers": model.cfg.num_layers, "latent": lat, "rows": rows}, f, indent=1)


def keep_code(cache, dest, limit=60):
    """Copy inductor's generated Python modules (the graphs' `call` functions and their Triton kernels) out of
    its cache, to read which kernels the backward ran."""
    os.makedirs(dest, exist_ok=True)
    found = sorted(glob.glob(os.path.join(cache, "**", "*.py"), recursive=True), key=os.path.getmtime)
    kept = [p for p in found if "def call(" in open(p, errors="replace").read()][:limit]
    for i, p in enumerate(kept):
        shutil.copy(p, os.path.join(dest, f"{i:03d}-{os.path.basename(p)}"))


def _version(mod):
    try:
        return __import__(mod).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
