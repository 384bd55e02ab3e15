"""Packed micro-batches (model/packing.py): a list of samples of mixed shapes in one forward equals each
sample run alone, in outputs and parameter gradients; grouping, checkpointing, Ulysses SP on 2 ranks and
the packed flow-matching loss."""
import os

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model import WanModel, sdpa_attention
from ds_adaptiveload.model.packing import plan_packing
from ds_adaptiveload.train import flow
from tests.launcher import master_port, spawn_ranks
from tests.test_model import inputs, perturbed_model, rel_err, tiny_cfg

# Mixed shapes with repeats that are not adjacent: grouping must reorder and restore the input order. Grids
# (1, 3, 2) and (1, 2, 3) have 6 tokens, (2, 2, 3) and (2, 3, 2) 12: each pair forms one run (Packing.runs).
SHAPES = [(3, 8, 12), (1, 6, 4), (2, 4, 6), (1, 4, 6), (1, 6, 4), (3, 8, 12), (2, 6, 4), (1, 6, 4)]


def packed_inputs(cfg, shapes=SHAPES, seed=2):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(cfg.in_dim, *s, generator=g) for s in shapes]
    t = torch.rand(len(shapes), generator=g) * 1000
    # Context lengths differ per sample, one longer than text_len (truncated).
    ctxs = [torch.randn(cfg.text_len - 3 * i + 4, cfg.text_dim, generator=g) for i in range(len(shapes))]
    return xs, t, ctxs


def loss_of(ys):
    """A loss that weighs samples differently, so a gradient sent to the wrong sample shows."""
    return sum((i + 1) * y.square().mean() for i, y in enumerate(ys))


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_plan_packing_groups_stably():
    p = plan_packing([(1, 2, 2), (2, 2, 2), (1, 2, 2), (3, 1, 1)], world=3)
    assert [g.grid for g in p.groups] == [(1, 2, 2), (2, 2, 2), (3, 1, 1)]
    assert [g.index for g in p.groups] == [(0, 2), (1,), (3,)]
    assert p.order == (0, 2, 1, 3)
    assert [(g.first, g.local, g.offset) for g in p.groups] == [(0, 2, 0), (2, 3, 4), (3, 1, 7)]
    assert p.rows == 8
    assert p.runs == ((0, 1), (1, 2), (2, 3)) and p.run_dims() == [(2, 2), (1, 3), (1, 1)]


def test_plan_packing_puts_equal_token_groups_in_one_run():
    """Grids of equal token count are placed next to each other (first appearance of the count, then of the
    grid), so attention and modulation run once over them."""
    p = plan_packing([(1, 2, 4), (1, 3, 3), (1, 4, 2), (1, 2, 4), (2, 2, 2), (1, 1, 9)])
    assert [g.grid for g in p.groups] == [(1, 2, 4), (1, 4, 2), (2, 2, 2), (1, 3, 3), (1, 1, 9)]
    assert p.order == (0, 3, 2, 4, 1, 5)
    assert p.runs == ((0, 3), (3, 5)) and p.run_dims() == [(4, 8), (2, 9)]
    assert plan_packing([(1, 2, 4), (1, 4, 2), (1, 3, 3)]).is_identity  # already in that order: no reordering
    sizes = p.size_tensors("cpu")
    assert p.run_dims(sizes) == p.run_dims()


def test_packed_equals_each_sample_alone():
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    xs, t, ctxs = packed_inputs(cfg)
    ys = m(xs, t, ctxs)
    assert [tuple(y.shape) for y in ys] == [(cfg.out_dim, *s) for s in SHAPES]
    loss_of(ys).backward()
    g_packed = grads(m)

    m.zero_grad()
    alone = [m(x[None], t[i:i + 1], [ctxs[i]])[0] for i, x in enumerate(xs)]
    loss_of(alone).backward()
    for y, ref in zip(ys, alone):
        assert rel_err(y.detach(), ref.detach()) < 1e-5
    for n, p in m.named_parameters():
        assert rel_err(g_packed[n], p.grad) < 1e-5, n
    assert all(g.abs().sum() > 0 for g in g_packed.values())


