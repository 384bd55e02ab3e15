"""Are compiled blocks' gradients finite and equal to eager ones at full size? One 480p 81f sample through the
1.3B Wan DiT in bf16 (no DeepSpeed, no optimizer step: the same weights for every variant), gradients of a
flow-matching-like loss per variant: eager, compiled, compiled with the flash SDPA backend, compiled with the
attention checkpoint policy. bench/mfu.py saw non-finite gradient norms on un-checkpointed compiled blocks at
32k-76k tokens (2026-12-01) after many optimizer steps on random data; this separates the two causes.

    python bench/model/compile_numerics.py --out OUT [--variants eager,compile,...]
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ds_adaptiveload.model import WanConfig, WanModel, wan  # noqa: E402
from ds_adaptiveload.model.compile import compile_blocks, uncompile_blocks  # noqa: E402

SDPA = wan.sdpa_attention
# variant -> (compiled, checkpoint_blocks, policy, SDPA backend or None for the default)
VARIANTS = {"eager": (False, False, "full", None), "compile": (True, False, "full", None),
            "compile-flash": (True, False, "full", "flash"), "compile-attn-all": (True, True, "attention", None),
            "eager-full-all": (False, True, "full", None), "compile-sdpa-eager": (True, False, "full", "eager"),
            "compile-static": (True, False, "full", "static")}


def grads_of(model, inputs, backend):
    x, t, ctx, target = inputs
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if backend == "flash" else contextlib.nullcontext():  # noqa: E501
        pred = model(x, t, ctx)
        loss = (pred.float() - target).pow(2).mean()
        loss.backward()
    flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return float(loss), flat


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="eager,compile,compile-static,compile-sdpa-eager,compile-flash",
                    help=", ".join(VARIANTS))
    ap.add_argument("--latent", default="21x60x104", help="F x H x W of the latent (480p 81f)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ADAPTIVELOAD_LN_MODULATE", "torch")  # as bench/mfu.py's compiled rows
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs/wan_1_3b.yaml"))
    torch.manual_seed(0)
    model = WanModel(cfg)
    with torch.no_grad():  # the zero-initialised head would leave every other gradient zero
        model.head.head.weight.normal_(std=0.02)
    model = model.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    lat = [int(v) for v in args.latent.split("x")]
    x = torch.randn(1, cfg.in_dim, *lat, generator=g, device="cuda").bfloat16()
    inputs = (x, torch.full((1,), 500.0, device="cuda"),
              torch.randn(1, cfg.text_len, cfg.text_dim, generator=g, device="cuda").bfloat16(),
              torch.randn(1, cfg.out_dim, *lat, generator=g, device="cuda"))
    rows, ref = [], None
    for name in args.variants.split(","):
        compiled, ckpt, policy, backend = VARIANTS[name]
        uncompile_blocks(model)
        torch._dynamo.reset()  # no graph of an earlier variant (an SDPA backend is not part of the guards)
        # "eager" backend: both attention cores run outside the compiled graph (a graph break each)
        wan.sdpa_attention = torch.compiler.disable(SDPA) if backend == "eager" else SDPA
        model.set_attention(wan.sdpa_attention)
        if compiled:
            compile_blocks(model, dynamic=backend != "static")
        model.checkpoint_blocks, model.checkpoint_policy = ckpt, policy
        row = {"variant": name}
        try:
            t0 = time.time()
            grads_of(model, inputs, backend)  # warm-up (compiles)
            loss, flat = grads_of(model, inputs, backend)
            row.update(loss=loss, grad_norm=float(flat.norm()), finite=bool(torch.isfinite(flat).all()),
                       nonfinite=int((~torch.isfinite(flat)).sum()), s=round(time.time() - t0, 1))
            if ref is None:
                ref = flat
            else:
                ok = torch.isfinite(flat) & torch.isfinite(ref)
                row["rel_diff_vs_first"] = float((flat[ok] - ref[ok]).norm() / ref[ok].norm())
        except Exception as err:  # noqa: BLE001 - a failing variant is a result
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print("[numerics]", json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_numerics.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "latent": lat,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
