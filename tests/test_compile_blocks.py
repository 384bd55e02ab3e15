"""model/compile.py: regional compile of WanBlock matches eager (outputs and every gradient, fp32) over shapes
of different B and S, traces each block whole (fullgraph) with the op's PyTorch path, and shares one graph per
micro-batch kind between all blocks (the blocks read the sizes of a micro-batch's shape groups from tensor shapes,
so a graph serves every composition with the same number of groups, not one per (B, S), per composition or per
block). The aot_eager backend runs dynamo and
AOTAutograd without inductor's C++ code generation, which takes minutes per graph on these 2 shared cores;
inductor itself runs on the GPU in bench/mfu.py."""
import copy
import os
import time

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.model.compile import compile_blocks, compile_stats, uncompile_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (B, F, H, W) latents: S = F*H*W/4 tokens of 6, 12 and 24; B = 1 twice around a B = 2
SHAPES = [(1, 1, 4, 6), (2, 3, 4, 4), (1, 2, 6, 8)]


def tiny(checkpoint_blocks=False):
    cfg = WanConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=3, text_dim=32, text_len=8, freq_dim=32)
    torch.manual_seed(0)
    m = WanModel(cfg, checkpoint_blocks=checkpoint_blocks)
    with torch.no_grad():  # the zero-initialised head would make every other gradient zero
        m.head.head.weight.normal_(std=0.02)
    return m


def run(model, shape, seed):
    g = torch.Generator().manual_seed(seed)
    B, *lat = shape
    x = torch.randn(B, 16, *lat, generator=g)
    t = torch.rand(B, generator=g) * 1000
    ctx = torch.randn(B, 5, model.cfg.text_dim, generator=g)
    model.zero_grad(set_to_none=True)
    y = model(x, t, ctx)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_compiled_blocks_match_eager_and_compile_once(checkpoint_blocks):
    torch._dynamo.reset()
    eager = tiny(checkpoint_blocks)
    comp = copy.deepcopy(eager)
    assert compile_blocks(comp, fullgraph=True, backend="aot_eager") == 3
    assert compile_blocks(comp, fullgraph=True, backend="aot_eager") == 3  # again: left as it is
    for i, shape in enumerate(SHAPES):
        y0, g0 = run(eager, shape, i)
        y1, g1 = run(comp, shape, i)
        torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    st = compile_stats()
    # 3 blocks x 3 shapes: one graph per batch size B of 1 or more (torch specialises sizes of 1; one-group
    # micro-batches are dynamic in S), shared by the 3 blocks (not 9, and not one per shape)
    n_b = len({s[0] > 1 for s in SHAPES})
    assert st["block_graphs"] == n_b and st["block_recompiles"] == n_b - 1, st
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


# packed micro-batches: (latent shape, samples) per group. Kinds (groups, which hold one sample): (2, none) x 2,
# (2, the second) x 2, (3, the third) x 2: 6 compositions, 3 graphs
PACKS = [[((1, 8, 8), 2), ((1, 4, 6), 3)], [((2, 4, 4), 3), ((3, 6, 8), 2)], [((1, 8, 8), 2), ((2, 4, 4), 1)],
         [((1, 4, 6), 4), ((1, 8, 8), 1)], [((2, 4, 4), 2), ((3, 6, 8), 2), ((1, 4, 6), 1)],
         [((3, 6, 8), 3), ((1, 8, 8), 2), ((2, 4, 4), 1)]]


def run_packed(model, pack, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lat = [shape for shape, n in pack for _ in range(n)]
    xs = [torch.randn(16, *s, generator=g).to(device) for s in lat]
    t = (torch.rand(len(xs), generator=g) * 1000).to(device)
    ctx = [torch.randn(5, model.cfg.text_dim, generator=g).to(device) for _ in xs]
    model.zero_grad(set_to_none=True)
    ys = model(xs, t, ctx)
    sum((y * torch.randn(y.shape, generator=g).to(device)).sum() for y in ys).backward()
    return [y.detach() for y in ys], {n: p.grad.clone() for n, p in model.named_parameters()}


def check_against_eager(eager, comp, packs, device="cpu", tol=1e-5):
    """Each pack through both models: outputs within tol, gradients within tol / 10 tol (rel.); the graph count
    after each pack."""
    graphs = []
    for i, pack in enumerate(packs):
        y0, g0 = run_packed(eager, pack, i, device)
        y1, g1 = run_packed(comp, pack, i, device)
        for a, b in zip(y1, y0):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], atol=tol, rtol=10 * tol, msg=lambda m, n=n: f"{n}: {m}")
        graphs.append(compile_stats()["block_graphs"])
    return graphs


