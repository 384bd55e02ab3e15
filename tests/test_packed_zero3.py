"""Packed micro-batches under ZeRO-3 with several ranks (CPU, 2 gloo ranks): ranks whose micro-batches hold
different numbers of samples and shape groups, and checkpoint counts that change between micro-batches,
must keep issuing the same parameter all-gathers (a mismatch hangs); gradients equal one process."""
import os
import re
import subprocess
import sys

import pytest
import torch

from ds_adaptiveload.model import WanModel
from tests.launcher import master_port
from tests.test_model import perturbed_model, rel_err, tiny_cfg
from tests.test_packed import SHAPES, gloo_rank, loss_of, packed_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per micro-batch: each rank's sample shapes and the checkpoint count k (the same on both ranks). ZeRO-3
# runs micro-batch 1 untraced, records its module trace in 2 and replays it from 3 on: in 3 rank 0 matches
# the trace (3 samples, as recorded) while rank 1 (5 samples) does not, which hung before every packed
# forward had one output tensor. 5 and 6 change k on both ranks (each re-records the trace alike).
MICRO_BATCHES = [
    ([(1, 4, 4), (1, 4, 4)], [(1, 2, 6), (2, 2, 2)], 1),
    ([(1, 4, 4), (1, 2, 6), (2, 2, 2)], [(1, 4, 4), (1, 4, 4), (1, 4, 4)], 1),
    ([(1, 2, 6), (1, 2, 6), (2, 2, 2)], [(2, 2, 2), (1, 4, 4), (2, 2, 2), (1, 2, 6), (1, 2, 6)], 1),
    ([(2, 2, 2)] * 4, [(1, 4, 4), (1, 2, 6)], 1),
    ([(1, 2, 6), (1, 4, 4)], [(1, 4, 4)], 0),
    ([(1, 4, 4)], [(1, 4, 4), (2, 2, 2)], 2),
]


def test_flat_output_is_the_list_output_concatenated():
    """forward(..., flat=True) is the input-order list flattened into one tensor (also when grouping
    reorders the samples), split_flat gives the list back, and the gradients are the list form's."""
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    for shapes in (SHAPES, [(1, 6, 4)] * 3, [(1, 6, 4)]):
        xs, t, ctxs = packed_inputs(cfg, shapes=shapes)
        m.zero_grad()
        ys = m(xs, t, ctxs)
        loss_of(ys).backward()
        g_list = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        flat = m(xs, t, ctxs, flat=True)
        assert flat.ndim == 1 and torch.equal(flat, torch.cat([y.flatten() for y in ys]))
        split = WanModel.split_flat(flat, xs)
        assert all(torch.equal(a, b) for a, b in zip(split, ys))
        loss_of(split).backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, g_list[n], rtol=0, atol=0, msg=n)


def _checkpoint_loader(zero3, memory):
    """An AdaptiveLoader with just what its checkpoint counts read (2 dp ranks, no DataLoader, no collectives)."""
    from types import SimpleNamespace

    from ds_adaptiveload.loader import AdaptiveLoader
    from ds_adaptiveload.schedule.geometry import Geometry

    # sample i: one 64 x 64 (i + 1) frame, 16 (i + 1) tokens
    samples = [SimpleNamespace(frames=1, height=64, width=64 * (i + 1)) for i in range(8)]
    cfg = SimpleNamespace(checkpoint="auto-step" if zero3 else "auto", checkpoint_policy="full", sp=1)
    sampler = SimpleNamespace(samples=samples, profile=SimpleNamespace(geometry=Geometry()), cfg=cfg)
    return AdaptiveLoader(sampler, None, None, {}, 1, None, None, memory_model=(memory, 4))


def test_checkpoint_count_is_the_steps_largest_under_zero3():
    """--checkpoint-blocks auto: ZeRO-3 takes the largest count over every rank's micro-batches of the step
    (from the plan, the same on every rank); other stages keep each micro-batch's own count."""
    from types import SimpleNamespace

    from ds_adaptiveload.schedule.memory import blocks_to_checkpoint

    memory = {"capacity_bytes": 400, "safety": 1.0, "bytes_per_token": 1, "block_bytes_per_token": 2}
    rank_mbs = [[[0], [1, 2]], [[7], [3]]]                       # 2 ranks, G = 2
    for zero3 in (False, True):
        loader = _checkpoint_loader(zero3, memory)
        ks = [blocks_to_checkpoint(sum(loader._tokens(mb)), len(mb), memory, 4) for mbs in rank_mbs for mb in mbs]
        assert ks == [0, 2, 3, 2]                                # the micro-batches differ
        for rank in (0, 1):
            ps = SimpleNamespace(micro_batches=rank_mbs[rank], all_micro_batches=rank_mbs)
            got = [k for k, _, _ in loader._checkpoints(ps)]
            want = [max(ks)] * 2 if zero3 else ks[2 * rank:2 * rank + 2]
            assert got == want, (zero3, rank, got, want)


