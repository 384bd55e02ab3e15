"""WanModel.checkpoint_policy: "attention" (selective checkpointing: a checkpointed block keeps its attention
outputs and recomputes the rest) gives the same outputs and gradients as no checkpointing and as full
checkpointing, eagerly and with compiled blocks (aot_eager traces the checkpoint inside the block), on tensor
and packed micro-batches; and its backward really does not run the attention forward again, while "full" does."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.model.compile import compile_blocks
from ds_adaptiveload.model.gelu_linear import GELU_LINEAR_OP
from ds_adaptiveload.model.wan import _SAVED_ATTENTION_OPS


def tiny(checkpoint_blocks, policy="full"):
    cfg = WanConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=3, text_dim=32, text_len=8, freq_dim=32)
    torch.manual_seed(0)
    m = WanModel(cfg, checkpoint_blocks=checkpoint_blocks, checkpoint_policy=policy)
    with torch.no_grad():  # the zero-initialised head would make every other gradient zero
        m.head.head.weight.normal_(std=0.02)
    return m


def inputs(packed, seed=0):
    g = torch.Generator().manual_seed(seed)
    if packed:  # three shapes, one repeated: two groups of one and one of two
        lats = [(1, 4, 6), (3, 4, 4), (1, 4, 6), (2, 6, 8)]
        x = [torch.randn(16, *lat, generator=g) for lat in lats]
        ctx = [torch.randn(5, 32, generator=g) for _ in lats]
        return x, torch.rand(len(lats), generator=g) * 1000, ctx
    return torch.randn(2, 16, 2, 4, 6, generator=g), torch.rand(2, generator=g) * 1000, torch.randn(2, 5, 32, generator=g)


def run(model, packed, backward_mode=None):
    x, t, ctx = inputs(packed)
    model.zero_grad(set_to_none=True)
    y = model(x, t, ctx)
    ys = y if packed else [y]
    g = torch.Generator().manual_seed(1)
    loss = sum((yi * torch.randn(yi.shape, generator=g)).sum() for yi in ys)
    if backward_mode is None:
        loss.backward()
    else:
        with backward_mode:
            loss.backward()
    return [yi.detach() for yi in ys], {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    for ya, yb in zip(a[0], b[0]):
        torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    for n in a[1]:
        torch.testing.assert_close(a[1][n], b[1][n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


class CountOps(TorchDispatchMode):
    """Counts the attention kernels' forwards, aten.addmm (the forward's biased linears; the backward's own
    matmuls are bias-free mm), the FFN's gelu_linear op, aten.gelu outside it and every op."""

    def __init__(self):
        super().__init__()
        self.attention = self.addmm = self.gelu_linear = self.gelu = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.attention += func in _SAVED_ATTENTION_OPS
        self.addmm += func is torch.ops.aten.addmm.default
        self.gelu_linear += func is GELU_LINEAR_OP
        self.gelu += func is torch.ops.aten.gelu.default
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("blocks", [True, 2])
def test_attention_policy_matches_no_checkpointing_and_full(packed, blocks):
    ref = run(tiny(False), packed)
    assert_same(run(tiny(blocks, "attention"), packed), ref)
    assert_same(run(tiny(blocks, "full"), packed), ref)


def test_attention_policy_backward_does_not_rerun_attention():
    full, selective = CountOps(), CountOps()
    run(tiny(True, "full"), True, full)
    run(tiny(True, "attention"), True, selective)
    # full: every block's self- and cross-attention forward runs again (3 groups x 2 calls x 3 blocks)
    assert full.attention == 18, full.attention
    assert selective.attention == 0, selective.attention


def test_attention_policy_under_compiled_blocks():
    torch._dynamo.reset()
    ref = run(tiny(False), True)
    model = tiny(True, "attention")
    compile_blocks(model, fullgraph=True, backend="aot_eager")
    assert_same(run(model, True), ref)
    assert_same(run(model, False), run(tiny(False), False))


