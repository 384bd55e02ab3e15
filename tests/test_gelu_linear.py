"""model/gelu_linear.py (the FFN's GELU and second projection as one custom op, recomputing the GELU in backward):
the same values and gradients as nn.GELU then nn.Linear (gradcheck in float64, a whole model in fp32), the op's
registration (opcheck), one [T, ffn_dim] tensor fewer saved for backward per open block, and one [T, ffn_dim]
temporary alive at a time in its backward."""
import copy

import torch
from torch import nn

from ds_adaptiveload.model.gelu_linear import GeluLinear, gelu_linear
from tests.test_compile_blocks import check_against_eager, tiny
from tests.test_compile_regions import MORE


def test_gelu_linear_gradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(gelu_linear, (h, w, b))
    assert torch.autograd.gradcheck(lambda h, w: gelu_linear(h, w, None), (h, w))


def test_gelu_linear_op_registration():
    """torch.library.opcheck: the fake (meta) implementation, the autograd registration and the schema agree with
    the op as it runs, with and without a bias."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    w = torch.randn(5, 6, generator=g, requires_grad=True)
    for bias in (torch.randn(5, generator=g, requires_grad=True), None):
        torch.library.opcheck(gelu_linear, (h, w, bias))


def _plain_ffn(model):
    """The same model with every FFN as nn.Linear, nn.GELU, nn.Linear (the weights shared by copy)."""
    ref = copy.deepcopy(model)
    for blk in ref.blocks:
        fc2 = blk.ffn[2]
        plain = nn.Linear(fc2.in_features, fc2.out_features)
        plain.load_state_dict(fc2.state_dict())
        blk.ffn[1], blk.ffn[2] = nn.GELU(approximate="tanh"), plain
    return ref


def test_model_with_gelu_linear_matches_plain_gelu_then_linear():
    m = tiny()
    assert all(isinstance(b.ffn[2], GeluLinear) for b in m.blocks)
    ref = _plain_ffn(m)
    check_against_eager(ref, m, MORE, tol=1e-6)


def _saved_bytes(model, pack):
    """Bytes the autograd graph of one forward saves for backward (every saved tensor, counted once by storage)."""
    seen = {}

    def pack_hook(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        ys = model(*pack)
    del ys
    return sum(seen.values())


def test_an_open_block_saves_one_ffn_activation_less():
    m = tiny()
    ref = _plain_ffn(m)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 1, 8, 8, generator=g) for _ in range(3)]
    pack = (xs, torch.rand(3, generator=g) * 1000, [torch.randn(5, m.cfg.text_dim, generator=g) for _ in xs])
    tokens = 3 * 16  # 3 samples of 1 x 4 x 4 patches
    saved, saved_ref = _saved_bytes(m, pack), _saved_bytes(ref, pack)
    assert saved_ref - saved == len(m.blocks) * tokens * m.cfg.ffn_dim * 4  # fp32: one [T, ffn_dim] per block


def _peak_bytes(fn):
    """Peak of the CPU allocator's live bytes while fn runs, over what was live before: the profiler's raw memory
    events (every allocation and free in order; its per-op totals would credit a free to the op that encloses it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def test_backward_holds_one_ffn_sized_temporary_at_a_time():
    """The weight gradient first (gelu(h) freed before dh exists), then dh in place of dout @ weight: the backward's
    peak is the [T, ffn_dim] gradient it returns, where computing dh first held two such tensors at once (about
    18 KB per token at the 1.3B size in bf16, at the start of every block's backward)."""
    T, dim, ffn = 2048, 32, 512
    g = torch.Generator().manual_seed(0)
    lin = GeluLinear(ffn, dim)
    h = torch.randn(T, ffn, generator=g, requires_grad=True)
    dout = torch.randn(T, dim, generator=g)
    y = lin(h)
    unit = T * ffn * 4
    peak = _peak_bytes(lambda: y.backward(dout))
    assert unit <= peak < 1.5 * unit, peak / unit  # h.grad itself is one unit

    def computing_dh_first():  # the order before: dh = gelu_backward(dout @ weight, h), then dw from gelu(h)
        dh = torch.ops.aten.gelu_backward(dout @ lin.weight.detach(), h.detach(), approximate="tanh")
        dw = dout.t() @ torch.nn.functional.gelu(h.detach(), approximate="tanh")
        return dh, dw
    assert _peak_bytes(computing_dh_first) >= 2 * unit  # the tracker sees the difference it is meant to catch
    dh, dw = computing_dh_first()
    torch.testing.assert_close(h.grad, dh, rtol=0, atol=0)  # the same values, bit for bit
    torch.testing.assert_close(lin.weight.grad, dw, rtol=0, atol=0)


def test_flop_counter_counts_the_op_as_linear():
    """FlopCounterMode sees the op, not the matmul inside it: its formula gives nn.Linear's count, forward and
    backward (the GELU counts nothing either way)."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(2)
    lin = GeluLinear(12, 5)
    h = torch.randn(3, 7, 12, generator=g, requires_grad=True)

    def total(fn):
        with FlopCounterMode(display=False) as counter:
            fn(h).sum().backward()
        return counter.get_total_flops()

    plain = nn.Linear(12, 5)
    plain.load_state_dict(lin.state_dict())
    assert total(lin) == total(lambda x: plain(torch.nn.functional.gelu(x, approximate="tanh"))) == 3 * 2 * 21 * 12 * 5