def test_packed_projections_hand_back_each_runs_rows(monkeypatch):
    """Self-attention's v and cross-attention's q projections go through split_linear over several runs (their
    gradients are not concatenated), and not for a projection with a hook (ZeRO-3's gathers) or one run."""
    from ds_adaptiveload.model import layout

    calls = []
    monkeypatch.setattr(layout, "split_linear", lambda *a: calls.append(a[3]) or _split(*a))
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    xs, t, ctxs = packed_inputs(cfg)
    with torch.no_grad():
        m(xs, t, ctxs)
        assert calls == [[2 * 72, 4 * 6, 2 * 12]] * (2 * cfg.num_layers)  # the runs of test_attention_runs_once_per_run
        calls.clear()
        m.blocks[0].self_attn.v.register_forward_pre_hook(lambda mod, args: None)
        m(xs, t, ctxs)
        assert len(calls) == 2 * cfg.num_layers - 1
        calls.clear()
        m(xs[:1], t[:1], ctxs[:1])
        assert not calls


def _split(*args):
    from ds_adaptiveload.model.packed_ops import split_linear

    return split_linear(*args)


def test_packed_bf16_equals_each_sample_alone():
    """bf16 activations: the merges round the fp32 gated residuals to bf16 in their copy, as .to() does."""
    cfg = tiny_cfg()
    m = perturbed_model(cfg).to(torch.bfloat16)
    xs, t, ctxs = packed_inputs(cfg)
    ys = m([x.bfloat16() for x in xs], t, [c.bfloat16() for c in ctxs])
    assert all(y.dtype == torch.bfloat16 for y in ys)
    loss_of([y.float() for y in ys]).backward()
    g_packed = grads(m)
    m.zero_grad()
    alone = [m(x[None].bfloat16(), t[i:i + 1], [ctxs[i].bfloat16()])[0] for i, x in enumerate(xs)]
    loss_of([y.float() for y in alone]).backward()
    for y, ref in zip(ys, alone):
        assert rel_err(y.detach().float(), ref.detach().float()) < 1e-2
    for n, p in m.named_parameters():
        assert rel_err(g_packed[n].float(), p.grad.float()) < 2e-2, n


def test_one_shape_list_is_the_tensor_form():
    cfg = tiny_cfg()
    m = perturbed_model(cfg).eval()
    x, t, ctx = inputs(cfg, B=3)
    with torch.no_grad():
        ys = m(list(x.unbind(0)), t, list(ctx.unbind(0)))
        assert torch.equal(torch.stack(ys), m(x, t, ctx))


def test_attention_runs_once_per_run():
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    calls = []

    def core(q, k, v, **kw):
        calls.append(tuple(q.shape))
        return sdpa_attention(q, k, v, **kw)

    m.set_attention(core)
    xs, t, ctxs = packed_inputs(cfg)
    with torch.no_grad():
        m(xs, t, ctxs)
    # runs: 2 samples of grid (3, 4, 6); 4 of 6 tokens (3 of grid (1, 3, 2), 1 of (1, 2, 3)); 2 of 12 tokens
    per_block = [(2, 3 * 4 * 6, 2, 64), (4, 6, 2, 64), (2, 12, 2, 64)]
    assert calls == per_block * cfg.num_layers


def test_packed_checkpointing_same_output_and_grads():
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    xs, t, ctxs = packed_inputs(cfg)
    results = []
    for ckpt in (False, True):
        m.checkpoint_blocks = ckpt
        m.zero_grad()
        ys = m(xs, t, ctxs)
        loss_of(ys).backward()
        results.append(([y.detach() for y in ys], grads(m)))
    (y0, g0), (y1, g1) = results
    assert all(torch.equal(a, b) for a, b in zip(y0, y1))
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)


