"""Regional torch.compile of the Wan DiT, with the token, sample and group sizes dynamic, so inductor fuses the
elementwise chains (fp32 RoPE, RMSNorm, gates, casts) between the matmuls while the embeddings, head and loop stay
eager. Two granularities: compile_blocks compiles each WanBlock's forward whole; compile_regions (the default of
--compile-blocks; section "regions" below) compiles only those chains, one graph each, so that the graphs do not
depend on how many shape groups a packed micro-batch holds.

One compiled function serves every block: WanBlock.forward is compiled once and bound to each block, and
dynamo treats the parameters of inlined nn.Modules as graph inputs, so 30 blocks share one cache entry
instead of compiling 30 times. Only forward is compiled, not the module call, so module hooks (DeepSpeed
ZeRO-3's parameter gathering) run eagerly around it; under ZeRO-3 make WanBlock a leaf module
(train/build.py) so that no hook sits on a submodule inside the compiled region.

Inductor's mix-order reduction is switched off for these graphs (INDUCTOR_OPTIONS). With it on (the default
since torch 2.10), the backward of the AdaLN chain sums each scale/shift gradient out of a workspace into a new
tensor instead of into its slice of the [n, 6, dim] modulation gradient, so those slices are never written:
pytorch/pytorch#193061. On the H200 (torch 2.11) that left blocks.*.modulation and the time embedding with
gradients off by 0.4 to 2,400 times their norm, varying from call to call (bench/model/compile_numerics.py,
2026-12-01).
"""
import types
from dataclasses import dataclass
from typing import Optional

import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.layout import (BlockFns, gate_grad, gated_add, gated_add_into, gated_dy_into,
                                          rope_grad_into, rope_qk, rope_qk_into)
from ds_adaptiveload.model.wan import LayerNorm, RMSNorm, WanBlock, WanModel

# WanBlock.forward(x, e0, context, lay): argument position -> dims to mark dynamic.
# x [T, dim] packed token rows, e0 [n, 6, dim], context [n, text_len, dim]; the Layout's per-group RoPE
# tables cos/sin [1, S_g, 1, head_dim/2] and size tensors [n_g, local_g, 0] are marked in _mark. The blocks read
# group sizes only from those shapes, so the graph depends on the number of shape groups, on which of them hold a
# single sample (torch specialises sizes of 1) and on save_attention (tests/test_compile_blocks.py counts them).
_DYNAMIC_DIMS = ((0, (0,)), (1, (0,)), (2, (0,)))

# Graphs dynamo may hold for WanBlock.forward: one per kind of micro-batch (above), more than dynamo's default of 8
# on a mixed run. Past the limit dynamo runs the block eagerly, whose activations the compiled memory model does
# not cover (an out-of-memory at step 2 on the H200, 2026-12-01).
RECOMPILE_LIMIT = 64

# Inductor options for the compiled blocks: no mix-order reduction (module docstring, pytorch/pytorch#193061).
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}

# The regions that write into a group's rows (model/packed_ops.py) get row views at symbolic storage offsets,
# which inductor cannot prove 16-byte aligned, so it does not vectorize them. With this option it assumes
# alignment and clones a misaligned input (copying a mutated one back): results stay right. On the H200, with the
# gate's gradient as a graph of its own, the mixed pack's compiled time fell from 634 to 572 ms, as low as one
# shape per micro-batch (bench/results/archive/packed-profile-2026-12-02-h200-s9-split.json).
INTO_OPTIONS = {"assume_aligned_inputs": True}


@dataclass(frozen=True)
class CompileOptions:
    """How compile_blocks compiles WanBlock.forward."""
    dynamic: bool = True
    """Mark the token, sample and group-size dims dynamic, so one graph serves every micro-batch with the same
    number of shape groups and the same groups of one sample (tests/test_compile_blocks.py counts the graphs);
    False: static shapes."""
    fullgraph: bool = False
    """Fail on a graph break instead of splitting the block (tests use True to prove the block traces whole)."""
    mode: Optional[str] = None
    """torch.compile mode (None, 'max-autotune-no-cudagraphs', ...)."""
    backend: str = "inductor"
    """torch.compile backend ('aot_eager' traces without code generation: CPU tests)."""
    inductor: Optional[dict] = None
    """More inductor options on top of INDUCTOR_OPTIONS (benchmarks A-B them: bench/model/packed_profile.py)."""