def test_packed_micro_batches_compile_once_per_kind():
    """The group sizes reach the compiled block as tensor shapes (Packing.size_tensors), so a micro-batch of other
    shapes and sample counts reuses the graph of its kind: its number of shape groups and which hold one sample."""
    torch._dynamo.reset()
    eager = tiny()
    comp = copy.deepcopy(eager)
    compile_blocks(comp, fullgraph=True, backend="aot_eager")
    check_against_eager(eager, comp, PACKS)
    st = compile_stats()
    kinds = {tuple(n == 1 for _, n in p) for p in PACKS}
    assert st["block_graphs"] == len(kinds) == 3, st
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


# Runs of equal-token groups (Packing.runs): grids (1, 4, 4), (2, 2, 4) and (2, 4, 2) have 16 tokens, (1, 2, 3) and
# (1, 3, 2) have 6.
RUN_PACKS = [[((1, 8, 8), 2), ((2, 4, 8), 1), ((1, 4, 6), 2)],
             [((2, 8, 4), 3), ((1, 8, 8), 1), ((1, 6, 4), 2), ((1, 4, 6), 1), ((2, 4, 8), 2)]]


def test_runs_of_equal_token_groups_compile_whole_and_match_eager():
    """A whole compiled block concatenates a run's rotated groups in its trace (Layout.rope_per_group)."""
    torch._dynamo.reset()
    eager = tiny()
    comp = copy.deepcopy(eager)
    compile_blocks(comp, fullgraph=True, backend="aot_eager")
    check_against_eager(eager, comp, RUN_PACKS)
    assert compile_stats()["graph_breaks"] == 0


def test_static_compile_recompiles_per_shape_and_uncompile_restores_eager():
    torch._dynamo.reset()
    m = tiny()
    compile_blocks(m, dynamic=False, backend="aot_eager")
    for i, shape in enumerate([(1, 1, 4, 6), (1, 1, 4, 8), (1, 1, 6, 8)]):
        run(m, shape, i)
    assert compile_stats()["block_graphs"] == 3
    uncompile_blocks(m)
    assert all("forward" not in b.__dict__ for b in m.blocks)
    run(m, (1, 1, 8, 8), 0)
    assert compile_stats()["block_graphs"] == 3  # eager again: nothing new compiled


