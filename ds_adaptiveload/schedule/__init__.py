"""The scheduler, torch-free: sample geometry, manifests, the cost profile, the planner and its policies,
the per-rank sampler and the synthetic shape mixes (docs/scheduler.md). Nothing here imports torch or
torch.distributed; the DeepSpeed glue lives in ds_adaptiveload.train."""
