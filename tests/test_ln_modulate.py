"""Fused LayerNorm-Modulate: PyTorch path (CPU) and CUDA op against a float64 reference.

Every check draws fresh random inputs; CUDA outputs are poisoned (the caching allocator hands back blocks
we filled with NaN) so an unwritten element fails the test."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.ops import FusedLayerNormModulate, ln_modulate
from ds_adaptiveload.ops import layernorm_modulate as lnm_mod

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernel"))
import ln_tuning as _tuning  # noqa: E402  (the benchmarks' kernel choices, not in the package)

# (max relative L2 error of the output, of the gradients) by the output / input dtype.
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1e-2, 2e-2)}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(layout, B, S, D, dtype, mdtype, device, affine=False, two_d=False):
    """(leaves, view): leaf tensors that require grad, and view(leaves) -> (x, scale, shift, w, b) as the op
    sees them (e.g. scale as a chunk of a [B, S, 6, D] leaf). The float64 reference applies the same view."""
    g = torch.Generator(device="cpu").manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    leaves = [(rnd(B, S, D) * 2 + 0.5).to(device, dtype)]
    views = []
    sc_kind, sh_kind = {"mixed": ("sample", "token"), "mixed2": ("chunk6", "global")}.get(layout, (layout, layout))
    for k, kind in enumerate((sc_kind, sh_kind)):
        if kind == "chunk6":  # Wan 2.2: chunks of a [B, S, 6, D] tensor (row stride 6*D, no copy)
            leaves.append((rnd(B, S, 6, D) * 0.5).to(device, mdtype))
            views.append(lambda t, k=k: t[:, :, 2 + k])
        elif kind == "wan21":  # Wan 2.1 blocks: [B, 1, D] chunks of a [B, 6, D] tensor (sample stride 6*D)
            leaves.append((rnd(B, 6, D) * 0.5).to(device, mdtype))
            views.append(lambda t, k=k: t[:, 2 + k:3 + k])
        else:
            leaves.append((rnd(*{"global": (D,), "sample": (B, 1, D), "token": (B, S, D)}[kind]) * 0.5).to(device, mdtype))
            views.append(lambda t: t)
    if affine:
        leaves += [(1 + 0.3 * rnd(D)).to(device), (0.3 * rnd(D)).to(device)]
    leaves = [t.requires_grad_() for t in leaves]

    def view(ls):
        x, sc, sh = ls[0], views[0](ls[1]), views[1](ls[2])
        if two_d:  # [S, D] input with [D] or [S, D] modulation
            x = x[0]
            sc, sh = (t[0] if t.dim() == 3 and t.shape[1] == S else t.reshape(-1, D)[0] for t in (sc, sh))
        return (x, sc, sh) + ((ls[3], ls[4]) if affine else (None, None))

    return leaves, view


def ref64(x, sc, sh, w, b, eps=1e-6):
    y = F.layer_norm(x.double(), (x.shape[-1],), None, None, eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y * (1 + sc.double()) + sh.double()


def poison(device, nbytes):
    """Fill a freed block with NaN so the op's next allocations of that size start as NaN."""
    if device == "cuda":
        torch.empty(nbytes // 4 + 1, device=device).fill_(float("nan"))


def check(layout, B, S, D, dtype, mdtype, device, affine=False, out_dtype=None, two_d=False):
    leaves, view = make(layout, B, S, D, dtype, mdtype, device, affine, two_d)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = ref64(*view(ref_leaves))
    x, sc, sh, w, b = view(leaves)
    poison(device, y_ref.numel() * 4)
    y = ln_modulate(x, sc, sh, weight=w, bias=b, out_dtype=out_dtype)
    out_dtype = out_dtype or dtype
    assert y.dtype == out_dtype and y.shape == x.shape
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    assert rel(y, y_ref) < TOL[out_dtype][0], f"forward rel err {rel(y, y_ref):.2e}"

    dy = torch.randn(y.shape, device=device).to(out_dtype)
    poison(device, y_ref.numel() * 4)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.double())
    for name, gk, gr, leaf in zip(["dx", "dscale", "dshift", "dweight", "dbias"], grads, ref_grads, leaves):
        assert gk.shape == leaf.shape and gk.dtype == leaf.dtype, name
        assert torch.isfinite(gk).all(), f"{name}: non-finite"
        # Gradients w.r.t. bf16/fp16 leaves are rounded to that dtype; fp32 leaves get the op's accuracy,
        # which is bounded by the rounding of x and dy themselves.
        tol = TOL[dtype][1] if leaf.dtype == torch.float32 or name == "dx" else TOL[leaf.dtype][1]
        assert rel(gk, gr) < tol, f"{name}: rel err {rel(gk, gr):.2e} (layout {layout}, D {D}, {dtype})"


