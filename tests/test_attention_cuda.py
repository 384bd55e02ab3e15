"""FlashAttention-4 (model/attention.py) on the GPU: the kernels against a float64 reference beside SDPA's, the model
with --attention fa4 against SDPA on packed micro-batches (checkpointed under the attention policy too), and a
block compiled whole (fullgraph) through the custom ops. Skipped without a GPU or without the flash-attn-4 package;
on the device, bench/device/run.py --fa4 installs it (stage attn_test)."""
import copy

import pytest
import torch

from ds_adaptiveload.model import WanConfig, WanModel, attention, wan

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def needs_fa4():
    why = attention.fa4_unavailable()
    if why:
        pytest.skip(f"FlashAttention-4 cannot run: {why}")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _reference(q, k, v, valid_len):
    """float64 attention of bf16 inputs, and its gradients for dout."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    return wan.sdpa_attention(q, k, v, valid_len=valid_len), (q, k, v)


@pytest.mark.parametrize("b, s, s_k, h, d, valid_len", [
    (1, 4096, 4096, 12, 128, None), (3, 1560, 1560, 12, 128, None), (2, 1000, 1000, 4, 64, 937),
    (2, 777, 512, 12, 128, None)])
def test_fa4_kernels_against_float64(b, s, s_k, h, d, valid_len):
    """Output and gradients: FA4's error against float64 at most SDPA's (cuDNN) by 1.5x, on fresh inputs, and all
    finite (FA4 allocates its outputs, so an unwritten row would hold stale memory: the error bound catches it)."""
    g = torch.Generator(device="cuda").manual_seed(b * s + d)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, s_k, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ref, ref_in = _reference(q, k, v, valid_len)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    errs = {}
    for name, fn in (("fa4", attention.fa4_attention), ("sdpa", wan.sdpa_attention)):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins, valid_len=valid_len)
        grads = torch.autograd.grad(out, ins, dout)
        assert torch.isfinite(out).all() and all(torch.isfinite(gr).all() for gr in grads)
        errs[name] = [_rel(out, ref)] + [_rel(a, r) for a, r in zip(grads, ref_grads)]
    assert all(e_fa4 <= 1.5 * e_sdpa + 1e-3 for e_fa4, e_sdpa in zip(errs["fa4"], errs["sdpa"])), errs


def _model(checkpoint=False):
    cfg = WanConfig(dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=32, text_len=8, freq_dim=32)
    torch.manual_seed(0)
    m = WanModel(cfg, checkpoint_blocks=checkpoint, checkpoint_policy="attention")
    with torch.no_grad():
        m.head.head.weight.normal_(std=0.02)
    return m.cuda()


def _packed_grads(model, dtype):
    """Parameter gradients (fp32) of a packed micro-batch through `model` cast to dtype, as DeepSpeed's bf16 does."""
    g = torch.Generator(device="cuda").manual_seed(1)
    lats = [(3, 16, 24), (1, 30, 52), (3, 16, 24), (5, 8, 8)]  # three shapes, one repeated
    x = [torch.randn(16, *lat, device="cuda", generator=g, dtype=dtype) for lat in lats]
    ctx = [torch.randn(7, 32, device="cuda", generator=g, dtype=dtype) for _ in lats]
    t = torch.rand(len(lats), device="cuda", generator=g) * 1000
    model.to(dtype).zero_grad(set_to_none=True)
    ys = model(x, t, ctx)
    sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpoint", [False, True])
def test_model_with_fa4_matches_sdpa(checkpoint):
    """A packed micro-batch of three shapes in bf16: every parameter gradient with FA4 is as close to the fp32
    model's as with SDPA (at most 1.5x SDPA's error), with and without checkpointing under the attention policy;
    FA4 ran on bf16 tensors (fa4_attention hands other dtypes to SDPA)."""
    ref = _packed_grads(_model(checkpoint), torch.float32)
    seen, errs = [], {}

    def fa4(q, k, v, **kw):
        seen.append(q.dtype)
        return attention.fa4_attention(q, k, v, **kw)
    for name, fn in (("fa4", fa4), ("sdpa", wan.sdpa_attention)):
        m = _model(checkpoint)
        m.set_attention(fn)
        got = _packed_grads(m, torch.bfloat16)
        errs[name] = {n: _rel(got[n], r) for n, r in ref.items() if r.norm() > 0}
    assert seen and set(seen) == {torch.bfloat16}
    bad = {n: (e, errs["sdpa"][n]) for n, e in errs["fa4"].items() if not e <= 1.5 * errs["sdpa"][n] + 2e-3}
    assert not bad, bad


def test_compiled_block_traces_through_fa4():
    """compile_blocks (inductor, each WanBlock whole with fullgraph=True) with FA4 as the attention core: no graph
    break, and every gradient as the eager model's with FA4."""
    from ds_adaptiveload.model.compile import compile_blocks

    torch._dynamo.reset()
    eager = _model()
    eager.set_attention(attention.fa4_attention)
    comp = copy.deepcopy(eager)
    comp.set_attention(attention.fa4_attention)
    compile_blocks(comp, fullgraph=True)
    want, got = _packed_grads(eager, torch.bfloat16), _packed_grads(comp, torch.bfloat16)
    err = {n: _rel(got[n], r) for n, r in want.items() if r.norm() > 0}
    bad = {n: e for n, e in err.items() if not e < 2e-2}
    assert not bad, bad
