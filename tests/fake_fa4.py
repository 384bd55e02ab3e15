"""A float64 stand-in for FlashAttention-4's two entry points (flash_attn.cute.interface), for CPU tests of the
custom ops in model/attention.py: tests/test_attention.py and the Ulysses worker in tests/test_packed.py."""
import types

import torch


def _scores(q, k):  # [B, H, S, S_k]
    return torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / q.shape[-1] ** 0.5


def interface(calls: dict):
    """An object with _flash_attn_fwd and _flash_attn_bwd in float64 math; counts their calls in calls["fwd"] and
    calls["bwd"]."""

    def fwd(q, k, v, return_lse=False):
        calls["fwd"] += 1
        s = _scores(q, k)
        out = torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.double()).to(q.dtype)
        return out.contiguous(), s.logsumexp(-1).float(), None, None, None

    def bwd(q, k, v, out, dout, lse):  # softmax attention's gradients written out (no autograd inside an op)
        calls["bwd"] += 1
        p = _scores(q, k).softmax(-1)
        do, v64 = dout.double(), v.double()
        dv = torch.einsum("bhst,bshd->bthd", p, do)
        dp = torch.einsum("bshd,bthd->bhst", do, v64)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / q.shape[-1] ** 0.5
        dq = torch.einsum("bhst,bthd->bshd", ds, k.double())
        dk = torch.einsum("bhst,bshd->bthd", ds, q.double())
        return tuple(g.to(q.dtype) for g in (dq, dk, dv))

    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


def install(attention, calls: dict, takes_all: bool = False) -> None:
    """Put the stand-in behind model/attention.py's ops; takes_all: fa4_attention sends every tensor to the ops
    (CPU and fp32 included) instead of handing those to SDPA."""
    attention._interface = lambda: interface(calls)
    if takes_all:
        attention.fa4_takes = lambda q: True