def _mark(args):
    for pos, dims in _DYNAMIC_DIMS:
        if pos < len(args) and isinstance(args[pos], torch.Tensor):
            for d in dims:
                if d < args[pos].ndim:
                    torch._dynamo.maybe_mark_dynamic(args[pos], d)
    lay = args[3] if len(args) > 3 else None
    for table in getattr(lay, "rope", ()):
        for t in table:
            if isinstance(t, torch.Tensor) and t.ndim > 1:
                torch._dynamo.maybe_mark_dynamic(t, 1)
    for t in getattr(lay, "sizes", None) or ():  # [n_g, local, 0]: the group sizes
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 1)


def _mode_and_options(opts: CompileOptions) -> dict:
    """torch.compile's mode / options keywords. It takes one or the other, so under inductor a mode is passed as
    its options (torch._inductor.list_mode_options) with INDUCTOR_OPTIONS on top; they then apply to the
    backward's compilation too."""
    if opts.backend != "inductor":
        return {"mode": opts.mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(opts.mode or "default", opts.dynamic), **INDUCTOR_OPTIONS,
                        **(opts.inductor or {})}}


def engine_compile_kwargs(backend: str = "inductor") -> dict:
    """torch.compile keywords for a whole-model compile (DeepSpeed's engine.compile): the same inductor options."""
    return _mode_and_options(CompileOptions(backend=backend))


def block_forward(dynamic: bool = True, fullgraph: bool = False, mode: Optional[str] = None,
                  backend: str = "inductor"):
    """A compiled WanBlock.forward(self, x, e0, context, lay) to bind to any number of blocks
    (compile_blocks binds it; a caller that wraps blocks further, e.g. in checkpointing, binds it itself)."""
    opts = CompileOptions(dynamic=dynamic, fullgraph=fullgraph, mode=mode, backend=backend)
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    compiled = torch.compile(WanBlock.forward, dynamic=None if opts.dynamic else False,
                             fullgraph=opts.fullgraph, backend=opts.backend, **_mode_and_options(opts))

    def forward(self, *args, **kwargs):
        if opts.dynamic:
            _mark(args)  # before dynamo sees the tensors: the first graph is already dynamic in S
        return compiled(self, *args, **kwargs)

    return forward


