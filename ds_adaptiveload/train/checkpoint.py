"""Checkpoints through DeepSpeed (model, optimizer, LR schedule) plus our state in client_state.

Under ZeRO-0/1/2 only rank 0 writes the file that carries client_state, so every dp rank's sampler state
is gathered and stored as a list; on resume each rank takes its own entry. The saved state is the one
taken right after the last trained step was drawn (data.MicroBatchStream), so a resumed run continues
with exactly the micro-batches the uninterrupted run would have trained next.
"""
import torch.distributed as dist

from ds_adaptiveload.errors import UserError


def save(engine, out_dir, step: int, sampler_state: dict, extra: dict) -> None:
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, sampler_state)
    engine.save_checkpoint(out_dir, tag=f"global_step{step}",
                           client_state={"sampler": states, "step": step, **extra})


def load(engine, ckpt_dir, expect: dict) -> dict:
    """Load the latest checkpoint in ckpt_dir; checks that `expect` (world size, sp, G, ...) is unchanged,
    since the saved micro-batch order is only valid for the same layout. Returns the client_state."""
    path, cs = engine.load_checkpoint(ckpt_dir)
    if path is None:
        raise UserError(f"--resume {ckpt_dir}: no DeepSpeed checkpoint there (no 'latest' file)")
    for k, v in expect.items():
        if cs.get(k) != v:
            raise UserError(f"--resume {ckpt_dir}: checkpoint has {k}={cs.get(k)!r}, this run has {v!r}; "
                            f"resuming the exact sample order needs the same value")
    return cs
