"""model/compile.py's compile_regions: the blocks' elementwise steps compiled one by one match eager (outputs and
every gradient, fp32) on packed micro-batches of any composition, with and without checkpointing (the attention
policy included), and the number of graphs does not grow with the number of shape groups, which is what
compile_blocks' graphs depend on. aot_eager runs dynamo and AOTAutograd without code generation; one test runs
inductor on the CPU (small graphs: seconds), and a CUDA test runs it on the GPU."""
import copy

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.compile import (bind_regions, compile_blocks, compile_kind, compile_regions, compile_stats,
                                           region_fns, uncompile_blocks)
from ds_adaptiveload.model.layout import BlockFns
from ds_adaptiveload.model.wan import LayerNorm, RMSNorm
from tests.test_compile_blocks import PACKS, RUN_PACKS, check_against_eager, run_packed, tiny

# PACKS (2 and 3 groups, with and without groups of one sample), then packs of 1, 4 and 5 groups
MORE = [[((1, 4, 6), 1)], [((1, 8, 8), 5)],
        [((1, 4, 6), 2), ((1, 8, 8), 1), ((2, 4, 4), 2), ((3, 6, 8), 1)],
        [((1, 4, 6), 1), ((1, 8, 8), 2), ((2, 4, 4), 1), ((3, 6, 8), 2), ((1, 6, 8), 3)]]


# A bound whatever the composition: per-group steps (RoPE with and without autograd: over whole tensors
# packed_ops._PackedRope calls it in its forward; RoPE's gradient into dq and dk; the gated add, and its forward and
# backward into a packed output, the backward as two graphs: gated_dy_into, gate_grad) specialise sizes of 1,
# storage offsets of 0 and bases of one sample (2 to 3 graphs each), RMSNorm token rows, contexts and one-sample
# contexts, LayerNorm 1
MAX_GRAPHS = 24


@pytest.mark.parametrize("checkpoint_blocks,policy", [(False, "full"), (True, "full"), (True, "attention")])
def test_regions_match_eager_and_graphs_do_not_grow_with_groups(checkpoint_blocks, policy):
    torch._dynamo.reset()
    eager = tiny(checkpoint_blocks)
    eager.checkpoint_policy = policy
    comp = copy.deepcopy(eager)
    assert compile_regions(comp, backend="aot_eager") == 3
    graphs = check_against_eager(eager, comp, PACKS + [MORE[3], MORE[0], MORE[1], MORE[2], PACKS[5], PACKS[2]])
    # after the first packs that hold groups of several samples and of one, a pack whose first group holds one
    # sample (MORE[3]: a view at storage offset 0 with a size of 1, in the whole-tensor gated add), a one-sample
    # micro-batch (MORE[0]: sizes of 1 everywhere) and one group of several (MORE[1]: the per-group gated add, which
    # only one-group micro-batches run), packs of 1 to 5 groups add no graph
    seen = len(PACKS) + 3
    assert graphs[seen - 1] == graphs[-1] <= MAX_GRAPHS, graphs
    st = compile_stats()
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


def test_regions_under_inductor_on_cpu_match_eager():
    """The inductor code of the regions (mix-order reduction off, as for compile_blocks) with the attention policy."""
    torch._dynamo.reset()
    eager = tiny(True)
    eager.checkpoint_policy = "attention"
    comp = copy.deepcopy(eager)
    compile_regions(comp)
    # inductor also specialises a group view's storage offset of 0 (the first group) and the size of 1 of a view's
    # base (the per-sample tensors of a one-sample micro-batch): after a pack whose first group holds several
    # samples, one whose first holds one, a one-sample micro-batch and a one-group one, packs of 1 to 5 groups add
    # no graph
    graphs = check_against_eager(eager, comp, [PACKS[4], MORE[3], MORE[0], MORE[1], MORE[2], PACKS[2], PACKS[5]])
    assert graphs[3] == graphs[-1] <= MAX_GRAPHS, graphs


def test_regions_with_runs_of_equal_token_groups_match_eager():
    """Runs of several groups: each group's rotation written into its rows of the run (the rope_qk_into region)."""
    torch._dynamo.reset()
    eager = tiny(True)
    eager.checkpoint_policy = "attention"
    comp = copy.deepcopy(eager)
    compile_regions(comp, backend="aot_eager")
    graphs = check_against_eager(eager, comp, RUN_PACKS + RUN_PACKS[::-1])
    assert graphs[1] == graphs[-1] <= MAX_GRAPHS, graphs
    assert compile_stats()["graph_breaks"] == 0


def test_regions_and_blocks_exclude_each_other_and_uncompile_restores_eager():
    m = tiny()
    compile_regions(m, backend="aot_eager")
    norms = [x for x in m.blocks.modules() if isinstance(x, (RMSNorm, LayerNorm))]
    assert norms and all("forward" in x.__dict__ for x in norms)
    with pytest.raises(UserError, match="compile_regions"):
        compile_blocks(m, backend="aot_eager")
    uncompile_blocks(m)
    assert all("forward" not in x.__dict__ for x in norms) and m._block_fns == BlockFns()
    bind_regions(m, region_fns(backend="aot_eager"))  # the switch back and forth between eager and regions
    assert all("forward" in x.__dict__ for x in norms) and m._block_fns == region_fns(backend="aot_eager")[0]
    bind_regions(m, None)
    assert all("forward" not in x.__dict__ for x in norms) and m._block_fns == BlockFns()
    compile_blocks(m, backend="aot_eager")
    with pytest.raises(UserError, match="compile_blocks"):
        compile_regions(m, backend="aot_eager")
    with pytest.raises(UserError, match="WanModel"):
        compile_regions(torch.nn.Linear(2, 2))


def test_compile_kind():
    assert compile_kind("auto") == compile_kind(True) == compile_kind("regions") == "regions"
    assert compile_kind("block") == "block"
    with pytest.raises(UserError, match="--compile-blocks 'whole'"):
        compile_kind("whole")


@pytest.mark.cuda
def test_inductor_regions_match_eager_on_gpu(monkeypatch):
    """Packed micro-batches of 1 to 5 groups through inductor-compiled regions on the GPU: every gradient as
    eager's (TF32 off), and no graph added past the first kinds."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    eager = tiny(True).cuda()
    eager.checkpoint_policy = "attention"
    comp = copy.deepcopy(eager)
    compile_regions(comp)
    graphs = []
    for i, pack in enumerate(PACKS + MORE):
        _, g0 = run_packed(eager, pack, i, "cuda")
        _, g1 = run_packed(comp, pack, i, "cuda")
        err = {n: float((g1[n] - ref).norm() / ref.norm().clamp_min(1e-12)) for n, ref in g0.items()}
        bad = {n: e for n, e in err.items() if not e < 1e-3}
        assert not bad, f"pack {i}: relative gradient errors over 1e-3: {bad}"
        graphs.append(compile_stats()["block_graphs"])
    assert graphs[-1] <= MAX_GRAPHS, graphs