LAYOUTS = ["global", "sample", "token", "chunk6", "wan21", "mixed", "mixed2"]


# ---------------------------------------------------------------- CPU: the PyTorch path

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layouts(layout, dtype):
    check(layout, 2, 7, 40, dtype, torch.float32, "cpu")


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_cpu_affine_and_out_dtype(out_dtype):
    check("sample", 3, 5, 24, torch.bfloat16, torch.float32, "cpu", affine=True, out_dtype=out_dtype)


def test_cpu_two_d_and_modulation_in_x_dtype():
    check("global", 1, 9, 16, torch.float16, torch.float16, "cpu", two_d=True)
    check("token", 1, 9, 16, torch.float32, torch.float32, "cpu", two_d=True)


def test_cpu_module_and_errors():
    m = FusedLayerNormModulate(8, elementwise_affine=True)
    assert "elementwise_affine=True" in repr(m)
    x = torch.randn(2, 3, 8)
    y = m(x, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    assert torch.allclose(y, F.layer_norm(x, (8,), eps=1e-6), atol=1e-5)
    with pytest.raises(UserError, match="last dim"):
        ln_modulate(x, torch.zeros(7), torch.zeros(8))


def test_cpu_wan_rounding_differs_and_is_reproducible():
    """Wan rounds LN's output to x's dtype before the fp32 modulation; we do not (docs/kernel.md)."""
    x = torch.randn(1, 64, 256).bfloat16()
    sc, sh = torch.randn(1, 1, 256) * 0.5, torch.randn(1, 1, 256) * 0.5
    wan = (F.layer_norm(x.float(), (256,), eps=1e-6).to(x.dtype).float() * (1 + sc) + sh).to(x.dtype)
    ours = ln_modulate(x, sc, sh)
    assert not torch.equal(ours, wan)
    ref = ref64(x, sc, sh, None, None)
    assert rel(ours, ref) <= rel(wan, ref)
    # Reproducing Wan's rounding: LN in fp32 -> x.dtype, then modulate in fp32 (two ops, as in docs).
    ln = ln_modulate(x, torch.zeros(256), torch.zeros(256))
    assert torch.equal((ln.float() * (1 + sc) + sh).to(x.dtype), wan)


def test_backend_env(monkeypatch):
    monkeypatch.setenv("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")
    with pytest.raises(RuntimeError, match="CPU tensors"):
        ln_modulate(torch.randn(2, 8), torch.zeros(8), torch.zeros(8))
    monkeypatch.setenv("DS_ADAPTIVELOAD_LN_MODULATE", "bogus")
    with pytest.raises(UserError):
        ln_modulate(torch.randn(2, 8), torch.zeros(8), torch.zeros(8))


# ---------------------------------------------------------------- the custom op and torch.compile

def small_block(dim=64, heads=4, S=24, B=2, device="cpu", dtype=torch.float32):
    """A WanBlock of Wan's structure at a toy width, and its inputs (x [B*S, dim] packed rows, e0, context, the
    Layout of B samples of one shape)."""
    from ds_adaptiveload.model.config import WanConfig
    from ds_adaptiveload.model.packing import plan_packing
    from ds_adaptiveload.model.layout import Layout
    from ds_adaptiveload.model.wan import WanBlock, rope_tables, sdpa_attention

    cfg = WanConfig(dim=dim, ffn_dim=2 * dim, num_heads=heads, num_layers=1, text_len=8)
    torch.manual_seed(0)
    block = WanBlock(cfg).to(device, dtype)
    grid = (1, 4, S // 4)
    lay = Layout(plan_packing([grid] * B), (rope_tables(grid, cfg, 0, S, device),), ({},), sdpa_attention)
    x = torch.randn(B * S, dim, device=device).to(dtype).requires_grad_()
    e0 = torch.randn(B, 6, dim, device=device)
    context = torch.randn(B, 8, dim, device=device).to(dtype)
    return block, (x, e0, context, lay)


def run_block(block, inputs):
    y = block(*inputs)
    y.float().square().mean().backward()
    return y.detach(), inputs[0].grad.clone(), [p.grad.clone() for p in block.parameters()]


def test_cpu_custom_op_registration():
    """torch.library.opcheck: schema, fake (meta) function, autograd registration and dispatch of the custom op
    through its CPU kernel (the reference semantics), for per-sample, per-token chunk and affine inputs."""
    x = torch.randn(2, 5, 16, requires_grad=True)
    sc, sh = torch.randn(2, 1, 16, requires_grad=True), torch.randn(2, 1, 16, requires_grad=True)
    e = torch.randn(2, 5, 6, 16, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    for args in [(x, sc, sh, None, None, 1e-6, torch.float32), (x, e[:, :, 1], e[:, :, 4], w, b, 1e-5, torch.float16)]:
        torch.library.opcheck(lnm_mod.ln_modulate_op, args)
    y, mean, rstd = lnm_mod.ln_modulate_op(x, sc, sh, None, None, 1e-6, torch.float32)
    assert rel(y, ref64(x, sc, sh, None, None)) < 1e-5 and mean.shape == rstd.shape == (10,)


def test_cpu_compile_block_fullgraph(monkeypatch):
    """torch.compile(fullgraph=True) of a WanBlock traces the op's CPU (PyTorch) path with no graph break, and
    matches eager (aot_eager: the graph and its autograd without inductor's code generation)."""
    monkeypatch.setenv("DS_ADAPTIVELOAD_LN_MODULATE", "auto")
    torch._dynamo.reset()
    block, inputs = small_block()
    ref = run_block(block, inputs)
    block.zero_grad()
    inputs[0].grad = None
    got = run_block(torch.compile(block, fullgraph=True, backend="aot_eager"), inputs)
    assert torch.allclose(got[0], ref[0], atol=1e-5) and torch.allclose(got[1], ref[1], atol=1e-5)
    assert all(torch.allclose(a, c, atol=1e-5) for a, c in zip(got[2], ref[2]))


# ---------------------------------------------------------------- CUDA: the fused op

def _require_op():
    if lnm_mod.load_op() is None:
        pytest.fail(f"CUDA op did not load: {lnm_mod.op_error()}")


@pytest.fixture(autouse=False)
def cuda_op(monkeypatch):
    if not torch.cuda.is_available():  # tests/conftest.py skips `cuda` tests too; this keeps the file standalone
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DS_ADAPTIVELOAD_LN_MODULATE", "cuda")  # never fall back silently in these tests
    _require_op()


# Kernel choices (_tuning variant (fwd, bwd)), set for the forward and the backward alike: 0 = default (the
# compile-time tiles of ln_modulate_fast.cu where they apply: bf16/fp16, D in 1536..8192 tiles, per-sample
# or global fp32 modulation, no affine; else the general kernels), 1 = the general kernels only (forward:
# fwd_v1_kernel for 2-byte x), 2 = the baseline kernels only (fwd_vec_kernel, bwd_vec_kernel).
KERNEL_CHOICES = [0, 1, 2]


@pytest.fixture
def kernel_choice(cuda_op):
    """set(v) selects variant v (forward and backward) for the test; the previous choices are restored."""
    op = lnm_mod.load_op()
    before = _tuning.get()

    def set_(v):
        _tuning.set_choices(variant=(v, v))
        assert _tuning.get()["variant"] == (v, v)
        return op

    yield set_
    _tuning.set_choices(**before)


# The default kernels at every width and layout; the general (1) and baseline (2) kernels, which do not branch on
# the layout beyond per-token vs staged, at three layouts that cover those branches (3072: per-token and
# large-mean tests cover it). Halves the suite's longest test (the device stage's pytest cap).
MATCH_CASES = [(0, D, lay) for D in (64, 100, 1536, 5120, 8192) for lay in LAYOUTS] + \
    [(v, D, lay) for v in (1, 2) for D in (64, 100, 1536, 5120, 8192) for lay in ("sample", "token", "mixed2")]


@pytest.mark.cuda
@pytest.mark.parametrize("variant,D,layout", MATCH_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_matches_reference(cuda_op, kernel_choice, dtype, layout, D, variant):
    kernel_choice(variant)
    check(layout, 2, 37, D, dtype, torch.float32, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("D", [64, 100, 1536, 16384, 16000])
@pytest.mark.parametrize("variant,out_dtype", [(0, None), (0, torch.float32), (0, torch.float16), (1, None), (2, None),
                                               (2, torch.float32)])  # the output conversion is shared code
def test_cuda_affine_out_dtype(cuda_op, kernel_choice, D, out_dtype, variant):
    kernel_choice(variant)
    check("sample", 3, 19, D, torch.bfloat16, torch.float32, "cuda", affine=True, out_dtype=out_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("D,dtype,layout", [(1536, torch.bfloat16, "token"), (1536, torch.float32, "mixed2"),
                                            (5120, torch.float16, "global"), (3072, torch.bfloat16, "chunk6"),
                                            (64, torch.float32, "mixed")])
def test_cuda_affine_layouts(cuda_op, kernel_choice, D, dtype, layout, variant):
    """Affine with staged (folded once per CTA) and per-token modulation."""
    kernel_choice(variant)
    check(layout, 2, 37, D, dtype, torch.float32, "cuda", affine=True)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["chunk6", "sample", "global"])
def test_cuda_modulation_in_x_dtype(cuda_op, kernel_choice, dtype, layout, variant):
    kernel_choice(variant)
    check(layout, 2, 50, 1536, dtype, dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
def test_cuda_two_d(cuda_op, kernel_choice, variant):
    kernel_choice(variant)
    check("global", 1, 300, 1536, torch.bfloat16, torch.float32, "cuda", two_d=True)
    check("token", 1, 300, 1000, torch.bfloat16, torch.float32, "cuda", two_d=True)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [0, 2])
def test_cuda_long_sequence(cuda_op, kernel_choice, variant):
    """Wan 2.1 14B at 720p x 129 frames: S = 176,400, one case."""
    kernel_choice(variant)
    check("sample", 1, 176400, 5120, torch.bfloat16, torch.float32, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("layout", ["sample", "global", "mixed2"])
def test_cuda_deterministic_reductions(cuda_op, kernel_choice, layout, variant):
    kernel_choice(variant)
    leaves, view = make(layout, 2, 4000, 1536, torch.bfloat16, torch.float32, "cuda", affine=True)
    dy = torch.randn(leaves[0].shape, device="cuda").bfloat16()
    runs = [torch.autograd.grad(ln_modulate(*view(leaves)[:3], weight=leaves[3], bias=leaves[4]), leaves[1:], dy)
            for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a, c), "reduced gradients differ between runs"


@pytest.mark.cuda
def test_cuda_saved_vs_recomputed_stats(cuda_op):
    op = lnm_mod.load_op()
    B, S, D = 2, 333, 5120
    x = torch.randn(B * S, D, device="cuda").bfloat16()
    sc, sh = torch.randn(B, 1, D, device="cuda"), torch.randn(B, 1, D, device="cuda")
    y, mean, rstd = op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, 2, True, -1, -1, None)
    dy = torch.randn_like(y)
    saved = op.backward(dy, x, sc, None, None, mean, rstd, B, S, D, 0, 1, 1, False, False, 1e-6, -1, -1, None)
    recomp = op.backward(dy, x, sc, None, None, None, None, B, S, D, 0, 1, 1, False, False, 1e-6, -1, -1, None)
    for a, c in zip(saved[:3], recomp[:3]):
        assert rel(a, c) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("vpt,rpc", [(1, 1), (2, 3), (4, 1)])
def test_cuda_launch_overrides(cuda_op, kernel_choice, vpt, rpc, variant):
    """The tuning overrides the benchmark sweeps compute the same function."""
    op = kernel_choice(variant)
    B, S, D = 3, 71, 3072
    x = torch.randn(B * S, D, device="cuda").bfloat16()
    sc, sh = torch.randn(B, 1, D, device="cuda"), torch.randn(D, device="cuda")
    y = op.forward(x, sc, sh, None, None, B, S, D, 0, 0, 0, 1e-6, 2, True, vpt, rpc, None)
    ref = ref64(x.view(B, S, D), sc, sh, None, None)
    assert rel(y[0].view(B, S, D), ref) < 1e-2
    dy = torch.randn_like(y[0])
    got = op.backward(dy, x, sc, None, None, y[1], y[2], B, S, D, 0, 1, 0, False, False, 1e-6, vpt, rpc, None)
    base = op.backward(dy, x, sc, None, None, y[1], y[2], B, S, D, 0, 1, 0, False, False, 1e-6, -1, -1, None)
    # dx in bf16: another launch shape may be another kernel (another summation order): a few 1-ulp flips.
    assert rel(got[0], base[0]) < 4e-3
    for a, c in zip(got[1:3], base[1:3]):
        assert rel(a, c) < 1e-5


@pytest.fixture
def stages_reset():
    yield lnm_mod.load_op()
    _tuning.set_choices(stages=(-1, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("stages", [0, 2, 3, 6])
@pytest.mark.parametrize("D,dtype,layout,affine", [(5120, torch.bfloat16, "sample", False),
                                                   (1536, torch.float16, "mixed", True),
                                                   (3072, torch.float32, "chunk6", False),
                                                   (16384, torch.float32, "global", True)])
def test_cuda_row_stream_variants(cuda_op, stages_reset, stages, D, dtype, layout, affine):
    """Register prefetch (0) and every shared-memory staging depth compute the same function. S is large
    enough that each row group's ring wraps several times and odd so row groups run out unevenly."""
    _tuning.set_choices(stages=(stages, stages))
    assert _tuning.get()["stages"] == (stages, stages)
    check(layout, 2, 2999 if D <= 5120 else 701, D, dtype, torch.float32, "cuda", affine=affine)


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
def test_cuda_staged_deterministic(cuda_op, kernel_choice, variant):
    """Staged (default) backward: reduced gradients bitwise equal across runs at the benchmark shape."""
    kernel_choice(variant)
    leaves, view = make("sample", 1, 20000, 5120, torch.bfloat16, torch.float32, "cuda")
    dy = torch.randn(leaves[0].shape, device="cuda").bfloat16()
    runs = [torch.autograd.grad(ln_modulate(*view(leaves)[:3]), leaves, dy) for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.cuda
def test_cuda_over_2_31_elements(cuda_op):
    """(1, 270000, 8192) bf16 = 2.2e9 elements: 64-bit offsets. Forward only; rows checked near both ends."""
    S, D = 270000, 8192
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~12 GB of GPU memory")
    x = torch.randn(1, S, D, device="cuda", dtype=torch.bfloat16)
    sc, sh = torch.randn(1, 1, D, device="cuda"), torch.randn(1, 1, D, device="cuda")
    poison("cuda", S * D * 2)
    y = ln_modulate(x, sc, sh)
    assert S * D > 2**31
    rows = torch.tensor([0, 1, 131071, S // 2, 262143, 262144, S - 2, S - 1], device="cuda")
    ref = ref64(x[0, rows], sc[0], sh[0], None, None)
    assert rel(y[0, rows], ref) < 1e-2
    assert not torch.isnan(y[0, -1000:]).any() and not torch.isnan(y[0, :1000]).any()
    assert not math.isnan(y.float().sum().item())


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("D,vpt,rpc", [(5120, -1, -1), (5120, 2, -1), (1536, 4, -1), (1536, 8, -1),
                                       (512, 1, 16), (256, 1, 13), (1536, 1, 5)])
@pytest.mark.parametrize("layout", ["sample", "token"])
def test_cuda_kernel_choice_shapes(cuda_op, kernel_choice, variant, D, vpt, rpc, layout):
    """Forward variants over the launch shapes the sweep times (vpt overrides; rows per CTA past the 15 named
    barriers: 16 x 2 warps), many rows per row group (S odd, not a multiple of the grid), saved statistics
    against float64. Output and statistics poisoned first."""
    op = kernel_choice(variant)
    B, S = 2, 2999
    x = (torch.randn(B * S, D, device="cuda") * 2 + 0.5).bfloat16()
    shp = (B, 1, D) if layout == "sample" else (B, S, D)
    sc, sh = 0.5 * torch.randn(*shp, device="cuda"), 0.5 * torch.randn(*shp, device="cuda")
    ss = 0 if layout == "sample" else D
    poison("cuda", B * S * D * 2)
    poison("cuda", B * S * 4)
    y, mean, rstd = op.forward(x, sc, sh, None, None, B, S, shp[1] * D, ss, shp[1] * D, ss, 1e-6, 2, True, vpt, rpc,
                               None)
    assert torch.isfinite(y).all() and torch.isfinite(mean).all() and torch.isfinite(rstd).all()
    ref = ref64(x.view(B, S, D), sc, sh, None, None)
    assert rel(y.view(B, S, D), ref) < TOL[torch.bfloat16][0]
    x64 = x.double()
    assert (mean.double() - x64.mean(-1)).abs().max().item() < 1e-4
    rstd64 = (x64.var(-1, unbiased=False) + 1e-6).rsqrt()
    assert ((rstd.double() - rstd64) / rstd64).abs().max().item() < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("variant", KERNEL_CHOICES)
@pytest.mark.parametrize("D", [64, 1536, 3072, 5120, 8192])
def test_cuda_large_mean_stable_variance(cuda_op, kernel_choice, variant, D):
    """x = 1000 + randn in fp32: a sum-of-squares variance would lose ~all digits (E[x^2] - E[x]^2 at 1e6 in
    fp32); the two-pass / merged per-warp statistics keep rstd well within 1e-4."""
    op = kernel_choice(variant)
    B, S = 2, 301
    x = 1000 + torch.randn(B * S, D, device="cuda", dtype=torch.float64)
    x = x.float()
    sc, sh = 0.5 * torch.randn(B, 1, D, device="cuda"), 0.5 * torch.randn(B, 1, D, device="cuda")
    poison("cuda", B * S * D * 4)
    y, mean, rstd = op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, 0, True, -1, -1, None)
    x64 = x.double()
    rstd64 = (x64.var(-1, unbiased=False) + 1e-6).rsqrt()
    assert ((rstd.double() - rstd64) / rstd64).abs().max().item() < 1e-4
    assert (mean.double() - x64.mean(-1)).abs().max().item() < 2e-3
    # The output error is dominated by the fp32 rounding of the mean (~1e-4 of a unit-variance row).
    assert rel(y.view(B, S, D), ref64(x.view(B, S, D), sc, sh, None, None)) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["sample", "global"])
@pytest.mark.parametrize("batch_path", ["grid", "flat"])
def test_cuda_fast_tiles(cuda_op, kernel_choice, dtype, layout, batch_path):
    """The compile-time tiles (default kernels) at every tile of the op's own tables (_tuning.fast_tiles), on
    the per-sample grid and on the flat row space: forward and saved statistics against float64 (outputs
    poisoned), gradients against the baseline kernels' (float64-checked elsewhere) and bitwise repeatable;
    rows not a multiple of the grid and B = 3 (several samples share the grid / a CTA's share)."""
    tiles = {}  # D -> (forward tile indices, backward tile indices) into the op's tables
    for backward in (False, True):
        for i, (D, *_rest) in enumerate(_tuning.fast_tiles(backward)):
            tiles.setdefault(D, ([], []))[backward].append(i)
    assert {1536, 5120} <= set(tiles)
    with _tuning.tuned(batch_path=batch_path):
        for D, (ftiles, btiles) in sorted(tiles.items()):
            check_fast_tiles(kernel_choice, D, ftiles, btiles, dtype, layout)


def check_fast_tiles(kernel_choice, D, ftiles, btiles, dtype, layout):
    B, S = 3, 1237
    x = (torch.randn(B * S, D, device="cuda") * 2 + 0.5).to(dtype)
    shp = (B, 1, D) if layout == "sample" else (D,)
    sc, sh = 0.5 * torch.randn(*shp, device="cuda"), 0.5 * torch.randn(*shp, device="cuda")
    sb = D if layout == "sample" else 0
    mode = 1 if layout == "sample" else 0
    code = lnm_mod._DTYPE_CODE[dtype]
    ref = ref64(x.view(B, S, D), sc, sh, None, None)
    dy = torch.randn(B * S, D, device="cuda").to(dtype)
    op = kernel_choice(2)
    stats = op.forward(x, sc, sh, None, None, B, S, sb, 0, sb, 0, 1e-6, code, True, -1, -1, None)[1:]
    base = op.backward(dy, x, sc, None, None, *stats, B, S, sb, 0, mode, mode, False, False, 1e-6, -1, -1, None)
    op = kernel_choice(0)
    x64 = x.double()
    for t in ftiles:
        _tuning.set_choices(tile=(t, -1))
        poison("cuda", B * S * D * x.element_size())
        y, mean, rstd = op.forward(x, sc, sh, None, None, B, S, sb, 0, sb, 0, 1e-6, code, True, -1, -1, None)
        assert rel(y.view(B, S, D), ref) < TOL[dtype][0], f"forward D {D} tile {_tuning.fast_tiles(False)[t]}"
        assert (mean.double() - x64.mean(-1)).abs().max().item() < 1e-4
        rstd64 = (x64.var(-1, unbiased=False) + 1e-6).rsqrt()
        assert ((rstd.double() - rstd64) / rstd64).abs().max().item() < 1e-5
    mean, rstd = stats  # the baseline forward's: some widths have backward tiles only (3072, 4096)
    for t in btiles:
        _tuning.set_choices(tile=(-1, t))
        what = f"D {D} tile {_tuning.fast_tiles(True)[t]}"
        poison("cuda", B * S * D * x.element_size())
        got = op.backward(dy, x, sc, None, None, mean, rstd, B, S, sb, 0, mode, mode, False, False, 1e-6, -1, -1, None)
        assert rel(got[0], base[0]) < 4e-3, f"dx, backward {what}"
        for a, c in zip(got[1:3], base[1:3]):
            assert rel(a, c) < 1e-5, f"dscale/dshift, backward {what}"
        again = op.backward(dy, x, sc, None, None, mean, rstd, B, S, sb, 0, mode, mode, False, False, 1e-6, -1, -1,
                            None)
        assert all(torch.equal(a, c) for a, c in zip(got[:3], again[:3])), f"not bitwise reproducible: {what}"


@pytest.mark.cuda
@pytest.mark.parametrize("B,S", [(2, 1237), (3, 1), (300, 7), (37, 1560), (2, 16380)])
@pytest.mark.parametrize("layout,dtype", [(lay, torch.bfloat16) for lay in ("sample", "global", "wan21", "token", "chunk6")]
                         + [("sample", torch.float16), ("token", torch.float16)])  # fp16: one staged, one per-token
def test_cuda_flat_rows(cuda_op, kernel_choice, B, S, layout, dtype):
    """The flat row space (default for B >= 2, and for per-token modulation at every B): shares that start and
    end inside samples, several samples per share (S = 1, 7), many shares per sample; against float64, and the
    gradients bitwise repeatable and within fp32 rounding of the per-sample grid's (per token: the general
    kernels')."""
    kernel_choice(0)
    D = 1536
    check(layout, B, S, D, dtype, torch.float32, "cuda")
    leaves, view = make(layout, B, S, D, dtype, torch.float32, "cuda")
    dy = torch.randn(leaves[0].shape, device="cuda").to(dtype)
    grads = {}
    for path in ("flat", "flat", "grid"):
        with _tuning.tuned(batch_path=path):
            grads.setdefault(path, []).append(torch.autograd.grad(ln_modulate(*view(leaves)[:3]), leaves, dy))
    (a, b), (g,) = grads["flat"], grads["grid"]
    assert all(torch.equal(u, v) for u, v in zip(a, b)), "flat path not bitwise repeatable"
    for name, u, v in zip(("dx", "dscale", "dshift"), a, g):
        assert rel(u, v) < (4e-3 if name == "dx" else 1e-5), name


@pytest.mark.cuda
@pytest.mark.parametrize("B,S", [(2, 16380), (37, 1560), (200, 1560), (300, 7), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_flat_forward_waves(cuda_op, kernel_choice, B, S, dtype):
    """The flat forward's grid in one or several waves of CTAs (_tuning waves; 0: the default rule, more and
    shorter shares; S = 1 and 7 among them; at 200 x 1560 rows the rule runs past 16 waves, and 64 is its cap):
    every row is computed alone, so the output and the saved statistics must be the one-wave grid's bits
    (poisoned before each call), and that one against float64."""
    op = kernel_choice(0)
    D = 1536
    x = (torch.randn(B * S, D, device="cuda") * 2 + 0.5).to(dtype)
    sc, sh = 0.5 * torch.randn(B, 1, D, device="cuda"), 0.5 * torch.randn(B, 1, D, device="cuda")
    code = lnm_mod._DTYPE_CODE[dtype]
    outs = {}
    for waves in (1, 0, 2, 3, 8, 64):
        with _tuning.tuned(batch_path="flat", waves=waves):
            assert _tuning.get()["waves"] == waves
            poison("cuda", B * S * D * x.element_size())
            outs[waves] = op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, code, True, -1, -1, None)
    assert _tuning.get()["waves"] == 0, "tuned() did not restore the default"
    assert rel(outs[1][0].view(B, S, D), ref64(x.view(B, S, D), sc, sh, None, None)) < TOL[dtype][0]
    for waves in (0, 2, 3, 8, 64):
        assert all(torch.equal(a, b) for a, b in zip(outs[waves], outs[1])), f"waves {waves} differ from one wave"


@pytest.mark.cuda
@pytest.mark.parametrize("D", [1536, 2048, 3072, 4096, 5120, 8192])
@pytest.mark.parametrize("layout", ["token", "chunk6"])
@pytest.mark.parametrize("B", [1, 3])
def test_cuda_per_token_tiles(cuda_op, kernel_choice, D, layout, B):
    """Per-token modulation on the tiles at every width of the tables (the forward has no tile of <= 2 vectors
    per thread at 8192, nor any at 3072 / 4096: the general forward there), B = 1 included, against float64."""
    kernel_choice(0)
    check(layout, B, 777, D, torch.bfloat16, torch.float32, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["sample", "wan21", "token", "global"])
def test_cuda_custom_op_registration(cuda_op, layout):
    """torch.library.opcheck on the CUDA kernels: the fake function's shapes, dtypes and strides match the op's,
    autograd through the custom op matches the registered backward, B >= 2 (the flat row space)."""
    leaves, view = make(layout, 3, 77, 1536, torch.bfloat16, torch.float32, "cuda")
    x, sc, sh, _, _ = view(leaves)
    torch.library.opcheck(lnm_mod.ln_modulate_op, (x, sc, sh, None, None, 1e-6, torch.bfloat16))
    y, mean, rstd = lnm_mod.ln_modulate_op(x, sc, sh, None, None, 1e-6, torch.bfloat16)
    assert rel(y, ref64(x, sc, sh, None, None)) < TOL[torch.bfloat16][0] and mean.shape == (3 * 77,)


@pytest.mark.cuda
@pytest.mark.parametrize("B,S,dtype", [(3, 96, torch.bfloat16)])
def test_cuda_compile_block(cuda_op, B, S, dtype):
    """torch.compile(fullgraph=True) of a WanBlock at D = 1536 runs the custom op (no graph break) and matches
    eager, which runs the autograd Function over the same kernels."""
    torch._dynamo.reset()
    block, inputs = small_block(dim=1536, heads=12, S=S, B=B, device="cuda", dtype=dtype)
    ref = run_block(block, inputs)
    block.zero_grad()
    inputs[0].grad = None
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = run_block(torch.compile(block, fullgraph=True), inputs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # inductor fuses and rounds the rest of the block differently from eager: a bf16-sized tolerance for both dtypes
    assert rel(got[0], ref[0]) < 3e-2 and rel(got[1], ref[1]) < 3e-2
    assert all(rel(a, c) < 1e-1 for a, c in zip(got[2], ref[2]))


@pytest.mark.cuda
@pytest.mark.parametrize("batch_path", ["auto", "flat"])
@pytest.mark.parametrize("D,dtype", [(1536, torch.bfloat16), (2048, torch.float16)])
def test_cuda_sample_boundaries(cuda_op, kernel_choice, batch_path, D, dtype):
    """Many samples shorter than a CTA's rows (S < rows per CTA: 2 row groups at D = 1536, 4 at 2048), so the flat
    row space restages the modulation several times per CTA while other row groups finish the previous sample's
    rows (what racecheck flagged on 2026-12-01): every row and every sample's dscale / dshift against float64,
    several seeds. A row read with another sample's modulation is off by O(1), far above bf16 rounding."""
    kernel_choice(0)
    for seed, (B, S) in enumerate([(257, 1), (131, 3), (97, 5), (61, 7)]):
        g = torch.Generator(device="cpu").manual_seed(seed)
        x = (torch.randn(B, S, D, generator=g) * 2 + 0.5).to("cuda", dtype).requires_grad_()
        sc = (torch.randn(B, 1, D, generator=g)).cuda().requires_grad_()
        sh = (torch.randn(B, 1, D, generator=g)).cuda().requires_grad_()
        dy = torch.randn(B, S, D, generator=g).to("cuda", dtype)
        with _tuning.tuned(batch_path=batch_path):
            poison("cuda", B * S * D * 4)
            y = ln_modulate(x, sc, sh)
            grads = torch.autograd.grad(y, [x, sc, sh], dy)
        leaves = [t.detach().double().requires_grad_() for t in (x, sc, sh)]
        ref = ref64(*leaves, None, None)
        ref_grads = torch.autograd.grad(ref, leaves, dy.double())
        err = ((y.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).flatten()
        assert err.max().item() < 2e-2, f"B {B} S {S}: worst row {int(err.argmax())} err {err.max().item():.2e}"
        for name, got, want in zip(("dx", "dscale", "dshift"), grads, ref_grads):
            e = ((got.double() - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2)).clamp_min(1e-30))
            assert e.max().item() < 3e-2, f"{name} B {B} S {S}: worst sample {int(e.argmax())} err {e.max().item():.2e}"
