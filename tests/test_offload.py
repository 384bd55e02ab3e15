"""Activation offload of checkpointed block inputs (model/offload.py): the same gradients as without it, the inputs'
bytes moved, only checkpointed blocks' inputs, and (on CUDA) less device memory at the peak."""
import math
import os

import pytest
import torch

from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.model.offload import BlockInputOffload
from ds_adaptiveload.train import flow
from tests.launcher import needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
SHAPES = [(1, 4, 4), (3, 4, 4), (2, 2, 6)]


def _inputs(device="cpu"):
    g = torch.Generator().manual_seed(5)
    x0s = [torch.randn(TINY.in_dim, *s, generator=g).to(device) for s in SHAPES]
    texts = [torch.randn(4, TINY.text_dim, generator=g).to(device) for _ in SHAPES]
    eps = [torch.randn(x.shape, generator=g).to(device) for x in x0s]
    return x0s, texts, eps, torch.rand(len(SHAPES), generator=g).to(device)


def _grads(model, inputs):
    model.zero_grad()
    loss = flow.packed_flow_matching_loss(model, *inputs).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_offloaded_inputs_give_the_same_gradients(policy):
    torch.manual_seed(0)
    model = WanModel(TINY, checkpoint_blocks=True, checkpoint_policy=policy)
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    inputs = _inputs()
    loss0, g0 = _grads(model, inputs)
    assert model._offload.stats()["tensors"] == 0
    model.offload_blocks = 1  # the first checkpointed block only
    loss1, g1 = _grads(model, inputs)
    tokens = sum(s[0] * s[1] * s[2] // 4 for s in SHAPES)
    stats = model._offload.stats()
    assert stats["tensors"] == 1 and stats["bytes"] == tokens * TINY.dim * 4  # block 0's input [T, dim] fp32
    model.offload_blocks = TINY.num_layers
    loss2, g2 = _grads(model, inputs)
    assert model._offload.stats() == {"tensors": TINY.num_layers, "bytes": TINY.num_layers * tokens * TINY.dim * 4}
    assert loss0 == loss1 == loss2 and g0.keys() == g1.keys() == g2.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]) and torch.equal(g0[n], g2[n]), n


def test_no_offload_without_checkpointing_or_grad():
    torch.manual_seed(0)
    model = WanModel(TINY, checkpoint_blocks=1)
    model.offload_blocks = TINY.num_layers  # only the one checkpointed block can offload
    _grads(model, _inputs())
    assert model._offload.stats()["tensors"] == 1
    x0s, texts, _, t = _inputs()
    with torch.no_grad():
        model.offload_blocks = 2
        model(x0s, t * 1000, texts, flat=True)
    assert model._offload.stats()["tensors"] == 1  # untouched: no forward under no_grad begins a new record


def test_only_the_block_input_moves():
    off = BlockInputOffload()
    x, other = torch.arange(3000, dtype=torch.float32), torch.ones(3000)
    with off.hooks(x):
        assert off.pack(other) is other and off.unpack(other) is other
        packed = off.pack(x)
    assert packed is not x and torch.equal(off.unpack(packed), x) and off.stats()["tensors"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory, side stream)")
def test_cuda_offload_lowers_the_peak_and_keeps_gradients():
    cfg = WanConfig(**{**TINY.to_dict(), "dim": 512, "num_heads": 4, "ffn_dim": 1024, "num_layers": 6})
    torch.manual_seed(0)
    model = WanModel(cfg, checkpoint_blocks=True).cuda()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    g = torch.Generator().manual_seed(1)
    x0s = [torch.randn(cfg.in_dim, 9, 32, 32, generator=g).cuda()]
    inputs = (x0s, [torch.randn(4, cfg.text_dim).cuda()], [torch.randn_like(x0s[0])], torch.rand(1).cuda())
    peaks, grads = [], []
    for k in (0, cfg.num_layers):
        model.offload_blocks = k
        _grads(model, inputs)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads.append(_grads(model, inputs)[1])
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    tokens = 9 * 16 * 16
    assert peaks[0] - peaks[1] > 0.5 * (cfg.num_layers - 1) * tokens * cfg.dim * 4, peaks
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["regions", "block"])
def test_offload_with_compiled_blocks(kind):
    """Compiled regions or blocks (aot_eager: traced, no code generation) with offloaded inputs: the eager gradients."""
    from ds_adaptiveload.model.compile import apply_compile

    torch.manual_seed(0)
    eager = WanModel(TINY, checkpoint_blocks=True)
    torch.nn.init.normal_(eager.head.head.weight, std=0.02)
    compiled = WanModel(TINY, checkpoint_blocks=True)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled, kind, backend="aot_eager")
    compiled.offload_blocks = TINY.num_layers
    inputs = _inputs()
    _, want = _grads(eager, inputs)
    got = {k.replace("_orig_mod.", ""): v for k, v in _grads(compiled, inputs)[1].items()}
    assert compiled._offload.stats()["tensors"] == TINY.num_layers and got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_set_checkpointing_carries_the_offload_count():
    """The loader's 4th count reaches the model through set_checkpointing; a call without it leaves the count."""
    model = WanModel(TINY, checkpoint_blocks=True)
    model.set_checkpointing(2, 2, 0, 1)
    assert (model.checkpoint_blocks, model.offload_blocks) == (2, 1)
    model.set_checkpointing(1, policy="full")
    assert model.offload_blocks == 1


@needs_launcher
def test_two_rank_cpu_run_offloads_two_blocks(tmp_path):
    """`--checkpoint-blocks --activation-offload 2` through the deepspeed launcher, 2 CPU ranks, ZeRO-3, the tiny
    model: it trains 2 steps with a finite loss, the start-up line names the offload, and each step's log counts
    the block inputs moved. On the CPU the offload is a plain copy to host memory (no pinned memory, no side
    stream): the hooks, the counts and the copies back are what run; the overlap is CUDA's (test above)."""
    from tests.test_train import check, launch, steps, test_config

    out = tmp_path / "run"
    proc = launch(out, "--synthetic", "--synthetic-num", "16", "--max-steps", "2", "--checkpoint-blocks",
                  "--activation-offload", "2", config=test_config(tmp_path))
    check(proc)
    assert "activation offload: 2 blocks keep their input in pinned host memory" in proc.stdout + proc.stderr
    for rank in (0, 1):
        log = steps(out, rank)
        assert [r["step"] for r in log] == [1, 2]
        for rec in log:
            assert math.isfinite(rec["loss"])
            assert rec["offload_blocks"] == [TINY.num_layers] * 2  # G = 2 micro-batches, both blocks each
            assert rec["offload_mib"] > 0
