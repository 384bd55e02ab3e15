"""The op's small cases for compute-sanitizer (memcheck / racecheck): every kernel choice over odd shapes, dtypes
and modulation layouts, then every compile-time tile at D = 1536 and 5120 with several rows per CTA (so that
the rows-ahead ring and the barrier slots wrap).

    compute-sanitizer --tool memcheck --print-limit 20 python bench/kernel/sanitizer_cases.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_adaptiveload.ops import ln_modulate  # noqa: E402
from ds_adaptiveload.ops.layernorm_modulate import load_op  # noqa: E402

# (B, S, D, dtype, affine, modulation layout); the last three wrap each row group's shared-memory ring
# several times (staged row stream).
CASES = [(2, 67, 1536, torch.bfloat16, False, "sample"), (2, 33, 100, torch.float16, True, "token"),
         (1, 40, 5120, torch.bfloat16, True, "chunk"), (3, 9, 64, torch.float32, False, "global"),
         (1, 2500, 5120, torch.bfloat16, False, "sample"), (2, 1500, 1536, torch.float32, True, "token"),
         (3, 301, 2048, torch.float16, False, "global")]


def modulation(B, S, D, layout):
    if layout == "chunk":  # scale / shift as views of Wan's [B, S, 6, D] modulation tensor
        base = torch.randn(B, S, 6, D, device="cuda", requires_grad=True)
        return base[:, :, 1], base[:, :, 0]
    shape = {"sample": (B, 1, D), "token": (B, S, D), "global": (D,)}[layout]
    return (torch.randn(shape, device="cuda", requires_grad=True),
            torch.randn(shape, device="cuda", requires_grad=True))


def every_variant():
    for variant in (0, 1, 2):
        load_op().set_variant(variant, variant)
        for B, S, D, dt, affine, layout in CASES:
            x = torch.randn(B, S, D, device="cuda", dtype=dt, requires_grad=True)
            sc, sh = modulation(B, S, D, layout)
            w = torch.randn(D, device="cuda", requires_grad=True) if affine else None
            b = torch.randn(D, device="cuda", requires_grad=True) if affine else None
            y = ln_modulate(x, sc, sh, weight=w, bias=b)
            y.backward(torch.randn_like(y))


def every_tile():
    op = load_op()
    op.set_variant(0, 0)
    for D, S in ((1536, 4000), (5120, 2500)):
        fi = [i for i, t in enumerate(op.fast_tiles(False)) if t[0] == D]
        bi = [i for i, t in enumerate(op.fast_tiles(True)) if t[0] == D]
        for k in range(max(len(fi), len(bi))):
            op.set_tile(fi[k] if k < len(fi) else -1, bi[k] if k < len(bi) else -1)
            x = torch.randn(2, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            sc, sh = modulation(2, S, D, "sample")
            ln_modulate(x, sc, sh).backward(torch.randn_like(x))
    op.set_tile(-1, -1)


if __name__ == "__main__":
    torch.manual_seed(0)
    every_variant()
    every_tile()
    torch.cuda.synchronize()
    print("small ok")
