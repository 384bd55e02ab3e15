"""The FFN's GELU (tanh) and second projection as one torch custom op, `ds_adaptiveload::gelu_linear`.

One op, for two reasons:
- memory: its backward recomputes gelu(h) from h, so an open block keeps one [T, ffn_dim] tensor for the FFN
  where GELU then Linear keep two (h for GELU's gradient, gelu(h) for the weight's): 18 KB per token at the 1.3B
  model's widths in bf16;
- recompute: selective checkpointing sees the op whole. A policy that keeps the FFN's output
  (model/wan.save_attention_ffn_policy, save_matmuls_policy) then skips the op in the replay. As an
  autograd.Function the replay still ran its GELU, whose only use there was the matmul the policy had kept: one
  [T, ffn_dim] elementwise pass wasted per such block (11.2 ms of a 480p 81f micro-batch on the H200 with every
  block under save_matmuls_policy; docs/history/benchmarks.md, twenty-third session).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("ds_adaptiveload::gelu_linear", mutates_args=())
def gelu_linear(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """linear(gelu_tanh(h), weight, bias): h [..., in], weight [out, in], bias [out] or None -> [..., out]."""
    return F.linear(F.gelu(h, approximate="tanh"), weight, bias)


@gelu_linear.register_fake
def _(h, weight, bias):
    return h.new_empty((*h.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    h, weight, bias = inputs
    ctx.save_for_backward(h, weight)  # not gelu(h): the backward recomputes it
    ctx.has_bias = bias is not None


def _backward(ctx, dout):
    # The weight gradient first, so gelu(h) is freed before dh exists, and dh written over dout @ weight: one
    # [T, ffn_dim] temporary alive at a time, where dh first held two (tests/test_gelu_linear.py).
    h, weight = ctx.saved_tensors
    dh = dw = db = None
    if ctx.needs_input_grad[1]:
        dw = dout.flatten(0, -2).t() @ F.gelu(h, approximate="tanh").flatten(0, -2)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dout.flatten(0, -2).sum(0)
    if ctx.needs_input_grad[0]:
        dh = dout @ weight
        torch.ops.aten.gelu_backward.grad_input(dh, h, approximate="tanh", grad_input=dh)
    return dh, dw, db


gelu_linear.register_autograd(_backward, setup_context=_setup_context)
GELU_LINEAR_OP = torch.ops.ds_adaptiveload.gelu_linear.default


@register_flop_formula(torch.ops.ds_adaptiveload.gelu_linear)
def _flops(h_shape, weight_shape, bias_shape, *args, out_shape=None, **kwargs) -> int:
    """The matmul's, as torch.utils.flop_counter counts nn.Linear's (not the GELU): FlopCounterMode sees the op, not
    the matmul inside it. Its backward runs plain matmuls, which the counter sees."""
    return 2 * math.prod(h_shape[:-1]) * weight_shape[0] * weight_shape[1]


class GeluLinear(nn.Linear):
    """nn.Linear's parameters, applied to gelu(input) through the gelu_linear op. A module call of its own, so
    ZeRO-3 gathers its weight as it does a Linear's."""

    def forward(self, h):
        return gelu_linear(h, self.weight, self.bias)
