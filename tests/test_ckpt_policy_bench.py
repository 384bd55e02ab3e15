"""bench/model/ckpt_policy.py's sides (every block keeping its attention outputs, or its FFN output too) and
model/wan.shrinking_matmul, the rule save_attention_ffn_policy keeps matmul outputs by; CPU, tiny model."""
import os
import sys

import torch

from ds_adaptiveload.model.wan import shrinking_matmul
from tests.test_checkpoint_policy import CountOps, assert_same, run, tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "model"))
import ckpt_policy  # noqa: E402


def test_sides_match_and_keep_ffn_skips_one_matmul_per_block():
    model = tiny(True, "attention")
    counts, results = {}, {}
    for side in ("attention", "keep-ffn"):
        mode = CountOps()
        with ckpt_policy.policy_of(model, side):
            results[side] = run(model, True, mode)
        counts[side] = mode.addmm
        assert model.checkpoint_ffn_blocks == 0  # restored after each side
    assert_same(results["keep-ffn"], results["attention"])
    assert counts["attention"] - counts["keep-ffn"] == model.cfg.num_layers, counts


def test_shrinking_matmul_reads_the_weight_shape():
    a, wide, narrow = torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(8, 2)
    bias = torch.zeros(2)
    assert shrinking_matmul(torch.ops.aten.addmm.default, (bias, a, narrow))
    assert shrinking_matmul(torch.ops.aten.mm.default, (a, narrow))
    assert not shrinking_matmul(torch.ops.aten.mm.default, (a, wide))
    assert not shrinking_matmul(torch.ops.aten.add.Tensor, (a, a))


def test_open_sides_set_and_restore_the_model():
    model = tiny(2, "attention")
    with ckpt_policy.policy_of(model, "open-elementwise"):
        assert (model.checkpoint_blocks, model.open_recompute) == (False, "elementwise")
    with ckpt_policy.policy_of(model, "half-elementwise"):
        assert (model.checkpoint_blocks, model.open_recompute) == (len(model.blocks) // 2, "elementwise")
    with ckpt_policy.policy_of(model, "keep-ffn"):
        assert (model.checkpoint_blocks, model.checkpoint_ffn_blocks) == (True, len(model.blocks))
    assert (model.checkpoint_blocks, model.checkpoint_ffn_blocks, model.open_recompute) == (2, 0, "none")


def test_bytes_are_per_block_compared():
    assert [ckpt_policy.compared_blocks(b, 30) for b in ("keep-ffn", "open-elementwise", "half-elementwise")] == \
        [30, 30, 15]


def test_kernel_split_profiles_each_side_on_cpu():
    model = tiny(False, "attention")
    got = ckpt_policy.kernel_split(lambda _: run(model, True), None, model, ("open", "open-elementwise"),
                                   torch.device("cpu"))
    assert got["open"]["kernels"] > 0
    # the elementwise side runs more ops: its recompute
    assert got["open-elementwise"]["kernels"] > got["open"]["kernels"]
    assert got["largest_differences_ms"] and {"kernel", "kind", "b_minus_a_ms"} <= set(got["largest_differences_ms"][0])
    assert model.open_recompute == "none"
