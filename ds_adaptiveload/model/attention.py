"""The self-attention core's backends: torch SDPA (cuDNN on Hopper by default) or FlashAttention-4 (the optional
`flash-attn-4` package, CuTe DSL kernels), chosen by --attention sdpa | fa4 | auto.

On an H200 FA4 ran the model's self-attention 11-17% faster than SDPA's cuDNN backend, forward+backward, at equal
error against an fp32 reference (bench/model/attn_backends.py, docs/history/benchmarks.md). FA4 is called as two torch
custom ops (forward and backward) so that selective checkpointing's policies can keep its output like SDPA's
(model/wan._SAVED_ATTENTION_OPS) and torch.compile traces a block through it without a graph break.
"""
from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.config import ATTENTION_BACKENDS

_HALF = (torch.float16, torch.bfloat16)  # the dtypes FA4 takes
# auto takes FA4 on these compute capabilities only: where it was measured against cuDNN (Hopper, the H200)
AUTO_FA4_MAJORS = (9,)


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


def resolve_attention(name: str, device: Optional[torch.device] = None):
    """(backend name, attention core) for --attention `name`: sdpa; fa4 (a UserError where it cannot run); auto:
    fa4 on a GPU of compute capability 9.x with the package installed, else sdpa."""
    from ds_adaptiveload.model.wan import sdpa_attention

    if name not in ATTENTION_BACKENDS:
        raise UserError(f"--attention {name!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "sdpa":
        return "sdpa", sdpa_attention
    why = fa4_unavailable()
    if name == "fa4":
        if why:
            raise UserError(f"--attention fa4: FlashAttention-4 cannot run here: {why}")
        return "fa4", fa4_attention
    if why is None and torch.cuda.get_device_capability(device)[0] in AUTO_FA4_MAJORS:
        return "fa4", fa4_attention
    return "sdpa", sdpa_attention
