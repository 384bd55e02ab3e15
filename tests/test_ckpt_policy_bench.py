"""bench/model/ckpt_policy.py's variant policy (a checkpointed block keeps its shrinking matmuls' outputs besides its
attention outputs): the same outputs and gradients as the shipped "attention" policy, and its backward really runs
one bias matmul fewer per block (the FFN's second projection), on CPU with the tiny model."""
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_checkpoint_policy import assert_same, run, tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "model"))
import ckpt_policy  # noqa: E402


class CountAddmm(TorchDispatchMode):
    """Counts aten.addmm: the forward's biased linears (the backward's own matmuls are bias-free mm)."""

    def __init__(self):
        super().__init__()
        self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.addmm += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packed", [False, True])
def test_keep_shrinking_matches_attention_and_skips_one_matmul_per_block(packed):
    counts = {}
    results = {}
    for side in ("attention", "keep-shrinking"):
        mode = CountAddmm()
        with ckpt_policy.policy_of(side):
            results[side] = run(tiny(True, "attention"), packed, mode)
        counts[side] = mode.addmm
    assert_same(results["keep-shrinking"], results["attention"])
    blocks = tiny(True).cfg.num_layers
    assert counts["attention"] - counts["keep-shrinking"] == blocks, counts
    assert counts["keep-shrinking"] > 0  # the rest of each block is still recomputed


def test_policy_of_restores_the_shipped_policy():
    from ds_adaptiveload.model import wan

    shipped = wan.save_attention_context
    with pytest.raises(RuntimeError):
        with ckpt_policy.policy_of("keep-shrinking"):
            assert wan.save_attention_context is ckpt_policy.keep_shrinking_context
            raise RuntimeError("inside")
    assert wan.save_attention_context is shipped


def test_shrinking_matmul_reads_the_weight_shape():
    a, wide, narrow = torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(8, 2)
    bias = torch.zeros(2)
    assert ckpt_policy.shrinking_matmul(torch.ops.aten.addmm.default, (bias, a, narrow))
    assert ckpt_policy.shrinking_matmul(torch.ops.aten.mm.default, (a, narrow))
    assert not ckpt_policy.shrinking_matmul(torch.ops.aten.mm.default, (a, wide))
    assert not ckpt_policy.shrinking_matmul(torch.ops.aten.add.Tensor, (a, a))
