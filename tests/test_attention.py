"""model/attention.py: --attention's choice of kernels, and FlashAttention-4 as torch custom ops. On CPU the FA4
kernels are stood in for by a float64 reference (`fake_fa4`), which tests the ops' autograd, the SP padding and
that selective checkpointing keeps their output instead of running them again; tests/test_attention_cuda.py runs
the real kernels."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import attention, wan
from tests import fake_fa4 as fake_fa4_module


def test_resolve_sdpa_and_auto_without_a_gpu():
    assert attention.resolve_attention("sdpa") == ("sdpa", wan.sdpa_attention)
    if not torch.cuda.is_available():
        assert attention.resolve_attention("auto") == ("sdpa", wan.sdpa_attention)


def test_resolve_rejects_unknown_and_unrunnable(monkeypatch):
    with pytest.raises(UserError, match="--attention 'flash3'"):
        attention.resolve_attention("flash3")
    monkeypatch.setattr(attention, "fa4_unavailable", lambda: "no CUDA device")
    with pytest.raises(UserError, match="--attention fa4: FlashAttention-4 cannot run here: no CUDA device"):
        attention.resolve_attention("fa4")
    assert attention.resolve_attention("auto")[0] == "sdpa"


@pytest.mark.parametrize("fa4_ms, expected", [(90.0, "fa4"), (98.5, "sdpa"), (120.0, "sdpa")])
def test_auto_takes_the_kernels_that_measure_faster(monkeypatch, fa4_ms, expected):
    """auto times both where FA4 runs, once per process and head shape; FA4 only where >= 2% faster."""
    calls = []

    def probe(device, heads, head_dim):
        calls.append((heads, head_dim))
        return {"sdpa": 100.0, "fa4": fa4_ms}

    monkeypatch.setattr(attention, "fa4_unavailable", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"Test GPU {fa4_ms}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "_PROBED", {})
    for _ in range(2):
        name, fn = attention.resolve_attention("auto", torch.device("cpu"), 40, 128, probe=probe)
        assert name == expected
        assert fn is (attention.fa4_attention if expected == "fa4" else wan.sdpa_attention)
    assert calls == [(40, 128)]
    assert attention.probed(None, 40, 128) == {"sdpa": 100.0, "fa4": fa4_ms}
    assert attention.probed(None, 12, 128) is None


def test_auto_is_agreed_over_ranks():
    """The ranks' summed times choose for all; a rank where FA4 cannot run makes it sdpa everywhere."""
    ranks = [{"sdpa": 100.0, "fa4": 99.0}, {"sdpa": 100.0, "fa4": 90.0}]  # rank 0 alone would keep sdpa
    total = lambda v: [sum(x) for x in zip(*([1, 1e3 * t["sdpa"], 1e3 * t["fa4"]] for t in ranks))]  # noqa: E731
    name, fn, how = attention.agreed(ranks[0], 2, total)
    assert (name, fn) == ("fa4", attention.fa4_attention)
    assert "summed over 2 ranks: sdpa 200.0 ms, fa4 189.0 ms" in how
    assert attention.faster(ranks[0]) == "sdpa"
    name, fn, how = attention.agreed(ranks[0], 3, total)  # a third rank reported nothing: no FA4 there
    assert (name, fn) == ("sdpa", wan.sdpa_attention)
    assert "cannot run on 1 of 3 ranks" in how


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute.interface's two entry points in float64 math (tests/fake_fa4.py); counts their calls."""
    calls = {"fwd": 0, "bwd": 0}
    monkeypatch.setattr(attention, "_interface", lambda: fake_fa4_module.interface(calls))
    return calls


def _qkv(b=2, s=24, s_k=24, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=torch.float64, requires_grad=True)
            for n in (s, s_k, s_k)]


@pytest.fixture
def cuda_like(monkeypatch):
    """fa4_attention sending the test's float64 CPU tensors to the ops (it hands CPU and fp32 tensors to SDPA)."""
    monkeypatch.setattr(attention, "fa4_takes", lambda q: True)


