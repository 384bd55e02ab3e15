"""Ulysses sequence parallelism through DeepSpeed.

Groups come from DeepSpeed's own `parallel_state_sp` mpu (what its ALST/Ulysses integration uses):
SP groups are consecutive ranks [i*k, (i+1)*k), and ZeRO shards and reduces gradients over all ranks,
dividing by the data-parallel size world/k. (deepspeed.initialize(mesh_param=...) builds a mesh whose
data-parallel group excludes the SP peers, so their partial gradients would not be summed; not used.)

The model shards tokens after the patch embedding and gathers the head output (model/wan.py); each
self-attention core goes through DistributedAttention: all-to-all from [B, S/k, heads, d] to
[B, S, heads/k, d], local attention, and back. Every SP peer computes the full loss of the same samples,
and the model's gather hands each peer only its own shard's gradient, so the true gradient is the *sum*
over the SP group: see grad_divisor for what DeepSpeed divides by.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    world: int
    """All ranks."""
    sp: int
    """Ulysses degree k: ranks that split one sample's tokens."""
    rank: int
    """Global rank."""

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp


def init_sequence_parallel(dims: ParallelDims):
    """Create the SP groups; returns the mpu to hand to deepspeed.initialize (None without SP)."""
    if dims.sp == 1:
        return None
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

    mpu.initialize_sequence_parallel(dims.sp)
    assert mpu.get_sequence_parallel_rank() == dims.sp_rank, "SP groups are not consecutive ranks"
    return mpu


def apply_ulysses(model, mpu, num_heads: int, core=None):
    """Set the model's self-attention core to `core` (None: sdpa_attention; else the kernels
    model/attention.resolve_attention chose), under SP wrapped in DistributedAttention; returns the SeqShard to pass
    to forward (None without SP)."""
    from ds_adaptiveload.model import SeqShard, sdpa_attention

    core = core or sdpa_attention
    model.set_attention(core)
    if mpu is None:
        return None
    from deepspeed.sequence.layer import DistributedAttention

    from ds_adaptiveload.errors import UserError

    k = mpu.get_sequence_parallel_world_size()
    if num_heads % k:
        raise UserError(f"sequence_parallel_size {k} must divide the model's num_heads {num_heads}")
    # [B, S, heads, d]: batch dim 0, scatter heads (2), gather the sequence (1).
    dist_attn = DistributedAttention(core, mpu.get_sequence_parallel_group(), scatter_idx=2, gather_idx=1)

    def attention(q, k_, v, **kwargs):
        return dist_attn(q, k_, v, 0, **kwargs)

    model.set_attention(attention)
    return SeqShard(mpu.get_sequence_parallel_rank(), k, mpu.get_sequence_parallel_group())


def grad_divisor(engine, dims: ParallelDims) -> int:
    """The number DeepSpeed 0.19 divides the summed gradients by, which the loss scale must undo.

    Without SP it is the dp size. With SP, ZeRO-1/2 and ZeRO-3's contiguous-bucket path divide by
    world/k (dp), but ZeRO-3's reduce-scatter path (reduce_scatter: true, the default) divides by the
    whole world: measured, a 2-rank sp=2 run got exactly half the single-process gradient before this
    was accounted for (tests/test_train.py). ZeRO-3 with reduce_scatter false mixes the two per bucket
    size, so it is refused under SP."""
    if dims.sp == 1:
        return dims.dp
    if engine.zero_optimization_stage() == 3:
        if not engine.zero_reduce_scatter():
            from ds_adaptiveload.errors import UserError

            raise UserError("sequence parallelism under ZeRO-3 needs zero_optimization.reduce_scatter true "
                            "(with false DeepSpeed averages some gradient buckets over dp and others over "
                            "the whole world)")
        return dims.world
    return dims.dp
