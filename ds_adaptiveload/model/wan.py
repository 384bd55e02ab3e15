"""The Wan 2.1 text-to-video DiT, written from the published architecture.

Parameter names equal the original Wan 2.1 checkpoints (see convert.py for diffusers' names), so real
weights load with load_wan_checkpoint(). Shapes: latent x [B, in_dim, F, H, W], timestep t [B],
text context [B, L, text_dim] -> prediction [B, out_dim, F, H, W]; or packed: lists of per-sample latents
[in_dim, F_i, H_i, W_i] and contexts, of any mix of shapes, -> list of predictions (model/packing.py).

Sequence parallelism (Ulysses): the model shards the token sequence after the patch embedding when
forward() gets `seq_shard`, and gathers it again before unpatchify; the self-attention core, replaceable
through `self_attn_fn` / set_attention(), is where the caller's all-to-all goes (docs/model.md).
"""
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.model.attention import FA4_FORWARD_OP, drop_padding
from ds_adaptiveload.model.config import WanConfig
from ds_adaptiveload.model.gelu_linear import GELU_LINEAR_OP, GeluLinear
from ds_adaptiveload.model.layout import AttentionFn, BlockFns, Layout, modulate_rows
from ds_adaptiveload.model.offload import BlockInputOffload, offload_context
from ds_adaptiveload.model.packed_ops import RowsLinear
from ds_adaptiveload.model.packing import Packing, merge, plan_packing

ROPE_THETA = 10000.0


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_len: Optional[int] = None):
    """Default attention core. q, k, v: [B, S, heads, head_dim] -> [B, S, heads, head_dim].

    valid_len: keys/values at positions >= valid_len are padding (sequence padded to a multiple of the
    SP world size) and are dropped (attention.drop_padding)."""
    k, v = drop_padding(k, v, valid_len)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


@dataclass(frozen=True)
class SeqShard:
    """This rank's slice of the token sequence under sequence parallelism."""
    rank: int
    """Rank within the sequence-parallel group."""
    world: int
    """Size of the sequence-parallel group."""
    group: Any = None
    """torch.distributed process group used for the final all-gather (None: the default group)."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (as Wan's WanRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    """Affine LayerNorm computed in fp32 and cast back to the input dtype (Wan's norm3)."""

    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def rope_tables(grid: tuple[int, int, int], cfg: WanConfig, start: int, count: int, device):
    """cos, sin [1, count, 1, head_dim/2] (fp32) for tokens start..start+count-1 of a frame-major
    (f, h, w) grid. Angles in fp64 as Wan does; positions past the grid (SP padding) get position 0."""
    _, gh, gw = grid
    total = math.prod(grid)
    idx = torch.arange(start, start + count, device=device)
    idx = torch.where(idx < total, idx, torch.zeros_like(idx))
    pos = (idx // (gh * gw), (idx // gw) % gh, idx % gw)
    angles = []
    for p, n in zip(pos, cfg.rope_dims):
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, n, 2, device=device, dtype=torch.float64) / n)
        angles.append(p.to(torch.float64)[:, None] * inv[None, :])
    ang = torch.cat(angles, dim=1)[None, :, None, :]
    return ang.cos().float(), ang.sin().float()




class PatchEmbed(nn.Conv3d):
    """Wan's patch embedding (a strided Conv3d, same parameters) over a list of shape groups in ONE module
    call: under ZeRO-3 every module call gathers its parameters, so calling the conv once per group would
    issue a different number of collectives on ranks whose micro-batches hold different numbers of shapes."""

    def forward(self, xs):
        """xs: per group [n_g, in_dim, F, H, W] -> all groups' token rows [sum n_g * S_g, dim] as ONE tensor
        (ZeRO-3 also hooks each output tensor in backward: a list would vary that count too)."""
        rows = [F.conv3d(x.to(self.weight.dtype), self.weight, self.bias, self.stride).flatten(2).transpose(1, 2)
                .reshape(-1, self.out_channels) for x in xs]
        return rows[0] if len(rows) == 1 else torch.cat(rows)


