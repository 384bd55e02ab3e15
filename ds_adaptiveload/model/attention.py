"""The self-attention core's backends: torch SDPA (cuDNN on Hopper by default) or FlashAttention-4 (the optional
`flash-attn-4` package, CuTe DSL kernels), chosen by --attention sdpa | fa4 | auto (the faster of the two when
timed on this GPU).

On an H200 FA4 ran the model's self-attention 11-17% faster than SDPA's cuDNN backend, forward+backward, at equal
error against an fp32 reference (bench/model/attn_backends.py, docs/history/benchmarks.md). FA4 is called as two torch
custom ops (forward and backward) so that selective checkpointing's policies can keep its output like SDPA's
(model/wan._SAVED_ATTENTION_OPS) and torch.compile traces a block through it without a graph break.
"""
import math
import time
from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.config import ATTENTION_BACKENDS

_HALF = (torch.float16, torch.bfloat16)  # the dtypes FA4 takes
# auto times both kernels, forward+backward, at one 480p 81-frame clip's sequence (most of a video mix's attention
# FLOPs are in sequences this long or longer), and takes FA4 only where it is at least AUTO_MARGIN faster: in a near
# tie the default kernels stay, and ranks whose timings differ by noise still agree (the trainer sums their times).
PROBE_TOKENS = 32760
AUTO_MARGIN = 0.02
_PROBED = {}  # (device name, heads, head_dim) -> {"sdpa": ms, "fa4": ms}, measured once per process


def _interface():
    """flash_attn.cute.interface, imported when first needed (the package is optional)."""
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("ds_adaptiveload::fa4_attention", mutates_args=())
def _fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention, q [B, S, H, D], k and v [B, S_k, H, D] -> (out [B, S, H, D], lse [B, H, S] fp32)."""
    out, lse = _interface()._flash_attn_fwd(q, k, v, return_lse=True)[:2]
    return out, lse


@_fa4_forward.register_fake
def _(q, k, v):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("ds_adaptiveload::fa4_attention_backward", mutates_args=())
def _fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, dout.contiguous(), lse)[:3]
    return dq, dk, dv


@_fa4_backward.register_fake
def _(dout, q, k, v, out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # FA4 writes contiguous gradients


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    return _fa4_backward(dout, q, k, v, out, lse)


_fa4_forward.register_autograd(_backward, setup_context=_setup_context)
FA4_FORWARD_OP = torch.ops.ds_adaptiveload.fa4_attention.default


def _bhsd(shape):
    """[B, S, H, D] -> [B, H, S, D], the layout torch.utils.flop_counter's SDPA formulas take."""
    return shape[0], shape[2], shape[1], shape[3]


# FlopCounterMode sees the two ops, not FA4's kernels: count them as it counts SDPA
@register_flop_formula(torch.ops.ds_adaptiveload.fa4_attention)
def _fa4_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


@register_flop_formula(torch.ops.ds_adaptiveload.fa4_attention_backward)
def _fa4_backward_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(_bhsd(dout_shape), _bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


def drop_padding(k: torch.Tensor, v: torch.Tensor, valid_len: Optional[int]):
    """k and v [B, S_k, heads, head_dim] without the keys at positions >= valid_len: sequence-parallel padding, always
    at the end, so slicing is exact (a mask would take the kernels off their fast paths)."""
    if valid_len is not None and valid_len < k.shape[1]:
        return k[:, :valid_len], v[:, :valid_len]
    return k, v


def fa4_takes(q: torch.Tensor) -> bool:
    """Whether FA4's kernels take q (and its k, v): fp16 and bf16 CUDA tensors only."""
    return q.is_cuda and q.dtype in _HALF


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_len: Optional[int] = None):
    """sdpa_attention's contract through FlashAttention-4: [B, S, heads, head_dim] in and out; keys and values at
    positions >= valid_len (sequence-parallel padding at the end) dropped. Tensors FA4 does not take (fa4_takes: an
    fp32 model, a model on the CPU) go to sdpa_attention."""
    if not fa4_takes(q):
        from ds_adaptiveload.model.wan import sdpa_attention

        return sdpa_attention(q, k, v, valid_len=valid_len)
    return _fa4_forward(q, *drop_padding(k, v, valid_len))[0]