def test_unknown_policy_is_a_user_error():
    with pytest.raises(UserError, match="checkpoint_policy 'some'"):
        tiny(True, "some")
    model = tiny(True)
    with pytest.raises(UserError, match="checkpoint_policy 'some'"):
        model.set_checkpointing(1, policy="some")
    assert model.checkpoint_policy == "full"


def test_set_checkpointing_is_the_one_door():
    """set_checkpointing sets the counts (k_full defaults to k) and, when given, the policy; None keeps the policy."""
    model = tiny(False)
    assert (model.checkpoint_blocks, model.checkpoint_full_blocks, model.checkpoint_ffn_blocks,
            model.checkpoint_policy) == (False, 0, 0, "full")
    model.set_checkpointing(2, 0, 1, policy="attention")
    assert (model.checkpoint_blocks, model.checkpoint_full_blocks, model.checkpoint_ffn_blocks,
            model.checkpoint_policy) == (2, 0, 1, "attention")
    model.set_checkpointing(1)
    assert (model.checkpoint_blocks, model.checkpoint_full_blocks, model.checkpoint_ffn_blocks,
            model.checkpoint_policy) == (1, 1, 0, "attention")


@pytest.mark.parametrize("packed", [False, True])
def test_ffn_blocks_keep_their_ffn_output(packed):
    """checkpoint_ffn_blocks: the last n checkpointed blocks also keep the FFN's output (save_attention_ffn_policy):
    the same outputs and gradients, and one gelu_linear op (the FFN's GELU and second matmul) fewer recomputed per
    such block."""
    ref = run(tiny(False), packed)
    counts = {}
    for n in (0, 1, 2):
        model = tiny(True, "attention")
        model.checkpoint_full_blocks, model.checkpoint_ffn_blocks = 1, n  # block 0 whole: n <= 2 of blocks 1-2
        mode = CountOps()
        assert_same(run(model, packed, mode), ref)
        counts[n] = (mode.addmm, mode.gelu_linear)
    assert counts[0][1] - counts[1][1] == 1 and counts[1][1] - counts[2][1] == 1, counts
    assert counts[0][0] == counts[1][0] == counts[2][0], counts  # the other matmuls recomputed as before
    full = tiny(True, "full")
    full.checkpoint_ffn_blocks = 3  # ignored outside the attention policy
    mode = CountOps()
    run(full, packed, mode)
    assert (mode.addmm, mode.gelu_linear) == counts[0], (mode.addmm, counts)  # every block's, as with none kept


def test_ffn_output_is_kept_under_compiled_blocks():
    torch._dynamo.reset()
    ref = run(tiny(False), True)
    model = tiny(True, "attention")
    model.checkpoint_ffn_blocks = 3
    compile_blocks(model, fullgraph=True, backend="aot_eager")
    assert_same(run(model, True), ref)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("blocks", [False, 1])
def test_open_blocks_recompute_only_their_elementwise_steps(packed, blocks):
    """open_recompute "elementwise" (save_matmuls_policy): the open blocks give the same outputs and gradients, and
    their backward runs no matmul or attention forward again, but does run more ops (the elementwise steps')."""
    ref = run(tiny(False), packed)
    counts = {}
    for how in ("none", "elementwise"):
        model = tiny(blocks, "attention")
        model.open_recompute = how
        mode = CountOps()
        assert_same(run(model, packed, mode), ref)
        counts[how] = mode
    assert counts["elementwise"].attention == counts["none"].attention == 0
    assert counts["elementwise"].addmm == counts["none"].addmm  # block 0 under "attention" when blocks = 1
    assert counts["elementwise"].ops > counts["none"].ops, (counts["elementwise"].ops, counts["none"].ops)


def test_open_blocks_recompute_elementwise_under_compiled_blocks():
    torch._dynamo.reset()
    ref = run(tiny(False), True)
    model = tiny(False)
    model.open_recompute = "elementwise"
    compile_blocks(model, fullgraph=True, backend="aot_eager")
    assert_same(run(model, True), ref)


def test_unknown_open_recompute_is_a_user_error():
    model = tiny(False)
    model.open_recompute = "matmuls"
    with pytest.raises(UserError, match="open_recompute 'matmuls'"):
        run(model, False)