class SelfAttention(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        d = cfg.dim
        self.num_heads = cfg.num_heads
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.o = RowsLinear(d, d)
        self.norm_q = RMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k = RMSNorm(d, cfg.eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x, lay: Layout):
        """x [T, dim] -> [T, dim]: projections over all tokens, RoPE and the core per group."""
        heads = (self.num_heads, -1)
        qs, ks = lay.rope_qk(self.norm_q(self.q(x)).unflatten(-1, heads), self.norm_k(self.k(x)).unflatten(-1, heads))
        vs = lay.project(self.v, x, heads)
        out = [lay.attn_fn(qg, kg, vg, **kw) for qg, kg, vg, kw in zip(qs, ks, vs, lay.attn_kwargs)]
        return self.o(lay.rows(out))


class CrossAttention(SelfAttention):
    """Text cross-attention: same parameters as self-attention, k/v from the context, no RoPE."""

    def forward(self, x, context, lay: Layout):
        """x [T, dim], context [n, text_len, dim] in packed order -> [T, dim]."""
        heads = (self.num_heads, -1)
        qs = lay.project(self.q, x, heads, self.norm_q)
        k = self.norm_k(self.k(context)).unflatten(-1, heads)
        v = self.v(context).unflatten(-1, heads)
        return self.o(lay.rows(lay.each(sdpa_attention, (qs,), (k, v))))


# The attention kernels' forward ops (their outputs and logsumexp are what the backward needs): kept by the
# "attention" checkpoint policy. At 720p 81f attention is ~85% of a block's FLOPs, so recomputing the rest of the
# block costs little time, and the saved outputs cost ~3 KB per token per attention call at dim 1536 (bf16).
_SAVED_ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward") if hasattr(torch.ops.aten, name)) + (FA4_FORWARD_OP,)


def save_attention_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# _scaled_mm: the float8 GEMMs of --fp8 linear (model/fp8.py), whose outputs are the projections' as addmm's are.
_MATMULS = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default, GELU_LINEAR_OP) + tuple(
    getattr(torch.ops.aten, n).default for n in ("_scaled_mm",) if hasattr(torch.ops.aten, n))


def save_attention_ffn_policy(ctx, op, *args, **kwargs):
    """The attention policy, and the FFN's output kept too (the gelu_linear op's: its shrinking matmul, ffn_dim ->
    dim, 2 x ffn_dim FLOPs of recompute per output element for dim x 2 bytes per token in bf16), so neither that
    matmul nor its GELU runs again in the replay."""
    if op in _SAVED_ATTENTION_OPS or op is GELU_LINEAR_OP:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_policy(ctx, op, *args, **kwargs):
    """Every matmul's and attention kernel's output kept: the block recomputes only its elementwise steps (norms,
    modulation, RoPE, gates, GELU) in backward. For open blocks (WanModel.open_recompute "elementwise"): their
    [T, dim] inputs and intermediates of those steps are not held from forward to backward, only the matmuls'."""
    if op in _SAVED_ATTENTION_OPS or op in _MATMULS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_attention_context():
    return create_selective_checkpoint_contexts(save_attention_policy)


def save_matmuls_context():
    return create_selective_checkpoint_contexts(save_matmuls_policy)


def save_attention_ffn_context():
    return create_selective_checkpoint_contexts(save_attention_ffn_policy)


CHECKPOINT_POLICIES = ("full", "attention")
OPEN_RECOMPUTE = ("none", "elementwise")  # WanModel.open_recompute