def compile_blocks(model: torch.nn.Module, dynamic: bool = True, fullgraph: bool = False, mode: Optional[str] = None,
                   backend: str = "inductor") -> int:
    """Bind one compiled WanBlock.forward to every WanBlock under `model` (a WanModel, or a DeepSpeed engine
    holding one). Returns the number of blocks. Idempotent: compiled blocks are left as they are."""
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"compile_blocks: model must be an nn.Module, got {type(model).__name__}")
    blocks = [m for m in model.modules() if isinstance(m, WanBlock)]
    if not blocks:
        raise UserError("compile_blocks: model has no WanBlock")
    if any("forward" in m.__dict__ for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))):
        raise UserError("compile_blocks: the blocks' regions are compiled (compile_regions); uncompile_blocks first")
    forward = block_forward(dynamic, fullgraph, mode, backend)
    for b in blocks:
        if "forward" not in b.__dict__:  # an instance attribute: this block is compiled already
            b.forward = types.MethodType(forward, b)
    return len(blocks)


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Back to eager blocks, from compile_blocks or compile_regions (compiled code stays cached for later)."""
    for m in model.modules():
        if isinstance(m, WanBlock):
            m.__dict__.pop("forward", None)
        _unbind_region(m)
        if isinstance(m, WanModel):
            m.set_block_fns(None)


# -- regions: the block eager, its elementwise steps compiled one by one -----------------------------------------
# compile_blocks' graphs depend on how many shape groups a micro-batch holds and which hold one sample: a packed
# micro-batch of the video-heavy mix holds 8 to 19 groups, so nearly every packed micro-batch is a new graph (and
# the 64th would run eagerly). compile_regions compiles what inductor fuses (the fp32 chains between GEMMs) as
# separate graphs: per group RoPE of q and k and the gated residual add (its forward and backward written into the
# group's rows where a micro-batch holds several groups: model/packed_ops.py), over all tokens the RMSNorms and the
# LayerNorm; the GEMMs, the loops over groups and attention run eagerly. The graphs then depend only on the
# tensors' ranks and sizes of 1, whatever the composition (tests/test_compile_regions.py counts them).

_REGIONS = {}


def compile_region(fn, opts: CompileOptions):
    """fn compiled on its own (fullgraph), every dim of its tensor arguments but the last marked dynamic before
    the call: token, sample and head counts symbolic, channels static."""
    compiled = torch.compile(fn, dynamic=None, fullgraph=True, backend=opts.backend, **_mode_and_options(opts))

    def run(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                for d in range(a.ndim - 1):
                    torch._dynamo.maybe_mark_dynamic(a, d)
        return compiled(*args)

    return run


_FP8_LAYERS = "ds_adaptiveload.model.fp8_layers"
_REGION_METHODS = ("forward", "project")  # what bind_regions binds on a module (project: Float8RowsLinear's GEMM)


def fp8_region_fns(opts: CompileOptions) -> dict:
    """{fp8 layer class: (method, compiled function)} once a model was converted to fp8 in this process (model/fp8.py
    imports fp8_layers), else {}. torchao's rowwise casts (row amax, scale, cast to e4m3) are elementwise passes over
    each GEMM's input; eager they are several kernels each, compiled inductor fuses them (with ffn.2's GELU), which
    the fp8 GEMMs need to pay off. RowsLinear's list of parts is merged eagerly, then the same GEMM region runs."""
    import sys

    layers = sys.modules.get(_FP8_LAYERS)
    if layers is None:
        return {}
    gemm = compile_region(layers.Float8Linear.forward, opts)
    return {layers.Float8Linear: ("forward", gemm), layers.Float8RowsLinear: ("project", gemm),
            layers.Float8GeluLinear: ("forward", compile_region(layers.Float8GeluLinear.forward, opts))}


def region_fns(mode: Optional[str] = None, backend: str = "inductor") -> tuple:
    """(BlockFns of compiled per-group steps, {module class: (method, compiled function)}: the norms' forwards, and
    the fp8 layers' once a model was converted: fp8_region_fns), made once per (mode, backend); the fp8 entries are
    added when they first exist, the others kept (the same compiled functions, so no graph compiles twice)."""
    key = (mode, backend)
    opts = CompileOptions(mode=mode, backend=backend)
    if key not in _REGIONS:
        into = CompileOptions(mode=mode, backend=backend, inductor=INTO_OPTIONS)
        fns = BlockFns(rope_qk=compile_region(rope_qk, opts), rope_qk_into=compile_region(rope_qk_into, into),
                       rope_grad_into=compile_region(rope_grad_into, into),
                       gated_add=compile_region(gated_add, opts),
                       gated_add_into=compile_region(gated_add_into, into),
                       gated_dy_into=compile_region(gated_dy_into, into), gate_grad=compile_region(gate_grad, opts))
        _REGIONS[key] = (fns, {RMSNorm: ("forward", compile_region(RMSNorm.forward, opts)),
                               LayerNorm: ("forward", compile_region(LayerNorm.forward, opts))})
    fns, methods = _REGIONS[key]
    if len(methods) == 2:  # the norms only: add the fp8 layers' where they exist now
        methods.update(fp8_region_fns(opts))
    return _REGIONS[key]


def compile_regions(model: torch.nn.Module, mode: Optional[str] = None, backend: str = "inductor") -> int:
    """Compile the elementwise steps of every WanBlock under `model` (a WanModel or an engine holding one) as
    separate graphs, the blocks otherwise eager (module calls and their hooks unchanged, so ZeRO-3 without
    leaf blocks works). Returns the number of blocks. Not together with compile_blocks."""
    wans = [m for m in model.modules() if isinstance(m, WanModel)] if isinstance(model, torch.nn.Module) else []
    if not wans:
        raise UserError(f"compile_regions: expected a WanModel or a module holding one, got {type(model).__name__}")
    if any("forward" in b.__dict__ for w in wans for b in w.blocks if isinstance(b, WanBlock)):
        raise UserError("compile_regions: the blocks are compiled whole (compile_blocks); uncompile_blocks first")
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    regions = region_fns(mode, backend)
    for w in wans:
        bind_regions(w, regions)
    return sum(len(w.blocks) for w in wans)


