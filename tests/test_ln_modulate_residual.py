"""Gated residual + LayerNorm-Modulate: reference, custom op (CPU kernel, fake, autograd, compile) and CUDA op
against a float64 eager chain; CUDA outputs are poisoned (NaN-filled blocks) so an unwritten element fails."""
import pytest
import torch
import torch.nn.functional as F

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.ops import layernorm_modulate as lnm
from ds_adaptiveload.ops import ln_modulate_residual as R

# (max relative L2 error of the outputs, of the gradients) by x's dtype.
TOL = {torch.float64: (1e-6, 1e-6), torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 5e-3),
       torch.bfloat16: (1e-2, 2e-2)}
LAYOUTS = ["sample", "global", "token", "chunk6"]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(layout, B, S, D, dtype, mdtype, device):
    """(leaves, view): x, y, gate, scale, shift leaves (grad on) and view(leaves) as the op sees them: per-token
    modulation as chunks of a [B, S, 6, D] leaf in the chunk6 layout (the Wan 2.2 layout)."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    shape = {"sample": (B, 1, D), "global": (D,), "token": (B, S, D), "chunk6": (B, S, 6, D)}[layout]
    leaves = [(rnd(B, S, D) * 2 + 0.5).to(device, dtype), rnd(B, S, D).to(device, dtype)]
    leaves += [(rnd(*shape) * 0.5).to(device, mdtype) for _ in range(3)]
    leaves = [t.requires_grad_() for t in leaves]

    def view(ls):
        if layout == "chunk6":
            return ls[0], ls[1], ls[2][:, :, 0], ls[3][:, :, 1], ls[4][:, :, 2]
        return tuple(ls)

    return leaves, view


def chain64(x, y, gate, scale, shift, eps=1e-6):
    """The unfused chain in float64 (x_new not rounded)."""
    x_new = x.double() + gate.double() * y.double()
    return F.layer_norm(x_new, (x.shape[-1],), None, None, eps) * (1 + scale.double()) + shift.double(), x_new


def poison(device, nbytes):
    if device == "cuda":
        torch.empty(nbytes // 4 + 1, device=device).fill_(float("nan"))


def check(fn, layout, B, S, D, dtype, mdtype, device):
    """fn(x, y, gate, scale, shift) -> (out, x_new) against chain64: values, dtypes and all five gradients, with the
    residual stream's own gradient (d_x_new) flowing in beside d_out."""
    leaves, view = make(layout, B, S, D, dtype, mdtype, device)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out_ref, xn_ref = chain64(*view(ref_leaves))
    poison(device, out_ref.numel() * 4)
    out, x_new = fn(*view(leaves))
    assert out.dtype == x_new.dtype == dtype and out.shape == x_new.shape == leaves[0].shape
    for name, got, ref in (("out", out, out_ref), ("x_new", x_new, xn_ref)):
        assert torch.isfinite(got).all(), f"{name}: unwritten or non-finite"
        assert rel(got, ref) < TOL[dtype][0], f"{name}: rel err {rel(got, ref):.2e}"
    d_out, d_xnew = (torch.randn(out.shape, device=device).to(dtype) for _ in range(2))
    poison(device, out_ref.numel() * 4)
    grads = torch.autograd.grad((out, x_new), leaves, (d_out, d_xnew))
    refs = torch.autograd.grad((out_ref, xn_ref), ref_leaves, (d_out.double(), d_xnew.double()))
    for name, gk, gr, leaf in zip(["dx", "dy", "dgate", "dscale", "dshift"], grads, refs, leaves):
        assert gk.shape == leaf.shape and gk.dtype == leaf.dtype, name
        assert torch.isfinite(gk).all(), f"{name}: non-finite"
        tol = TOL[dtype][1] if leaf.dtype == torch.float32 or name in ("dx", "dy") else TOL[leaf.dtype][1]
        assert rel(gk, gr) < tol, f"{name}: rel err {rel(gk, gr):.2e} (layout {layout}, D {D}, {dtype})"


def op(x, y, gate, scale, shift):
    return tuple(R.resid_op(x, y, gate, scale, shift, 1e-6)[:2])


# ---------------------------------------------------------------- CPU