def test_bad_model_is_a_user_error():
    with pytest.raises(UserError, match="model"):
        compile_blocks("not a model")
    with pytest.raises(UserError, match="WanBlock"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_inductor_compiles_blocks_without_mix_order_reduction(monkeypatch):
    """pytorch/pytorch#193061: mix-order reduction leaves slices of the [n, 6, dim] modulation gradient unwritten,
    so compile_blocks must hand inductor mix_order_reduction=False, with or without a mode; other backends take
    the mode as it is."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    from ds_adaptiveload.model.compile import block_forward

    block_forward()
    block_forward(mode="max-autotune-no-cudagraphs")
    block_forward(mode="reduce-overhead", backend="aot_eager")
    assert seen[0]["options"] == {"triton.mix_order_reduction": False} and "mode" not in seen[0]
    assert seen[1]["options"]["triton.mix_order_reduction"] is False and seen[1]["options"]["max_autotune"]
    assert seen[2]["mode"] == "reduce-overhead" and "options" not in seen[2]


@pytest.mark.cuda
def test_inductor_blocks_match_eager_on_gpu(monkeypatch):
    """Compiled blocks (inductor) against eager on the GPU at a size where inductor fuses the AdaLN backward into
    mix-order reductions (thousands of tokens): every gradient, the modulation's included, within fp32 rounding
    (TF32 off, so that cuDNN's convolution does not round the patch embedding's gradient to 10 bits)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    cfg = WanConfig(dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_dim=32, text_len=8, freq_dim=32)
    torch.manual_seed(0)
    eager = WanModel(cfg).cuda()
    with torch.no_grad():
        eager.head.head.weight.normal_(std=0.02)
    comp = copy.deepcopy(eager)
    compile_blocks(comp)
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w = (torch.randn(1, 16, 8, 64, 128, generator=g, device="cuda") for _ in range(2))  # 16,384 tokens
    t = torch.full((1,), 500.0, device="cuda")
    ctx = torch.randn(1, 8, cfg.text_dim, generator=g, device="cuda")
    grads = []
    for m in (eager, comp, comp):  # twice compiled: a stale buffer shows on a later call
        m.zero_grad(set_to_none=True)
        (m(x, t, ctx) * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for call, got in enumerate(grads[1:]):
        err = {n: float((got[n] - ref).norm() / ref.norm()) for n, ref in grads[0].items()}
        bad = {n: e for n, e in err.items() if not e < 1e-3}
        assert not bad, f"compiled call {call}: relative gradient errors over 1e-3: {bad}"


def test_compile_blocks_allows_a_graph_per_micro_batch_kind():
    """Past dynamo's recompile limit a block runs eagerly, outside the compiled memory model: compile_blocks raises
    the limit to RECOMPILE_LIMIT (and never lowers a higher one)."""
    from ds_adaptiveload.model.compile import RECOMPILE_LIMIT

    cfg = torch._dynamo.config
    with cfg.patch(recompile_limit=8):
        compile_blocks(tiny(), backend="aot_eager")
        assert cfg.recompile_limit == RECOMPILE_LIMIT >= 32
    with cfg.patch(recompile_limit=1000):
        compile_blocks(tiny(), backend="aot_eager")
        assert cfg.recompile_limit == 1000


def test_whole_model_compile_gets_the_same_inductor_options():
    from ds_adaptiveload.model.compile import INDUCTOR_OPTIONS, engine_compile_kwargs

    assert engine_compile_kwargs() == {"options": INDUCTOR_OPTIONS}
    assert engine_compile_kwargs("aot_eager") == {"mode": None}


@pytest.mark.cuda
def test_inductor_packed_blocks_match_eager_on_gpu(monkeypatch):
    """Packed micro-batches of 3 kinds through inductor-compiled blocks on the GPU: every gradient as eager's, and
    one graph per kind."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    eager = tiny().cuda()
    comp = copy.deepcopy(eager)
    compile_blocks(comp)
    for i, pack in enumerate(PACKS):
        _, g0 = run_packed(eager, pack, i, "cuda")
        _, g1 = run_packed(comp, pack, i, "cuda")
        err = {n: float((g1[n] - ref).norm() / ref.norm().clamp_min(1e-12)) for n, ref in g0.items()}
        bad = {n: e for n, e in err.items() if not e < 1e-3}
        assert not bad, f"pack {i}: relative gradient errors over 1e-3: {bad}"
    assert compile_stats()["block_graphs"] == 3


@pytest.mark.slow
def test_trainer_trains_packed_micro_batches_with_compiled_blocks(tmp_path):
    """launch/train_wan.py --compile-blocks (aot_eager; auto: regions) --checkpoint-blocks auto
    --checkpoint-policy attention, policy packed, ZeRO-2, 2 ranks: finite losses, and each step logs the graphs so
    far, which stay few (a bound whatever the composition: tests/test_compile_regions.py)."""
    import json
    import math

    import yaml

    from tests import test_reliability as rel
    from tests import test_train as tt

    if rel.DEEPSPEED is None:
        pytest.skip("deepspeed launcher not installed")
    with open(os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml")) as f:
        prof = yaml.safe_load(f)
    # a memory model under which the tiny micro-batches need some, not all, of the 2 blocks checkpointed: with both
    # open a micro-batch holds 11 bytes per token, and the packed plan's first steps hold 112-136 tokens
    capacity = 1400
    prof["memory"].update(capacity_bytes=capacity, safety=1.0, fixed_bytes=0, bytes_per_token=1,
                          block_bytes_per_token=5, attention_bytes_per_token=1)
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(prof))
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        al = json.load(f)["adaptive_load"]
    al.update(policy="packed", profile=str(tmp_path / "profile.yaml"))
    cfg = tt.test_config(tmp_path, adaptive_load=al, zero_optimization={"stage": 2})
    out = tmp_path / "run"
    proc = rel.launch(out, None, cfg, "--no-final-save", "--max-steps", "4", "--compile-blocks", "--compile-backend",
                      "aot_eager", "--checkpoint-blocks", "auto", "--checkpoint-policy", "attention",
                      "--compile-cache", str(tmp_path / "cc.bin"), timeout=300)
    rel.ok(proc)
    assert "[train_wan] --compile-blocks: regions" in proc.stdout  # what the bare flag means
    assert "[train_wan] compile cache:" in proc.stdout  # rank 0 rewrote it after steps that compiled
    log = tt.steps(out, 0)
    assert len(log) == 4 and all(math.isfinite(r["loss"]) for r in log)
    graphs = [r["block_graphs"] for r in log]
    with open(out / "synthetic" / "manifest.jsonl") as f:
        shape = {r["id"]: (r["frames"], r["height"], r["width"]) for r in map(json.loads, f)}
    groups = [len({shape[i] for i in mb}) for r in log for mb in r["ids"]]
    assert max(groups) > 1, "no micro-batch mixed shapes"
    from tests.test_compile_regions import MAX_GRAPHS

    assert graphs == sorted(graphs) and 1 <= graphs[-1] <= MAX_GRAPHS, graphs
    # the memory model's peak for each step's largest micro-batch (bytes_per_token 1 above: tokens + open blocks)
    assert all(0 < r["pred_mem_gib"] * 2**30 <= capacity for r in log), [r.get("pred_mem_gib") for r in log]
    # [k, k_full] per micro-batch: some blocks open, some not, and k_full never above k
    ks = [kk for r in log for kk in r["ckpt_k"]]
    assert all(len(r["ckpt_k"]) == len(r["ids"]) for r in log), [r["ckpt_k"] for r in log]
    assert all(0 <= kf <= k <= 2 for k, kf in ks) and any(k < 2 for k, _ in ks) and any(k > 0 for k, _ in ks), ks
    ends = [r["end_time"] for r in log]  # unix time at each step's end, for joining outside logs
    assert ends == sorted(ends) and abs(ends[-1] - time.time()) < 600, ends


_CACHE_RUN = """
import sys, torch
sys.path.insert(0, {root!r})
from torch._dynamo.utils import counters
from ds_adaptiveload.model.compile import compile_blocks, load_compile_cache, save_compile_cache
from tests.test_compile_blocks import tiny, run
m = tiny()
compile_blocks(m)
loaded = load_compile_cache({path!r})
run(m, (1, 1, 4, 6), 0)
n = save_compile_cache({path!r}) if not loaded else 0
print("RESULT", loaded, n, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.slow
def test_compile_cache_carries_compiled_graphs_to_a_fresh_machine(tmp_path):
    """save_compile_cache in one process, load_compile_cache in another with an empty inductor cache folder (a
    fresh machine): the second compiles its graphs from the artifacts (FX graph cache hits, no misses)."""
    import subprocess
    import sys

    from ds_adaptiveload.model.compile import load_compile_cache

    path = str(tmp_path / "cache.bin")
    results = []
    for i in range(2):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor{i}"), PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, "-c", _CACHE_RUN.format(root=ROOT, path=path)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1].split()
        results.append((line[1] == "True", int(line[2]), int(line[3]), int(line[4])))
    (loaded0, written, _, miss0), (loaded1, _, hit1, miss1) = results
    assert not loaded0 and written > 0 and miss0 > 0  # the first run compiled and saved
    assert loaded1 and hit1 > 0 and miss1 == 0, results  # the second found every graph in the artifacts
    assert not load_compile_cache(str(tmp_path / "none"))