def _two_rank_worker(rank, world, port, result_path, regions=False):
    """Both ranks run MICRO_BATCHES through one ZeRO-3 engine (lr 0) and keep the dp-averaged full gradients
    (regions: with the blocks' elementwise steps compiled, aot_eager, around ZeRO-3's module hooks)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    cfg = gloo_rank(rank, world, port)
    m = perturbed_model(cfg)
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=m, config=conf, model_parameters=m.parameters())
    if regions:
        from ds_adaptiveload.model.compile import compile_regions

        compile_regions(engine, backend="aot_eager")
    grads = []
    for i, mb in enumerate(MICRO_BATCHES):
        xs, t, ctxs = packed_inputs(cfg, shapes=mb[rank], seed=10 * i + rank)
        engine.module.checkpoint_blocks = mb[2]
        engine.backward(loss_of(WanModel.split_flat(engine(xs, t, ctxs, flat=True), xs)))
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
    if regions:
        from ds_adaptiveload.model.compile import compile_stats

        assert compile_stats()["block_graphs"] > 0  # the regions ran compiled
    if rank == 0:
        torch.save(grads, result_path)


def _two_rank_regions_worker(rank, world, port, result_path):
    _two_rank_worker(rank, world, port, result_path, regions=True)


def _spawn(worker, port, tmp_path, timeout=240):
    """worker on 2 ranks in a fresh interpreter, killed after `timeout` s (a hang fails, it does not block)."""
    out = tmp_path / "result.pt"
    code = (f"import tests.test_packed_zero3 as t, tests.launcher as l; "
            f"l.spawn_ranks(t.{worker.__name__}, 2, {port}, {str(out)!r})")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        pytest.fail(f"2 ZeRO-3 ranks still running after {timeout} s (a collective mismatch hangs):\n{log[-3000:]}")
    assert proc.returncode == 0, log[-5000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("worker", [_two_rank_worker, _two_rank_regions_worker], ids=["eager", "regions"])
def test_packed_zero3_two_ranks_match_one_process(tmp_path, worker):
    pytest.importorskip("deepspeed")
    got = _spawn(worker, master_port(), tmp_path)
    cfg = tiny_cfg()
    m = perturbed_model(cfg)
    for i, mb in enumerate(MICRO_BATCHES):
        m.checkpoint_blocks = mb[2]
        m.zero_grad()
        for rank in (0, 1):
            xs, t, ctxs = packed_inputs(cfg, shapes=mb[rank], seed=10 * i + rank)
            (loss_of(m(xs, t, ctxs)) / 2).backward()          # DeepSpeed averages over the 2 dp ranks
        for n, p in m.named_parameters():
            assert rel_err(got[i][n], p.grad) < 1e-5, (i, n)


# ---------------------------------------------------------------- launch/train_wan.py, 2 ranks, ZeRO-3

def _launch(out, cfg, *extra, timeout=180):
    """`deepspeed --num_gpus 2 launch/train_wan.py --synthetic ...` through test_reliability.launch (its own
    process group, killed whole on timeout: a rank stuck in a collective outlives the launcher, which fails the
    test); exits 0, returns its stdout."""
    from tests import test_reliability as rel

    if rel.DEEPSPEED is None:
        pytest.skip("deepspeed launcher not installed")
    proc = rel.launch(out, None, cfg, "--no-final-save", *extra, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_packed_policy_trains_under_zero3_on_two_ranks(tmp_path):
    """policy packed, ZeRO-3, 2 ranks, --checkpoint-blocks auto: 3 steps whose rounds give the ranks different
    sample counts and shape groups; finite losses, and the last step's gradient equals one process's."""
    import json
    import math

    from tests import test_train as tt

    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        al = json.load(f)["adaptive_load"]
    al.update(policy="packed")
    cfg = tt.test_config(tmp_path, scheduler=None, adaptive_load=al,
                         optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    out, dump = tmp_path / "run", tmp_path / "grads.pt"
    stdout = _launch(out, cfg, "--max-steps", "3", "--checkpoint-blocks", "auto", "--dump-grads", str(dump))
    # built inside zero.Init: rank 0 holds about half of every parameter from the start (ceil per tensor)
    held, total = (int(v.replace(",", "")) for v in re.search(
        r"model built partitioned \(zero.Init\), ([\d,]+) of ([\d,]+) parameter elements", stdout).groups())
    assert total > 0 and held <= total / 2 + 1000, (held, total)
    logs = [tt.steps(out, rank) for rank in (0, 1)]
    assert [len(log) for log in logs] == [3, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["rank_loss"]) for log in logs for r in log)
    with open(out / "synthetic" / "manifest.jsonl") as f:
        shape = {r["id"]: (r["frames"], r["height"], r["width"]) for r in map(json.loads, f)}
    rounds = [(a, b) for r0, r1 in zip(*logs) for a, b in zip(r0["ids"], r1["ids"])]
    groups = [tuple({shape[i]: None for i in mb}) for pair in rounds for mb in pair]
    assert any(len(a) != len(b) for a, b in rounds), "no round gave the ranks different sample counts"
    assert any(groups[2 * k] != groups[2 * k + 1] for k in range(len(rounds))), "no round differed in groups"
    assert any(len(g) > 1 for g in groups), "no micro-batch mixed shapes"
    tt.reference_check(out, dump, 1)