def test_packed_bad_inputs_are_named():
    cfg = tiny_cfg()
    m = WanModel(cfg)
    xs, t, ctxs = packed_inputs(cfg, shapes=[(1, 4, 4), (1, 2, 2)])
    with pytest.raises(UserError, match=r"xs\[1\]"):
        m([xs[0], xs[1][:3]], t, ctxs)
    with pytest.raises(UserError, match=r"xs\[1\].*not divisible by patch"):
        m([xs[0], torch.zeros(cfg.in_dim, 1, 3, 2)], t, ctxs)
    with pytest.raises(UserError, match="1 text contexts for 2 samples"):
        m(xs, t, ctxs[:1])
    with pytest.raises(UserError, match=r"t has shape \(3,\)"):
        m(xs, torch.zeros(3), ctxs)
    with pytest.raises(UserError, match="no samples"):
        m([], t, [])


# ---------------------------------------------------------------- packed flow matching

def test_packed_noise_equals_one_shape_noise():
    x0 = torch.randn(3, 16, 1, 4, 4)
    eps, t = flow.draw_noise(x0, [7, 8, 9], seed=1, epoch=2, shift=5.0)
    eps_p, t_p = flow.draw_noise_packed([x0[2], torch.zeros(16, 2, 2, 2), x0[0]], [9, 5, 7], 1, 2, 5.0)
    assert torch.equal(eps_p[0], eps[2]) and torch.equal(eps_p[2], eps[0])
    assert torch.equal(t_p[[0, 2]], t[[2, 0]])
    assert eps_p[1].shape == (16, 2, 2, 2)
    with pytest.raises(UserError, match="2 latents but 1 sample indices"):
        flow.draw_noise_packed([x0[0], x0[1]], [1], 1, 0, 5.0)


def test_packed_flow_loss_equals_per_sample_loss():
    cfg = tiny_cfg()
    m = perturbed_model(cfg).eval()
    xs, _, ctxs = packed_inputs(cfg)
    eps, t = flow.draw_noise_packed(xs, list(range(len(xs))), seed=0, epoch=0, shift=5.0)
    with torch.no_grad():
        packed = flow.packed_flow_matching_loss(m, xs, ctxs, eps, t)
        alone = torch.cat([flow.flow_matching_loss(m, x[None], [c], e[None], t[i:i + 1])
                           for i, (x, c, e) in enumerate(zip(xs, ctxs, eps))])
    assert packed.shape == (len(xs),)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)
    with pytest.raises(UserError, match="one entry per sample"):
        flow.packed_flow_matching_loss(m, xs, ctxs[:2], eps, t)


# ---------------------------------------------------------------- Ulysses SP, 2 gloo ranks

def gloo_rank(rank, world, port):
    """A spawned worker's set-up: this rank of `world` in a gloo group on `port`, one thread; the tiny config."""
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    deepspeed.init_distributed("gloo")
    torch.set_num_threads(1)
    return tiny_cfg()


def _packed_sp_worker(rank, world, port, result_path, regions=False, fa4=False):
    """One SP rank running the packed forward through train/sp.py: DeepSpeed's DistributedAttention per group
    (regions: the blocks' elementwise steps compiled, aot_eager, on this rank's padded token shards; fa4: the core
    is model/attention.fa4_attention, its kernels the float64 stand-in of tests/fake_fa4.py)."""
    import torch.distributed as dist

    from ds_adaptiveload.model import attention
    from ds_adaptiveload.train import sp
    from tests import fake_fa4

    cfg = gloo_rank(rank, world, port)
    m = perturbed_model(cfg)
    calls = {"fwd": 0, "bwd": 0}
    if fa4:
        fake_fa4.install(attention, calls, takes_all=True)
    shard = sp.apply_ulysses(m, sp.init_sequence_parallel(sp.ParallelDims(world, world, rank)), cfg.num_heads,
                             attention.fa4_attention if fa4 else None)
    if regions:
        from ds_adaptiveload.model.compile import compile_regions

        compile_regions(m, backend="aot_eager")
    xs, t, ctxs = packed_inputs(cfg, shapes=SP_SHAPES)
    ys = m(xs, t, ctxs, seq_shard=shard)
    loss_of(ys).backward()
    g = grads(m)
    for v in g.values():                              # what DeepSpeed does over the SP group
        dist.all_reduce(v)
    if rank == 0:
        torch.save({"ys": [y.detach() for y in ys], "grads": g, "fa4_calls": calls}, result_path)
    dist.destroy_process_group()