class WanBlock(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        d = cfg.dim
        self.eps = cfg.eps
        self.self_attn = SelfAttention(cfg)
        # Wan's names: norm3 precedes cross-attention, norm1/norm2 (no parameters) self-attn and FFN.
        self.norm3 = LayerNorm(d, eps=cfg.eps) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(cfg)
        # ffn.1 holds no parameters: the GELU runs inside ffn.2 (GeluLinear), whose backward recomputes it.
        self.ffn = nn.Sequential(nn.Linear(d, cfg.ffn_dim), nn.Identity(), GeluLinear(cfg.ffn_dim, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d ** 0.5)

    def forward(self, x, e0, context, lay: Layout, save_attention: bool = False, save_ffn: bool = False,
                save_matmuls: bool = False):
        """save_attention: recompute this block in backward except its attention outputs (selective
        checkpointing, save_attention_policy); save_ffn with it: keep the FFN's output too
        (save_attention_ffn_policy); save_matmuls: keep every matmul's output too, recomputing only the elementwise
        steps (save_matmuls_policy). Inside forward, so compile_blocks traces the checkpoint with the block (a
        dispatch-mode policy cannot see into a compiled call) and module hooks (ZeRO-3) stay on."""
        if (save_attention or save_matmuls) and torch.is_grad_enabled():
            fn = (save_matmuls_context if save_matmuls else
                  save_attention_ffn_context if save_ffn else save_attention_context)
            return checkpoint(self._forward, x, e0, context, lay, use_reentrant=False, context_fn=fn)
        return self._forward(x, e0, context, lay)

    def _forward(self, x, e0, context, lay: Layout):
        # x [T, dim]; e0 [n, 6, dim] fp32 time projection in packed order; modulation math stays fp32 as in Wan.
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float() + e0).chunk(6, dim=1)
        y = self.self_attn(lay.modulate(x, scale1, shift1, self.eps), lay)
        x = lay.gated_add(x, y, gate1)
        x = x + self.cross_attn(self.norm3(x), context, lay)
        y = self.ffn(lay.modulate(x, scale2, shift2, self.eps))
        return lay.gated_add(x, y, gate2)


class Head(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.out_dim * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim ** 0.5)

    def forward(self, x, e, packing: Packing):
        shift, scale = (self.modulation.float() + e.float()[:, None]).chunk(2, dim=1)
        return self.head(modulate_rows(x, scale, shift, self.eps, packing.run_dims()))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B] -> [B, dim] sinusoid, cos half first (Wan's sinusoidal_embedding_1d), computed in fp64."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, device=t.device, dtype=torch.float64) / half)
    ang = t.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([ang.cos(), ang.sin()], dim=1)


class _GatherSeq(torch.autograd.Function):
    """All-gather the token shards [T_local, C] of the SP group into [world, T_local, C]. Backward returns
    only this rank's slice of the gradient (no sum over ranks): every SP rank computes the same loss on the
    gathered output, so each rank's parameter gradients are its shard's contribution, and DeepSpeed sums
    them over the SP group."""

    @staticmethod
    def forward(ctx, x, shard: SeqShard):
        import torch.distributed as dist

        ctx.rank = shard.rank
        parts = [torch.empty_like(x) for _ in range(shard.world)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank], None


class WanModel(nn.Module):
    """Wan 2.1 DiT. WanModel(cfg)(x, t, context) -> [B, out_dim, F, H, W].

    checkpoint_blocks: recompute blocks in backward (torch.utils.checkpoint, non-reentrant): True for every
        block, an int k for the first k (settable per micro-batch), False for none.
    checkpoint_policy: what a checkpointed block recomputes: "full" (everything; the least memory) or
        "attention" (everything but the attention kernels, whose outputs are saved: less recompute time; the last
        checkpoint_ffn_blocks of the checkpointed blocks keep their FFN output as well).
        Not under ZeRO-3 without leaf blocks: its parameter hooks inside the block run different ops in the
        recompute, which selective checkpointing rejects.
    offload_blocks (attribute, 0 by default; settable per micro-batch): the first offload_blocks of the checkpointed
        blocks keep their inputs in pinned host memory instead of device memory from forward to backward, copied on a
        side stream (model/offload.py); schedule/offload.offload_blocks sizes it.
    open_recompute (attribute, "none" by default): "elementwise" runs the blocks not checkpointed under selective
        checkpointing that keeps every matmul and attention output (save_matmuls_policy) and recomputes only the
        elementwise steps; less memory than keeping everything, for one more pass of those steps. Measured by
        bench/model/ckpt_policy.py (sides open, open-elementwise); not yet used by the trainer or the planner.
    self_attn_fn: the self-attention core, (q, k, v) [B, S, heads, head_dim] -> same layout, called once
        per shape group of a packed micro-batch ([n_g, S_g, heads, head_dim]); None for sdpa_attention. Under sequence parallelism it also receives valid_len=<full token count> when
        the sequence was padded to a multiple of the SP world size (sdpa_attention handles it)."""

    def __init__(self, cfg: WanConfig, checkpoint_blocks: bool = False,
                 self_attn_fn: Optional[AttentionFn] = None, checkpoint_policy: str = "full"):
        super().__init__()
        self.cfg = cfg
        # checkpoint_full_blocks and checkpoint_ffn_blocks, settable per micro-batch: schedule/memory.py sizes them
        self.offload_blocks = 0  # likewise: schedule/offload.offload_blocks
        self.set_checkpointing(checkpoint_blocks, 0, 0, policy=checkpoint_policy)
        self.open_recompute = "none"  # the blocks not checkpointed: keep all they save, or recompute "elementwise"
        self.__dict__["_offload"] = BlockInputOffload()  # outside the module tree: no state, no ZeRO hooks
        d = cfg.dim
        self.patch_embedding = PatchEmbed(cfg.in_dim, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"),
                                            nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.set_attention(self_attn_fn)
        self.set_block_fns(None)
        self.init_weights()

    def set_checkpointing(self, k, k_full=None, k_ffn: int = 0, offload: Optional[int] = None, *,
                          policy: Optional[str] = None) -> None:
        """The next micro-batch's checkpoint counts, as its plan decided (loader.MicroBatch.checkpoint): the first k
        blocks checkpointed (True: every block), k_full of them recomputed whole (default all k), k_ffn of them keeping
        their FFN output, the first `offload` of them keeping their input in host memory (offload_blocks; None:
        unchanged); policy (None: unchanged) replaces checkpoint_policy, as calibration and benchmarks do."""
        if policy is not None:
            if policy not in CHECKPOINT_POLICIES:
                raise UserError(f"WanModel: checkpoint_policy {policy!r}: expected one of {CHECKPOINT_POLICIES}")
            self.checkpoint_policy = policy
        self.checkpoint_blocks = k
        self.checkpoint_full_blocks = k if k_full is None else k_full
        self.checkpoint_ffn_blocks = k_ffn
        if offload is not None:
            self.offload_blocks = int(offload)

    def set_attention(self, fn: Optional[AttentionFn]) -> None:
        """Replace the self-attention core (None restores sdpa_attention). Kept out of the module tree,
        so a wrapper such as DeepSpeed's DistributedAttention adds no state-dict keys."""
        self.__dict__["_attn_fn"] = fn or sdpa_attention

    def set_block_fns(self, fns: Optional[BlockFns]) -> None:
        """The blocks' per-group elementwise steps (None: eager); kept out of the module tree like set_attention."""
        self.__dict__["_block_fns"] = fns or BlockFns()

    @torch.no_grad()
    def init_weights(self):
        """Wan's initialisation: xavier-uniform linears with zero bias, N(0, 0.02) for the text and
        time embeddings, zero output projection (the model starts by predicting 0)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    def _context(self, context, packing: Packing) -> torch.Tensor:
        """Zero-pad / truncate the text context to text_len tokens, stacked in packed order; accepts [n, L, C]
        or a list of n [L_i, C]. Reordering the list before stacking costs no copy of the stacked contexts."""
        L, C = self.cfg.text_len, self.cfg.text_dim
        items = list(context) if isinstance(context, (list, tuple)) else list(context.unbind(0))
        if len(items) != packing.n:
            raise UserError(f"WanModel: {len(items)} text contexts for {packing.n} samples")
        for i, c in enumerate(items):
            if c.ndim != 2 or c.shape[1] != C:
                raise UserError(f"WanModel: context[{i}] has shape {tuple(c.shape)}, expected [L, {C}]")
        return torch.stack([F.pad(c[:L], (0, 0, 0, L - c[:L].shape[0])) for c in (items[i] for i in packing.order)])

    def forward(self, x, t, context, seq_shard=None, flat=False):
        """Tensor form: x [B, in_dim, F, H, W] latents, t [B] timesteps (0..1000, float or int; a scalar is
        broadcast), context [B, L, text_dim] or a list of [L_i, text_dim] -> [B, out_dim, F, H, W].
        Packed form: x a list of n latents [in_dim, F_i, H_i, W_i] of any mix of shapes, t [n], context a
        list of n [L_i, text_dim] -> list of n [out_dim, F_i, H_i, W_i], in input order. F, H, W must be
        divisible by patch_size. Samples are grouped by shape (model/packing.py): one GEMM per projection
        over all tokens, one batched attention call per group; the tensor form is a single group.

        flat (packed form; the tensor form ignores it): return ONE 1-D tensor, the n predictions flattened
        and concatenated in input order (split_flat() gives the list back). Needed under ZeRO-3 with several
        ranks: DeepSpeed hooks every output tensor of every module, so a list of n outputs runs this module's
        pre-backward hook n times; ZeRO-3 replays the module order it recorded in an earlier micro-batch, and
        a rank whose sample count differs from the recorded one drops that trace and re-records it with
        collectives its peers do not issue, which hangs (train/flow.py trains with flat=True).

        seq_shard: None, or SeqShard / (rank, world[, group]) for sequence parallelism. Each sample's S
        tokens are zero-padded to world * ceil(S / world) and this rank keeps tokens [rank*c, (rank+1)*c),
        with their own RoPE positions; the head output is all-gathered (see _GatherSeq for the gradient
        rule), so every rank returns the full prediction."""
        packed = isinstance(x, (list, tuple))
        shard = None
        if seq_shard is not None:
            shard = seq_shard if isinstance(seq_shard, SeqShard) else SeqShard(*seq_shard)
        packing = plan_packing(self._grids(x, packed), shard.world if shard else 1)
        device = (x[0] if packed else x).device
        t = self._timesteps(t, packing.n, device)
        ctx = self._context(context, packing)

        group_x = [torch.stack([x[i] for i in g.index]) for g in packing.groups] if packed else [x]
        h, lay = self._embed(group_x, packing, shard)
        context = self.text_embedding(ctx.to(h.dtype))
        # Time MLP outside autocast, modulation vectors in fp32 (Wan runs this part in fp32).
        with torch.autocast(device.type, enabled=False):
            tp = packing.to_packed(t)
            e = self.time_embedding(timestep_embedding(tp, self.cfg.freq_dim).to(self.time_embedding[0].weight.dtype))
            e0 = self.time_projection(e).float().unflatten(1, (6, self.cfg.dim))

        # checkpoint_blocks: True = every block, an int k = the first k (memory-aware checkpointing,
        # schedule/memory.blocks_to_checkpoint picks k per micro-batch), False / 0 = none.
        # checkpoint_policy "attention": those blocks keep their attention outputs (WanBlock.forward).
        n_ckpt = len(self.blocks) if self.checkpoint_blocks is True else int(self.checkpoint_blocks or 0)
        selective = self.checkpoint_policy == "attention"
        if self.open_recompute not in OPEN_RECOMPUTE:
            raise UserError(f"WanModel: open_recompute {self.open_recompute!r}: expected one of {OPEN_RECOMPUTE}")
        # Under "attention", the first checkpoint_full_blocks of them still recompute whole (less memory), and the
        # last checkpoint_ffn_blocks keep their FFN output too (more memory, less recompute).
        n_full = min(self.checkpoint_full_blocks, n_ckpt) if selective else n_ckpt
        first_ffn = max(n_ckpt - self.checkpoint_ffn_blocks, n_full) if selective else n_ckpt
        n_off = min(int(self.offload_blocks or 0), n_ckpt) if torch.is_grad_enabled() else 0
        if n_off:
            self._offload.begin()
        for i, block in enumerate(self.blocks):
            with offload_context(self._offload, i < n_off, h):  # the checkpointed block's inputs to host memory
                if i < n_full and torch.is_grad_enabled():
                    h = checkpoint(block, h, e0, context, lay, use_reentrant=False)
                else:
                    h = block(h, e0, context, lay, i < n_ckpt and selective, first_ffn <= i < n_ckpt,
                              i >= n_ckpt and self.open_recompute == "elementwise")
        h = self.head(h, e, packing)                                            # [T, out*pt*ph*pw]
        outs = self._unpatchify_groups(h, packing, shard)
        if not packed:
            return outs[0]
        if not flat:
            return packing.to_input(outs)
        # In input order; the groups' own order when it is the input order (one group, or shapes contiguous)
        parts = outs if packing.is_identity else packing.to_input(outs)
        return parts[0].flatten() if len(parts) == 1 else torch.cat([y.flatten() for y in parts])

    @staticmethod
    def split_flat(flat: torch.Tensor, xs) -> list:
        """forward(xs, ..., flat=True)'s result -> the list of n [out_dim, F_i, H_i, W_i] views it holds
        (out_dim: flat's numel over the latents' spatial sizes)."""
        sizes = [math.prod(x.shape[1:]) for x in xs]
        out_dim = flat.numel() // sum(sizes)
        return [y.view(out_dim, *x.shape[1:]) for y, x in zip(flat.split([out_dim * n for n in sizes]), xs)]

    def _grids(self, x, packed: bool) -> list:
        """Patch grid (f, h, w) of every sample; UserError naming the input on a bad shape."""
        cfg = self.cfg
        if packed:
            shapes = []
            for i, xi in enumerate(x):
                if not isinstance(xi, torch.Tensor) or xi.ndim != 4 or xi.shape[0] != cfg.in_dim:
                    got = tuple(xi.shape) if isinstance(xi, torch.Tensor) else type(xi).__name__
                    raise UserError(f"WanModel: xs[{i}] is {got}, expected a tensor [{cfg.in_dim}, F, H, W]")
                shapes.append((f"xs[{i}]", tuple(xi.shape[1:])))
        else:
            if x.ndim != 5 or x.shape[1] != cfg.in_dim:
                raise UserError(f"WanModel: x has shape {tuple(x.shape)}, expected [B, {cfg.in_dim}, F, H, W]")
            shapes = [("x", tuple(x.shape[2:]))] * x.shape[0]
        if not shapes:
            raise UserError("WanModel: no samples (empty list or B = 0)")
        grids = []
        for name, (nf, nh, nw) in shapes:
            pt, ph, pw = cfg.patch_size
            if nf % pt or nh % ph or nw % pw:
                raise UserError(f"WanModel: {name} latent (F, H, W)=({nf}, {nh}, {nw}) not divisible by "
                                f"patch {cfg.patch_size}")
            grids.append((nf // pt, nh // ph, nw // pw))
        return grids

    @staticmethod
    def _timesteps(t, n: int, device) -> torch.Tensor:
        t = torch.as_tensor(t, device=device)
        if t.ndim == 0 or t.numel() == 1:
            t = t.reshape(1).expand(n)
        if t.shape != (n,):
            raise UserError(f"WanModel: t has shape {tuple(t.shape)}, expected [{n}]")
        return t

    def _embed(self, group_x, packing: Packing, shard: Optional[SeqShard]):
        """Patch-embed each group's latents [n_g, in_dim, F, H, W] into this rank's token rows [T, dim],
        and the Layout (RoPE tables and SP padding per group) the blocks use."""
        parts, rope, kwargs = [], [], []
        flat, off = self.patch_embedding(group_x), 0
        for g, xg in zip(packing.groups, group_x):
            hg = flat[off:off + g.n * g.tokens].view(g.n, g.tokens, -1)                # [n_g, S, dim]
            off += g.n * g.tokens
            start, kw = 0, {}
            if shard is not None:
                start = shard.rank * g.local
                if g.local * shard.world != g.tokens:
                    hg = F.pad(hg, (0, 0, 0, g.local * shard.world - g.tokens))
                    kw = {"valid_len": g.tokens}
                hg = hg[:, start:start + g.local]
            parts.append(hg)
            rope.append(rope_tables(g.grid, self.cfg, start, g.local, xg.device))
            kwargs.append(kw)
        sizes = packing.size_tensors(flat.device)
        runs = packing.runs
        run_kwargs = tuple(kwargs[a] for a, _ in runs)  # a run's groups have the same tokens, so padding
        lay = Layout(packing, tuple(rope), run_kwargs, self._attn_fn, sizes, self._block_fns, runs)
        return merge(parts).contiguous(), lay

    def _unpatchify_groups(self, h: torch.Tensor, packing: Packing, shard: Optional[SeqShard]) -> list:
        """Head output rows [T, C] -> per group [n_g, out_dim, F, H, W]; under SP gathered from all ranks."""
        if shard is not None:
            h = _GatherSeq.apply(h, shard).transpose(0, 1)                     # [T_local, world, C]
        outs = []
        for g, hg in zip(packing.groups, packing.views(h)):
            if shard is not None:                                               # [n_g, local, world, C]
                hg = hg.transpose(1, 2).flatten(1, 2)[:, :g.tokens]
            outs.append(self.unpatchify(hg, g.grid))
        return outs

    def unpatchify(self, h: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, out_dim*pt*ph*pw] -> [B, out_dim, F, H, W]; each token's channels are ordered
        (pt, ph, pw, out_dim) as Wan's head writes them."""
        B = h.shape[0]
        gf, gh, gw = grid
        pt, ph, pw = self.cfg.patch_size
        h = h.reshape(B, gf, gh, gw, pt, ph, pw, self.cfg.out_dim)
        h = h.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.reshape(B, self.cfg.out_dim, gf * pt, gh * ph, gw * pw)