def test_fa4_hands_fp32_and_cpu_tensors_to_sdpa(fake_fa4):
    q, k, v = _qkv()
    torch.testing.assert_close(attention.fa4_attention(q, k, v), wan.sdpa_attention(q, k, v))
    assert fake_fa4["fwd"] == 0


@pytest.mark.parametrize("valid_len", [None, 17])
def test_fa4_op_matches_sdpa_with_gradients(fake_fa4, cuda_like, valid_len):
    q, k, v = _qkv()
    dout = torch.randn(q.shape, dtype=torch.float64)
    got = attention.fa4_attention(q, k, v, valid_len=valid_len)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want = wan.sdpa_attention(q, k, v, valid_len=valid_len)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)
    if valid_len:  # the padded keys get no gradient
        assert grads[1][:, valid_len:].abs().max() == 0
    assert fake_fa4 == {"fwd": 1, "bwd": 1}


def test_selective_checkpointing_keeps_the_fa4_output(fake_fa4, cuda_like):
    """Under the attention policy (wan.save_attention_policy) the recompute in backward reuses the kernel's output
    and logsumexp: the forward kernel runs once, and the gradients equal running without checkpointing."""
    q, k, v = _qkv()
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def block(q, k, v):
        return attention.fa4_attention(F.gelu(q @ w), k, v).sin()

    out = checkpoint(block, q, k, v, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(wan.save_attention_policy))
    grads = torch.autograd.grad(out.sum(), (q, k, v, w))
    assert fake_fa4["fwd"] == 1
    want = torch.autograd.grad(block(q, k, v).sum(), (q, k, v, w))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b)


def test_fake_shapes_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(2, n, 4, 16, dtype=torch.bfloat16) for n in (40, 12, 12))
        out, lse = attention._fa4_forward(q, k, v)
        dq, dk, dv = attention._fa4_backward(out, q, k, v, out, lse)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.is_contiguous()


def test_flop_counter_counts_the_fa4_ops_as_sdpa(fake_fa4, cuda_like):
    """FlopCounterMode sees the custom ops, not FA4's kernels: their formulas give what it counts for torch's fused
    SDPA kernels on a GPU (torch.utils.flop_counter's SDPA formulas, the backward's recompute of the scores
    included), in FA4's [B, S, heads, head_dim] layout."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = _qkv(b=2, s=24, s_k=40, h=3, d=8)
    with FlopCounterMode(display=False) as counter:
        attention.fa4_attention(q, k, v).sum().backward()
    bhsd = [(2, 3, n, 8) for n in (24, 40, 40)]
    assert counter.get_total_flops() == sdpa_flop_count(*bhsd) + sdpa_backward_flop_count(bhsd[0], *bhsd) > 0


def test_a_cuda_error_in_an_fa4_run_points_at_the_sdpa_flag():
    """train_cli.fa4_hint: a CUDA or cuDNN RuntimeError in a run on FlashAttention-4 gets one line naming
    --attention sdpa (a flag the trainer has); other errors and SDPA runs get none."""
    from ds_adaptiveload import train_cli

    cudnn = RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true")
    hint = train_cli.fa4_hint("fa4", cudnn)
    assert hint and "--attention sdpa" in hint
    import argparse

    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    flag = next(a for a in parser._actions if "--attention" in a.option_strings)
    assert "sdpa" in (flag.choices or attention.ATTENTION_BACKENDS)  # the hint names a flag and value that exist
    assert train_cli.fa4_hint("fa4", RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert train_cli.fa4_hint("sdpa", cudnn) is None and train_cli.fa4_hint(None, cudnn) is None
    assert train_cli.fa4_hint("fa4", ValueError("CUDA")) is None  # not a kernel's error
    assert train_cli.fa4_hint("fa4", RuntimeError("shape mismatch")) is None

    class AcceleratorError(RuntimeError):  # as torch raises a CUDA fault
        pass

    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name: the OOM handling speaks for itself
        pass

    assert train_cli.fa4_hint("fa4", AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert train_cli.fa4_hint("fa4", OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
