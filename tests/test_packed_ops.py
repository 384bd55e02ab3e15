"""model/packed_ops.py: the whole-tensor modulation, gated add, RoPE and output projection of packed micro-batches
equal the same steps run per group (outputs and every gradient) on CPU, and on the GPU with the fused kernel
writing into the groups' rows (bit for bit against the kernel per group) and with inductor-compiled regions."""
import pytest
import torch
import torch.nn.functional as F

from ds_adaptiveload.model.packed_ops import packed_gated_add, packed_modulate, packed_rope, parts_linear, split_linear
from ds_adaptiveload.model.layout import BlockFns, gated_add, rope_qk
from ds_adaptiveload.ops.layernorm_modulate import ln_modulate

# (n_g, local rows per sample) per group: groups of one sample, at the front and behind, and of several
DIMS = [(1, 7), (3, 5), (2, 9), (1, 4)]
# Groups with runs of equal rows (model/packing.Packing.runs): a run of two groups, one of one, one of three.
RUN_DIMS = [(2, 5), (1, 5), (3, 9), (1, 4), (2, 4), (1, 4)]
RUNS = [(0, 2), (2, 3), (3, 6)]


def _inputs(dims, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, n = sum(a * b for a, b in dims), sum(a for a, _ in dims)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = rand(T, D).to(device, dtype)
    y = rand(T, D).to(device, dtype)
    # chunks of an [n, 6, D] fp32 tensor, as the blocks pass them: strided per-sample rows
    mod = (rand(n, 6, D) * 0.5).to(device)
    return x, y, mod, rand(T, D).to(device, dtype)


def _per_group(fn, dims, rows, samples):
    """fn per group on views, merged with cat: the reference the whole-tensor steps must equal."""
    sizes = [a * b for a, b in dims]
    rparts = [r.split(sizes) for r in rows]
    sparts = [s.split([a for a, _ in dims]) for s in samples]
    outs = [fn(*(p[i].unflatten(0, d) for p in rparts), *(p[i] for p in sparts)) for i, d in enumerate(dims)]
    return torch.cat([o.flatten(0, 1) for o in outs])


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _check_modulate(dims, D, dtype, device, exact):
    x, _, mod, dout = _inputs(dims, D, dtype, device)
    x0, m0 = _leaves(x, mod)
    ref = _per_group(lambda xg, sc, sh: ln_modulate(xg, sc, sh, eps=1e-6), dims, [x0],
                     [m0[:, 1:2], m0[:, 0:1]])
    ref.backward(dout)
    x1, m1 = _leaves(x, mod)
    got = packed_modulate(x1, m1[:, 1:2], m1[:, 0:1], dims, 1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    got.backward(dout)
    for a, b, name in ((got, ref, "y"), (x1.grad, x0.grad, "dx"), (m1.grad, m0.grad, "dmod")):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=name)
    assert m1.grad[:, 2:].abs().sum() == 0 and m1.grad[:, :2].abs().sum() > 0


def _check_gated_add(dims, D, dtype, device, fns, tol):
    x, y, mod, dout = _inputs(dims, D, dtype, device, seed=1)
    x0, y0, m0 = _leaves(x, y, mod)
    ref = _per_group(gated_add, dims, [x0, y0], [m0[:, 2:3]])
    ref.backward(dout)
    x1, y1, m1 = _leaves(x, y, mod)
    got = packed_gated_add(x1, y1, m1[:, 2:3], dims, fns)
    got.backward(dout)
    for a, b, name in ((got, ref, "out"), (x1.grad, x0.grad, "dx"), (y1.grad, y0.grad, "dy"),
                       (m1.grad, m0.grad, "dgate")):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)
    assert torch.equal(x1.grad, dout)  # d out / d x is the identity: the gradient passes through