def bind_regions(wan: WanModel, regions: Optional[tuple]) -> None:
    """Give one WanModel's blocks region_fns()'s compiled steps and norm forwards, or (None) take them back
    (eager again). The blocks' own forwards are left alone."""
    wan.set_block_fns(regions[0] if regions else None)
    for m in wan.blocks.modules():
        if regions and type(m) in regions[1]:
            method, fn = regions[1][type(m)]
            setattr(m, method, types.MethodType(fn, m))
        elif not regions:
            _unbind_region(m)


def _unbind_region(m: torch.nn.Module) -> None:
    """A norm's or fp8 layer's compiled method taken back (its class's own runs again)."""
    if isinstance(m, (RMSNorm, LayerNorm)) or type(m).__module__.startswith(("torchao.", _FP8_LAYERS)):
        for method in _REGION_METHODS:
            m.__dict__.pop(method, None)


COMPILE_KINDS = ("auto", "block", "regions")


def compile_kind(kind) -> str:
    """--compile-blocks KIND -> block or regions. auto (or True) takes regions: on the H200 they timed as fast as
    whole blocks or faster (480p 81f 46.9% MFU against 45.6%, 720p 81f 46.5% against 45.7%, 32 images 44.4%
    against 44.7%; docs/history/benchmarks.md), with a bound on their graphs whatever the micro-batch holds."""
    if kind is True or kind == "auto":
        return "regions"
    if kind not in COMPILE_KINDS:
        raise UserError(f"--compile-blocks {kind!r}: expected one of {', '.join(COMPILE_KINDS)}")
    return kind


def apply_compile(model: torch.nn.Module, kind: str, backend: str = "inductor") -> int:
    """compile_blocks (kind block) or compile_regions (kind regions) on model."""
    return (compile_regions if kind == "regions" else compile_blocks)(model, backend=backend)


def load_compile_cache(path) -> bool:
    """Load inductor's compiled artifacts saved by an earlier run (torch.compiler.load_cache_artifacts), so
    that the blocks' graphs compile from the cache instead of from scratch: on a fresh machine, or after a
    restart. False, with a warning, when the file is absent or does not load (another torch, say)."""
    import os
    import warnings

    if not path or not os.path.exists(path):
        return False
    with open(path, "rb") as f:
        data = f.read()
    try:
        torch.compiler.load_cache_artifacts(data)
    except Exception as err:  # noqa: BLE001 - a stale cache must not stop training; it only costs compile time
        warnings.warn(f"compile cache {path} not loaded ({type(err).__name__}: {err}); compiling from scratch",
                      stacklevel=2)
        return False
    return True


def save_compile_cache(path) -> int:
    """Write the artifacts compiled so far to `path` (atomically); returns the bytes written, 0 if none."""
    import os

    art = torch.compiler.save_cache_artifacts()
    if not art:
        return 0
    data = art[0]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp", path)
    return len(data)


def compile_stats() -> dict:
    """Graphs dynamo holds for the blocks: WanBlock.forward (compile_blocks) plus the regions' functions
    (compile_regions); recompiles = graphs - 1. And process-wide dynamo counters:
    unique graphs and graph breaks (by reason)."""
    from torch._dynamo.utils import counters

    codes = (WanBlock.forward, rope_qk, rope_qk_into, rope_grad_into, gated_add, gated_add_into, gated_dy_into,
             gate_grad, RMSNorm.forward, LayerNorm.forward)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        graphs = sum(len(_debug_get_cache_entry_list(f.__code__)) for f in codes)
    except (ImportError, AttributeError, TypeError):  # a private helper; absent in some versions
        graphs = None
    breaks = dict(counters["graph_break"])
    return {"block_graphs": graphs, "block_recompiles": None if graphs is None else max(graphs - 1, 0),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(breaks.values())), "graph_break_reasons": {k[:200]: v for k, v in breaks.items()}}