def _packed_sp_regions_worker(rank, world, port, result_path):
    _packed_sp_worker(rank, world, port, result_path, regions=True)


def _packed_sp_fa4_worker(rank, world, port, result_path):
    _packed_sp_worker(rank, world, port, result_path, fa4=True)


# Odd token counts (45, 3, 15) need per-group padding to a multiple of 2; grids (3, 3, 5) and (3, 5, 3), and
# (1, 1, 3) and (1, 3, 1), are runs of two groups each, padded alike.
SP_SHAPES = [(3, 6, 10), (1, 2, 6), (3, 10, 6), (3, 6, 10), (3, 2, 10), (1, 6, 2), (1, 2, 6)]


@pytest.mark.slow
@pytest.mark.parametrize("worker", [_packed_sp_worker, _packed_sp_regions_worker, _packed_sp_fa4_worker],
                         ids=["eager", "regions", "fa4"])
def test_packed_sequence_parallel_matches_single_process(tmp_path, worker):
    """sp = 2 against one process with SDPA. fa4: the FA4 ops under DistributedAttention, SP padding per group
    included, with their kernels stood in for (the real kernels under SP need two GPUs)."""
    pytest.importorskip("deepspeed")
    res = spawn(worker, 2, tmp_path)
    if worker is _packed_sp_fa4_worker:  # one self-attention forward per run of groups and block, and a backward
        assert res["fa4_calls"]["fwd"] > 0 and res["fa4_calls"]["bwd"] == res["fa4_calls"]["fwd"], res["fa4_calls"]

    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    xs, t, ctxs = packed_inputs(cfg, shapes=SP_SHAPES)
    ys = m(xs, t, ctxs)
    loss_of(ys).backward()
    for y, ref in zip(res["ys"], ys):
        assert rel_err(y, ref.detach()) < 1e-5
    for n, p in m.named_parameters():
        assert rel_err(res["grads"][n], p.grad) < 1e-4, n


# ---------------------------------------------------------------- through a DeepSpeed ZeRO-3 engine

def _zero3_worker(rank, world, port, result_path):
    """The packed call through deepspeed.initialize (ZeRO-3, one gloo rank) against the plain module."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    cfg = gloo_rank(rank, world, port)  # spawned with world 1
    ref, m = perturbed_model(cfg), perturbed_model(cfg)
    conf = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=m, config=conf, model_parameters=m.parameters())
    xs, t, ctxs = packed_inputs(cfg)
    ys = engine(xs, t, ctxs)
    engine.backward(loss_of(ys))
    ys_ref = ref(xs, t, ctxs)
    loss_of(ys_ref).backward()
    torch.save({"out": max(rel_err(a.detach(), b.detach()) for a, b in zip(ys, ys_ref)),
                "grad": max(rel_err(safe_get_full_grad(p), q.grad) for p, q in zip(engine.module.parameters(),
                                                                                    ref.parameters()))}, result_path)


def spawn(worker, world, tmp_path):
    """Run worker(rank, world, port, result_path) on `world` processes; returns what rank 0 saved."""
    port = master_port()
    out = str(tmp_path / "result.pt")
    spawn_ranks(worker, world, port, out)
    return torch.load(out)


@pytest.mark.slow
def test_packed_through_zero3_engine(tmp_path):
    pytest.importorskip("deepspeed")
    res = spawn(_zero3_worker, 1, tmp_path)
    assert res["out"] < 1e-5 and res["grad"] < 1e-5, res


# ---------------------------------------------------------------- the GPU benchmark's CPU smoke mode

@pytest.mark.slow
def test_packed_bench_smoke(tmp_path):
    """bench/model/packed_model.py end to end on CPU (tiny model and shapes): every case runs, the JSON has the
    summary the GPU run is read from."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PACKED_SMOKE="1", PYTHONPATH=root)
    subprocess.run([sys.executable, "bench/model/packed_model.py", "--out", str(tmp_path), "--reps", "1", "--pairs", "3"],
                   cwd=root, env=env, check=True, capture_output=True, timeout=300)
    (path,) = tmp_path.glob("packed-model-*.json")
    res = json.loads(path.read_text())
    assert {"date", "device", "torch"} <= set(res)
    assert res["output_check"]["max_rel_err_packed_vs_alone"] < 0.02
    assert [a["pack"] for a in res["attention"]] == ["mixed", "image-heavy"] and "dense_per_group_ms" in res["attention"][0]
    assert len(res["cases"]) == 13  # checkpointed: 2 mixed, 3 sweep points, 2 image-heavy; plain: 2 sweep points
    assert all(c["status"] == "ok" for c in res["cases"]), res["cases"]
    for s in res["summary"]:
        assert {"mixed_packed_ms", "mixed_separate_ms", "image_heavy_vs_best"} <= set(s), s
        assert s["mixed_paired_speed"] > 0 and s["image_heavy_paired_vs_best"] > 0, s
    assert len(res["paired"]) == 4 and all(len(p["pairs"]) == 3 for p in res["paired"])  # 2 modes x 2 targets
    for p in res["paired"]:  # ABBA: the ratio is tokens/s of a over b from the same pair's times
        assert p["ratio_median"] == sorted(x["ratio"] for x in p["pairs"])[1]


