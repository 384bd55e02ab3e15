"""The equal-tokens and dual policies: one-shape micro-batches at the shape's cap, shuffled, dealt round-robin.

equal-tokens caps B by memory, B = floor(M_mem / S), as token-capped loaders (DeepSpeed dynamic batching, bucket
loaders) do: the baseline. dual also caps B by the compute constraint B * S^p <= M_comp (the registry's
`dual_cap`). Pure Python, no torch.
"""
from ds_adaptiveload.schedule.policies.common import deal, micro_batches, shuffled_buckets


def bucket_steps(keep, ctx, rng):
    """equal-tokens and dual: shuffled one-shape micro-batches at the shape's cap, dealt round-robin."""
    return deal(micro_batches(shuffled_buckets(keep, ctx.shape, rng), ctx.cap), ctx, rng)