@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_custom_op_against_float64_chain(layout):
    """The custom op's CPU kernel and its closed-form backward against torch autograd of the eager chain."""
    check(op, layout, 2, 7, 40, torch.float64, torch.float64, "cpu")
    check(op, layout, 2, 7, 40, torch.float32, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_front_function_and_reference(dtype):
    check(R.ln_modulate_residual, "sample", 2, 9, 24, dtype, torch.float32, "cpu")
    x, y = torch.randn(2, 3, 8).to(dtype), torch.randn(2, 3, 8).to(dtype)
    gate, sc, sh = torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.randn(8)
    out, x_new = R.ln_modulate_residual_reference(x, y, gate, sc, sh)
    # x_new is rounded to x's dtype once, from fp32 math; out normalizes that rounded x_new.
    assert torch.equal(x_new, (x.float() + gate * y.float()).to(dtype))
    assert torch.equal(out, lnm.ln_modulate_reference(x_new, sc, sh))


def test_cpu_opcheck_fake_and_autograd():
    """torch.library.opcheck: schema, fake (meta) shapes, autograd registration and CPU dispatch."""
    x, y = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16, requires_grad=True)
    e = torch.randn(2, 5, 6, 16, requires_grad=True)
    s = [torch.randn(2, 1, 16, requires_grad=True) for _ in range(3)]
    for args in [(x, y, *s, 1e-6), (x, y, e[:, :, 0], e[:, :, 1], e[:, :, 2], 1e-5),
                 (x, y, torch.randn(16, requires_grad=True), s[1], s[2], 1e-6)]:
        torch.library.opcheck(R.resid_op, args)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fx, fy = torch.empty(3, 11, 64, dtype=torch.bfloat16), torch.empty(3, 11, 64, dtype=torch.bfloat16)
        out, x_new, mean, rstd = R.resid_op(fx, fy, torch.empty(3, 1, 64), torch.empty(3, 1, 64), torch.empty(64), 1e-6)
        assert out.shape == x_new.shape == (3, 11, 64) and out.dtype == x_new.dtype == torch.bfloat16
        assert mean.shape == rstd.shape == (33,) and mean.dtype == torch.float32


def test_cpu_compile_fullgraph():
    """torch.compile(fullgraph, dynamic) traces the custom op (fake + autograd) and the front function on CPU."""
    torch._dynamo.reset()
    leaves, _ = make("sample", 2, 6, 32, torch.float32, torch.float32, "cpu")

    def chain(fn):
        def f(x, y, g, sc, sh):
            out, x_new = fn(x, y, g, sc, sh)
            return (out * 2).sum() + (x_new ** 2).sum()
        return f

    for fn in (op, R.ln_modulate_residual):
        ref = torch.autograd.grad(chain(fn)(*leaves), leaves)
        loss = torch.compile(chain(fn), fullgraph=True, dynamic=True, backend="aot_eager")(*leaves)
        got = torch.autograd.grad(loss, leaves)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, ref))


def test_cpu_errors():
    x = torch.randn(2, 3, 8)
    with pytest.raises(UserError, match="gate"):
        R.ln_modulate_residual(x, x, torch.randn(7), torch.randn(8), torch.randn(8))
    with pytest.raises(UserError, match="y"):
        R.ln_modulate_residual(x, x[:, :2], torch.randn(8), torch.randn(8), torch.randn(8))


# ---------------------------------------------------------------- CUDA

@pytest.fixture
def cuda_op(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")  # never fall back silently in these tests
    if lnm.load_op() is None:
        pytest.fail(f"CUDA op did not load: {lnm.op_error()}")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("D", [64, 100, 1536, 5120, 16000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_float64(cuda_op, dtype, D, layout):
    """Every dtype and layout, widths on the vectorized (D % 8 == 0) and the general (100, 16000 / 8 ok) kernels."""
    check(R.ln_modulate_residual, layout, 2, 37, D, dtype, torch.float32, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["sample", "chunk6"])
def test_cuda_modulation_in_x_dtype(cuda_op, dtype, layout):
    check(R.ln_modulate_residual, layout, 2, 50, 1536, dtype, dtype, "cuda")


@pytest.mark.cuda
def test_cuda_odd_alignment_and_two_d(cuda_op):
    """A [S, D] input and an x that starts 2 bytes into its storage (the general kernels)."""
    check(R.ln_modulate_residual, "global", 1, 300, 1000, torch.bfloat16, torch.float32, "cuda")
    base = torch.randn(1 + 3 * 40 * 64, device="cuda").bfloat16()
    x, y = base[1:].view(3, 40, 64), torch.randn(3, 40, 64, device="cuda").bfloat16()
    s = [torch.randn(3, 1, 64, device="cuda") for _ in range(3)]
    out, x_new = R.ln_modulate_residual(x, y, *s)
    ref_out, ref_xn = chain64(x, y, *s)
    assert rel(out, ref_out) < 1e-2 and rel(x_new, ref_xn) < 1e-2


@pytest.mark.cuda
def test_cuda_deterministic_and_long(cuda_op):
    """The dgate / dscale reductions are bitwise reproducible; a Wan 14B-sized sample is covered."""
    leaves, view = make("sample", 1, 75600, 5120, torch.bfloat16, torch.float32, "cuda")
    out, x_new = R.ln_modulate_residual(*view(leaves))
    d = torch.randn_like(out)
    first = torch.autograd.grad((out, x_new), leaves, (d, d), retain_graph=True)
    again = torch.autograd.grad((out, x_new), leaves, (d, d))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    ref_out, ref_xn = chain64(*[t.detach() for t in view(leaves)])
    assert rel(out, ref_out) < 1e-2 and rel(x_new, ref_xn) < 1e-2