@pytest.mark.slow
def test_packed_engine_bench_smoke(tmp_path):
    """bench/model/packed_engine.py on CPU (tiny model, one ZeRO-2 engine): --cases runs only the comparison asked
    for, in ABBA pairs, and the JSON carries what the GPU run is read from; an unknown case is refused by name."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PACKED_SMOKE="1", PYTHONPATH=root)
    cmd = [sys.executable, "bench/model/packed_engine.py", "--out", str(tmp_path), "--pairs", "2"]
    bad = subprocess.run(cmd + ["--cases", "mixed,videos"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--cases: unknown ['videos']" in bad.stderr
    subprocess.run(cmd + ["--cases", "image-heavy,image-heavy-equal,mixed-split,mixed-small,mixed-plain"], cwd=root,
                   env=env, check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "packed-engine-ds_zero2_bf16.json").read_text())
    assert {"date", "device", "torch", "deepspeed"} <= set(res["env"])
    c, eq, split, small, plain = res["comparisons"]  # in the order asked for
    # the mixed pack through a bare copy of the model, the others through the engine
    assert plain["name"].startswith("mixed-plain") and plain["through"] == "bare model", plain
    assert {x["through"] for x in (c, eq, split, small)} == {"engine"}
    assert plain["micro_batches_b"] == 3 and len(plain["pairs"]) == 2 and plain["ratio_median"] > 0, plain
    # the small mix against one micro-batch per shape (packed_model's uncheckpointed mix: 2 shapes in the smoke run)
    assert small["name"].startswith("mixed-small") and small["micro_batches_b"] == 2, small
    assert small["tokens_a"] == small["tokens_b"] > 0 and len(small["pairs"]) == 2, small
    # the mixed pack against itself, with the projections' gradients concatenated
    assert split["name"].startswith("mixed packed: split") and len(split["pairs"]) == 2, split
    assert split["tokens_a"] == split["tokens_b"] and split["micro_batches_b"] == 1, split
    assert c["name"].startswith("image-heavy packed / images-B") and len(c["pairs"]) == 2, c
    # the same mix scaled to the one-shape batch's tokens
    assert eq["name"].startswith("image-heavy ") and eq["tokens_b"] == c["tokens_b"], eq
    assert abs(eq["tokens_a"] / eq["tokens_b"] - 1) < 0.1 < abs(c["tokens_a"] / c["tokens_b"] - 1), (c, eq)
    assert c["tokens_a"] > 0 and c["tokens_b"] > 0 and c["micro_batches_b"] == 1
    for p in c["pairs"]:  # tokens/s of packed over its comparison, from the same pair's times (stored to 0.1 ms)
        want = c["tokens_a"] / p["a_fwd_bwd_ms"] / (c["tokens_b"] / p["b_fwd_bwd_ms"])
        assert p["ratio"] == pytest.approx(want, rel=0.01)
    assert c["ratio_median"] == pytest.approx(sum(p["ratio"] for p in c["pairs"]) / 2, abs=1e-5)
    for i, p in enumerate(c["pairs"]):  # each side's wall span, in the pair's ABBA order
        first, second = (p["a_wall"], p["b_wall"]) if i % 2 == 0 else (p["b_wall"], p["a_wall"])
        assert first[0] < first[1] <= second[0] < second[1], p
        assert "a_gpu" not in p  # no nvidia-smi here


def test_packed_engine_gives_each_side_its_gpu_samples(tmp_path):
    """packed_engine.gpu_by_side: each pair's side gets the mean SM clock and power of the nvidia-smi samples inside
    its wall span (bench/mfu_e2e's reader), so a power-capped side shows; a side with no sample gets nothing."""
    import datetime
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("packed_engine", os.path.join(root, "bench/model/packed_engine.py"))
    pe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pe)
    t0 = datetime.datetime(2026, 12, 5, 6, 0, 0, tzinfo=datetime.timezone.utc)
    rows = ["timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], temperature.gpu, power.draw [W], "
            "utilization.gpu [%], memory.used [MiB], clocks_event_reasons.active"]
    for i, (mhz, watts, reason) in enumerate([(1980, 650.0, 0), (1960, 660.0, 0), (1700, 699.0, 4), (1720, 700.0, 4)]):
        t = t0 + datetime.timedelta(seconds=i)
        rows.append(f"{t.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz} MHz, 3201 MHz, 60, {watts:.2f} W, 100 %, "
                    f"90000 MiB, 0x{reason:016x}")
    csv = tmp_path / "gpu.csv"
    csv.write_text("\n".join(rows) + "\n")
    s = t0.timestamp()
    res = {"comparisons": [{"pairs": [{"a_wall": [s - 0.5, s + 1.5], "b_wall": [s + 1.5, s + 3.5]},
                                      {"a_wall": [s + 10, s + 11], "b_wall": [s + 11, s + 12]}]}]}
    pe.gpu_by_side(res, str(csv))
    first, late = res["comparisons"][0]["pairs"]
    assert first["a_gpu"] == {"sm_mhz": 1970, "power_w": 655.0, "power_capped": False, "samples": 2}
    assert first["b_gpu"] == {"sm_mhz": 1710, "power_w": 699.5, "power_capped": True, "samples": 2}
    assert "a_gpu" not in late and "b_gpu" not in late


