"""bench/model/ckpt_policy.py's sides (every block keeping its attention outputs, or its FFN output too), and what
the replay of a block that keeps its FFN output runs; CPU, tiny model."""
import os
import sys

import torch

from tests.test_checkpoint_policy import CountOps, assert_same, run, tiny

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "model"))
import ckpt_policy  # noqa: E402


def test_sides_match_and_keep_ffn_skips_the_ffn_op_per_block():
    """In backward, the attention side's replay runs every block's gelu_linear op again; keep-ffn's runs none, and
    no GELU either: the one aten.gelu per block is the op's backward recomputing gelu(h). As an autograd.Function
    the replay ran the GELU too, only to feed the matmul the policy had kept (two per block)."""
    model = tiny(True, "attention")
    counts, results = {}, {}
    for side in ("attention", "keep-ffn"):
        mode = CountOps()
        with ckpt_policy.policy_of(model, side):
            results[side] = run(model, True, mode)
        counts[side] = mode
        assert model.checkpoint_ffn_blocks == 0  # restored after each side
    assert_same(results["keep-ffn"], results["attention"])
    L = model.cfg.num_layers
    assert (counts["attention"].gelu_linear, counts["attention"].gelu) == (L, L)
    assert (counts["keep-ffn"].gelu_linear, counts["keep-ffn"].gelu) == (0, L)


def test_matmuls_policy_replay_runs_no_matmul_and_no_ffn_op():
    """save_matmuls_policy (open blocks, elementwise recompute): the replay runs the elementwise steps only."""
    model = tiny(False, "attention")
    model.open_recompute = "elementwise"
    mode = CountOps()
    run(model, True, mode)
    assert (mode.addmm, mode.gelu_linear, mode.attention) == (0, 0, 0)
    assert mode.gelu == model.cfg.num_layers


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


def test_function_sides_run_the_old_ffn_and_restore_the_op():
    """keep-ffn-function: the same values as keep-ffn through the autograd.Function the op replaced, whose replay runs
    the GELU again (one more aten.gelu per block) but not the kept matmul (as many addmm as keep-ffn: the side keeps
    the FFN output, as the old policy did); the op and the policy are back afterwards."""
    from ds_adaptiveload.model import wan
    from ds_adaptiveload.model.gelu_linear import GeluLinear

    model = tiny(True, "attention")
    forward, policy = GeluLinear.forward, wan.save_attention_ffn_policy
    counts, results = {}, {}
    for side in ("keep-ffn", "keep-ffn-function"):
        mode = CountOps()
        with ckpt_policy.policy_of(model, side):
            results[side] = run(model, True, mode)
        counts[side] = (mode.gelu, mode.addmm)
    assert GeluLinear.forward is forward and wan.save_attention_ffn_policy is policy
    assert_same(results["keep-ffn-function"], results["keep-ffn"])
    assert counts["keep-ffn-function"][0] - counts["keep-ffn"][0] == model.cfg.num_layers, counts
    assert counts["keep-ffn-function"][1] == counts["keep-ffn"][1], counts