def _rope_tables(dims, hd, device, seed):
    g = torch.Generator().manual_seed(seed)
    ang = [torch.rand(1, local, 1, hd // 2, generator=g, dtype=torch.float64) * 6.3 for _, local in dims]
    return [(a.cos().float().to(device), a.sin().float().to(device)) for a in ang]


def _check_rope(dims, heads, hd, dtype, device, fns, tol, drop_k=False, runs=None):
    """packed_rope against rope_qk per group on split views (concatenated per run when `runs` are given); drop_k:
    the keys unused (their gradient None)."""
    g = torch.Generator().manual_seed(2)
    T = sum(a * b for a, b in dims)
    q, k = (torch.randn(T, heads, hd, generator=g).to(device, dtype) for _ in range(2))
    douts = [torch.randn(a, b, heads, hd, generator=g).to(device, dtype) for a, b in dims for _ in range(2)]
    rope = _rope_tables(dims, hd, device, seed=3)
    sizes = [a * b for a, b in dims]
    q0, k0 = _leaves(q, k)
    ref = [rope_qk(qg.unflatten(0, d), kg.unflatten(0, d), cos, sin)
           for qg, kg, d, (cos, sin) in zip(q0.split(sizes), k0.split(sizes), dims, rope)]
    if runs is not None:  # the reference per run: its groups' results concatenated
        ref = [(torch.cat([a for a, _ in ref[i:j]]), torch.cat([b for _, b in ref[i:j]])) for i, j in runs]
        douts = [torch.cat([douts[2 * g + h] for g in range(i, j)]) for i, j in runs for h in (0, 1)]
    q1, k1 = _leaves(q, k)
    qs, ks = packed_rope(q1, k1, rope, dims, fns, runs)

    def loss_of(pairs):
        return sum((a * douts[2 * i]).sum() + (0 if drop_k else (b * douts[2 * i + 1]).sum())
                   for i, (a, b) in enumerate(pairs))

    loss_ref, loss = loss_of(ref), loss_of(zip(qs, ks))
    for (a, b), x, y in zip(ref, qs, ks):  # compiled, RoPE without autograd is a graph of its own (1 ulp apart)
        assert x.shape == a.shape and x.dtype == a.dtype
        torch.testing.assert_close(x.float(), a.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(y.float(), b.float(), rtol=tol, atol=tol)
    loss_ref.backward()
    loss.backward()
    torch.testing.assert_close(q1.grad.float(), q0.grad.float(), rtol=tol, atol=tol, msg="dq")
    if drop_k:
        assert k1.grad is None or not k1.grad.any()
    else:
        torch.testing.assert_close(k1.grad.float(), k0.grad.float(), rtol=tol, atol=tol, msg="dk")


def _check_parts_linear(dims, D, dtype, device, bias, tol, transposed):
    """parts_linear on per-group parts (strided as SDPA's outputs when transposed) against F.linear on their cat
    in float64 (from the same rounded inputs): each result within tol of the largest reference value."""
    g = torch.Generator().manual_seed(4)
    heads = 4
    raw = [torch.randn(a, b, heads, D // heads, generator=g).to(device, dtype) for a, b in dims]
    if transposed:  # [n, heads, S, hd] underneath, seen as [n, S, heads, hd]
        raw = [r.transpose(1, 2).contiguous().transpose(1, 2) for r in raw]
        assert not raw[0].is_contiguous()
    w = (torch.randn(D + 3, D, generator=g) / D ** 0.5).to(device, dtype)
    b = torch.randn(D + 3, generator=g).to(device, dtype) if bias else None
    dout = torch.randn(sum(a * c for a, c in dims), D + 3, generator=g).to(device, dtype)
    p0 = [r.detach().double().requires_grad_() for r in raw]
    w0, *b0 = (t.detach().double().requires_grad_() for t in (w, b) if t is not None)
    ref = F.linear(torch.cat([p.reshape(-1, D) for p in p0]), w0, b0[0] if bias else None)
    ref.backward(dout.double())
    p1 = [r.detach().requires_grad_() for r in raw]
    w1, *b1 = (t.detach().requires_grad_() for t in (w, b) if t is not None)
    got = parts_linear(p1, w1, b1[0] if bias else None)
    got.backward(dout)
    pairs = [(got, ref, "out"), (w1.grad, w0.grad, "dw")] + [(x.grad, y.grad, "dpart") for x, y in zip(p1, p0)]
    if bias:
        pairs.append((b1[0].grad, b0[0].grad, "db"))
    for a, r, name in pairs:
        assert a.shape == r.shape and a.dtype == dtype, name
        err = (a.double() - r).abs().max().item()
        assert err <= tol * r.abs().max().item(), f"{name}: {err} against max {r.abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop_k", [False, True], ids=["q-and-k", "q-only"])
def test_packed_rope_equals_per_group_on_cpu(dtype, drop_k):
    _check_rope(DIMS, 3, 8, dtype, "cpu", BlockFns(), tol=1e-6 if dtype == torch.float32 else 1e-2, drop_k=drop_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop_k", [False, True], ids=["q-and-k", "q-only"])
def test_packed_rope_of_runs_equals_per_group_on_cpu(dtype, drop_k):
    """Runs of several groups: each group's rotation written into its rows of the run's one tensor, its gradient
    taken from them."""
    _check_rope(RUN_DIMS, 3, 8, dtype, "cpu", BlockFns(), tol=1e-6 if dtype == torch.float32 else 1e-2,
                drop_k=drop_k, runs=RUNS)


def test_packed_modulate_and_gated_add_take_runs_as_groups():
    """A run is rows of equal length, so the per-sample steps take its (n, local) like a group's."""
    run_dims = [(sum(RUN_DIMS[g][0] for g in range(i, j)), RUN_DIMS[i][1]) for i, j in RUNS]
    assert run_dims == [(3, 5), (3, 9), (4, 4)]
    _check_modulate(run_dims, 16, torch.float32, "cpu", exact=False)
    _check_gated_add(run_dims, 16, torch.float32, "cpu", BlockFns(), tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("transposed", [True, False], ids=["strided", "contiguous"])
def test_parts_linear_equals_linear_on_the_cat_on_cpu(dtype, bias, transposed):
    _check_parts_linear(DIMS, 16, dtype, "cpu", bias, 1e-6 if dtype == torch.float32 else 2 ** -7, transposed)


def test_parts_linear_gradcheck_in_float64():
    """(RoPE computes in fp32 whatever its input, too coarse for finite differences: its test above compares with
    autograd through the per-group steps instead.)"""
    dims = [(1, 3), (2, 2)]
    parts = [torch.randn(a, b, 2, 3, dtype=torch.float64, requires_grad=True) for a, b in dims]
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, b, *p: parts_linear(p, w, b), (w, b, *parts))
    assert torch.autograd.gradcheck(lambda w, *p: parts_linear(p, w, None), (w, *parts))


def _check_split_linear(rows, D, dtype, device, bias, tol, drop=None):
    """split_linear's parts and gradients against F.linear then split in float64, from the same rounded inputs; the
    gradient of part `drop` is left None (a run whose output the loss does not use)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(rows), D, generator=g).to(device, dtype)
    w = (torch.randn(D + 3, D, generator=g) / D ** 0.5).to(device, dtype)
    b = torch.randn(D + 3, generator=g).to(device, dtype) if bias else None
    douts = [torch.randn(r, D + 3, generator=g).to(device, dtype) for r in rows]
    leaves0 = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    leaves1 = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    ref = F.linear(*leaves0).split(rows)
    got = split_linear(*leaves1[:2], leaves1[2] if bias else None, rows)
    keep = [i for i in range(len(rows)) if i != drop]
    torch.autograd.backward([ref[i] for i in keep], [douts[i].double() for i in keep])
    torch.autograd.backward([got[i] for i in keep], [douts[i] for i in keep])
    pairs = [(a, r, f"part {i}") for i, (a, r) in enumerate(zip(got, ref))]
    pairs += [(a.grad, r.grad, name) for a, r, name in zip(leaves1, leaves0, ("dx", "dw", "db"))]
    for a, r, name in pairs:
        assert a.shape == r.shape and a.dtype == dtype, name
        err = (a.double() - r).abs().max().item()
        assert err <= tol * max(r.abs().max().item(), 1.0), (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("drop", [None, 1], ids=["all-used", "one-unused"])
def test_split_linear_equals_linear_then_split_on_cpu(dtype, bias, drop):
    _check_split_linear([35, 20, 18], 16, dtype, "cpu", bias, 1e-6 if dtype == torch.float32 else 2 ** -7, drop)


def test_split_linear_gradcheck_in_float64():
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: split_linear(x, w, b, [3, 1, 3]), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: split_linear(x, w, None, [2, 5]), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_modulate_equals_per_group_on_cpu(dtype):
    _check_modulate(DIMS, 16, dtype, "cpu", exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gated_add_equals_per_group_on_cpu(dtype):
    _check_gated_add(DIMS, 16, dtype, "cpu", BlockFns(), tol=1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [1536, 100])
def test_packed_modulate_kernel_writes_the_groups_rows_bit_for_bit(dtype, D):
    """The kernel per group into one output (and one dx) against the kernel per group and a cat: the same
    kernels on the same rows, so equal bit for bit (the backward is deterministic). D = 100: the unvectorized path."""
    _check_modulate(DIMS + [(4, 33)], D, dtype, "cuda", exact=True)


@pytest.mark.cuda
@pytest.mark.parametrize("aligned", [True, False], ids=["assume_aligned_inputs", "unaligned"])
def test_packed_gated_add_compiled_on_gpu(aligned):
    """The compiled into-regions as compile_regions makes them (assume_aligned_inputs), and without the option."""
    from ds_adaptiveload.model.compile import CompileOptions, compile_region, region_fns
    from ds_adaptiveload.model.layout import gated_add_into, gated_dy_into

    torch._dynamo.reset()
    fns = region_fns()[0]
    if not aligned:
        opts = CompileOptions()
        fns = BlockFns(gated_add_into=compile_region(gated_add_into, opts),
                       gated_dy_into=compile_region(gated_dy_into, opts), gate_grad=fns.gate_grad)
    for dims in (DIMS, [(2, 40), (5, 8)], [(1, 40), (1, 8), (3, 3)]):
        _check_gated_add(dims, 1536, torch.bfloat16, "cuda", fns, tol=1e-2)


@pytest.mark.cuda
def test_packed_rope_and_parts_linear_compiled_on_gpu():
    """RoPE's gradient into dq and dk through the compiled region (assume_aligned_inputs), the output projection
    from strided parts and the split projection with cuBLAS, in bf16, against per-group steps and F.linear."""
    from ds_adaptiveload.model.compile import region_fns

    torch._dynamo.reset()
    fns = region_fns()[0]
    for dims in (DIMS, [(2, 40), (5, 8)], [(1, 40), (1, 8), (3, 3)]):
        _check_rope(dims, 12, 128, torch.bfloat16, "cuda", fns, tol=1e-2)
        _check_parts_linear(dims, 1536, torch.bfloat16, "cuda", True, 2 ** -7, transposed=True)
        _check_split_linear([a * b for a, b in dims], 1536, torch.bfloat16, "cuda", True, 2 ** -7)
    _check_rope(RUN_DIMS, 12, 128, torch.bfloat16, "cuda", fns, tol=1e-2, runs=RUNS)  # rope_qk_into's region


@pytest.mark.cuda
def test_kernel_into_overwrites_poison_and_rejects_a_wrong_tensor():
    from ds_adaptiveload.ops.layernorm_modulate import load_op

    op = load_op()
    B, S, D = 3, 17, 256
    x = torch.randn(B * S, D, device="cuda", dtype=torch.bfloat16)
    sc, sh = (torch.randn(B, D, device="cuda") for _ in range(2))
    fresh = op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, 2, True, -1, -1, None)
    big = torch.full((B * S + 10, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    into = big[5:5 + B * S]
    y, mean, rstd = op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, 2, True, -1, -1, into)
    assert y.data_ptr() == into.data_ptr() and torch.equal(into, fresh[0])
    assert big[:5].isnan().all() and big[-5:].isnan().all()  # rows outside untouched
    dy = torch.randn_like(x)
    dx_ref = op.backward(dy, x, sc, None, None, mean, rstd, B, S, D, 0, 1, 1, False, False, 1e-6, -1, -1, None)[0]
    big.fill_(float("nan"))
    op.backward(dy, x, sc, None, None, mean, rstd, B, S, D, 0, 1, 1, False, False, 1e-6, -1, -1, into)
    assert torch.equal(into, dx_ref) and big[:5].isnan().all()
    with pytest.raises(RuntimeError, match="into"):
        op.forward(x, sc, sh, None, None, B, S, D, 0, D, 0, 1e-6, 2, True, -1, -1, into.float())
    with pytest.raises(RuntimeError, match="dx_into"):
        op.backward(dy, x, sc, None, None, mean, rstd, B, S, D, 0, 1, 1, False, False, 1e-6, -1, -1, big[:B * S - 1])