def fa4_unavailable() -> Optional[str]:
    """Why FA4 cannot run here (None: it can): no CUDA device, or the flash-attn-4 package missing or broken."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        _interface()
    except Exception as e:  # ImportError, or the CuTe DSL failing to load its libraries
        return f"flash_attn.cute does not import ({type(e).__name__}: {e}); pip install flash-attn-4"
    return None


def time_backends(device, heads: int, head_dim: int, tokens: int = PROBE_TOKENS, reps: int = 3) -> dict:
    """{"sdpa": ms, "fa4": ms}: one forward+backward of self-attention over [1, tokens, heads, head_dim] bf16 on
    `device`, the best of `reps` after a warm-up call (FA4's first call compiles its kernels)."""
    from ds_adaptiveload.model.wan import sdpa_attention

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    times = {}
    for name, fn in (("sdpa", sdpa_attention), ("fa4", fa4_attention)):
        best = math.inf
        for i in range(reps + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn(q, k, v).backward(dout)
            torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - t0) * 1e3) if i else best
        times[name] = round(best, 3)
    return times


def faster(times: dict) -> str:
    """The backend auto takes from measured {"sdpa": ms, "fa4": ms}: fa4 where it is at least AUTO_MARGIN faster."""
    return "fa4" if times["fa4"] < (1 - AUTO_MARGIN) * times["sdpa"] else "sdpa"


def _probe_key(device, heads: int, head_dim: int) -> tuple:
    """_PROBED's key: the GPU's name and the head shape ("cpu" where there is no GPU: nothing is probed there)."""
    return (torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"), heads, head_dim


def probed(device=None, heads: int = 12, head_dim: int = 128) -> Optional[dict]:
    """The times auto measured in this process for this device and head shape (None: it measured none)."""
    return _PROBED.get(_probe_key(device, heads, head_dim))


def resolve_attention(name: str, device: Optional[torch.device] = None, heads: int = 12, head_dim: int = 128,
                      probe=time_backends):
    """(backend name, attention core) for --attention `name`: sdpa; fa4 (a UserError where it cannot run); auto:
    where FA4 can run, whichever of the two measures faster (`probe`, once per process, at the model's `heads` and
    `head_dim`: probed() returns the times), else sdpa."""
    if name not in ATTENTION_BACKENDS:
        raise UserError(f"--attention {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "sdpa":
        return pick("sdpa")
    why = fa4_unavailable()
    if name == "fa4":
        if why:
            raise UserError(f"--attention fa4: FlashAttention-4 cannot run here: {why}")
        return pick("fa4")
    if why is not None:
        return pick("sdpa")
    key = _probe_key(device, heads, head_dim)
    if key not in _PROBED:
        _PROBED[key] = probe(device if device is not None else torch.device("cuda"), heads, head_dim)
    return pick(faster(_PROBED[key]))


def pick(name: str):
    """(name, core) of a backend that can run here: sdpa or fa4."""
    from ds_adaptiveload.model.wan import sdpa_attention

    return (name, fa4_attention) if name == "fa4" else (name, sdpa_attention)


def agreed(times: Optional[dict], world: int, sum_over_ranks):
    """(name, core, what it was chosen from) for every rank of an --attention auto run: `times`, this rank's
    probed() times (None where FA4 cannot run), summed over the ranks by `sum_over_ranks` (a collective every rank
    calls); sdpa for all where FA4 cannot run on some rank."""
    n, sdpa_us, fa4_us = sum_over_ranks([1, 1e3 * times["sdpa"], 1e3 * times["fa4"]] if times else [0, 0, 0])
    if n < world:
        return (*pick("sdpa"), f"; FlashAttention-4 cannot run on {world - n} of {world} ranks")
    how = (f"; forward+backward at {PROBE_TOKENS:,} tokens, summed over {world} ranks: sdpa {sdpa_us / 1e3:.1f} ms, "
           f"fa4 {fa4_us / 1e3:.1f} ms")
    return (*pick(faster({"sdpa": sdpa_us, "fa4": fa4_us})), how)