def test_checkpointing_the_first_k_blocks_keeps_outputs_and_gradients(monkeypatch):
    """checkpoint_blocks = k checkpoints the first k blocks only; numerics equal no checkpointing."""
    import copy

    from ds_adaptiveload.model import WanConfig, WanModel, wan

    cfg = WanConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=3, text_dim=16, text_len=4, freq_dim=16)
    torch.manual_seed(0)
    ref = WanModel(cfg)
    with torch.no_grad():
        ref.head.head.weight.normal_(std=0.02)
    x, t, ctx = torch.randn(2, 16, 1, 4, 4), torch.tensor([10.0, 500.0]), torch.randn(2, 3, 16)
    wrapped, outs = [], []
    real = wan.checkpoint
    monkeypatch.setattr(wan, "checkpoint", lambda fn, *a, **kw: wrapped.append(fn) or real(fn, *a, **kw))
    for k in (0, 2, True):
        m = copy.deepcopy(ref)
        m.checkpoint_blocks = k
        wrapped.clear()
        y = m(x, t, ctx)
        y.square().sum().backward()
        assert wrapped == list(m.blocks)[:{0: 0, 2: 2, True: 3}[k]]
        outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    for y, g in outs[1:]:
        torch.testing.assert_close(y, outs[0][0])
        for a, b in zip(g, outs[0][1]):
            torch.testing.assert_close(a, b)
