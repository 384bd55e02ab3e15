"""Checkpoints through DeepSpeed (model, optimizer, LR schedule) plus our state in client_state, written
atomically.

Under ZeRO-0/1/2 only rank 0 writes the file that carries client_state, so every dp rank's sampler state
is gathered and stored as a list; on resume each rank takes its own entry. The saved state is the one
taken right after the last trained step was drawn (data.MicroBatchStream), so a resumed run continues
with exactly the micro-batches the uninterrupted run would have trained next.

Atomic publish: DeepSpeed writes every rank's files into a tag folder and then points the `latest` file
at it; a kill in between leaves a half-written folder that `latest` may already name. We let DeepSpeed
write into `.tmp-<tag>` without touching `latest`; after every rank has finished (DeepSpeed's final
barrier), rank 0 renames the folder to `<tag>` and replaces `latest` through a temporary file and
os.replace. A kill at any point leaves `latest` naming a complete checkpoint (the previous one until the
new one is complete). The sampler state is in the same folder (client_state), so it can never disagree
with the weights. Assumes the checkpoint folder is on a file system every rank sees (DeepSpeed's default).
"""
import os
import shutil

import torch.distributed as dist

from ds_adaptiveload.errors import UserError

TMP_PREFIX = ".tmp-"


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(out_dir: str, tag: str) -> None:
    """Rank 0: make `.tmp-<tag>` the checkpoint `<tag>` and point `latest` at it."""
    tmp, final = os.path.join(out_dir, TMP_PREFIX + tag), os.path.join(out_dir, tag)
    if os.path.exists(final):  # re-saving a step after resuming from an older checkpoint
        old = os.path.join(out_dir, TMP_PREFIX + "old-" + tag)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    latest_tmp = os.path.join(out_dir, TMP_PREFIX + "latest")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(out_dir, "latest"))
    _fsync_dir(out_dir)
    shutil.rmtree(os.path.join(out_dir, TMP_PREFIX + "old-" + tag), ignore_errors=True)


def save(engine, out_dir, step: int, sampler_state: dict, extra: dict, faults=None) -> str:
    """Collective: every rank calls it. Returns the published folder."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, sampler_state)
    tag = f"global_step{step}"
    if dist.get_rank() == 0:  # leftovers of a save that was killed before publishing
        shutil.rmtree(os.path.join(out_dir, TMP_PREFIX + tag), ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(out_dir, tag=TMP_PREFIX + tag, save_latest=False,
                           client_state={"sampler": states, "step": step, **extra})  # ends with a barrier
    if faults is not None:
        faults.before_publish(step)
    if dist.get_rank() == 0:
        publish(out_dir, tag)
    dist.barrier()
    return os.path.join(out_dir, tag)


def latest_tag(ckpt_dir) -> str:
    """The published tag `latest` names, checked to exist (what --resume loads)."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        raise UserError(f"--resume {ckpt_dir}: no published checkpoint there (no 'latest' file)")
    with open(path) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise UserError(f"--resume {ckpt_dir}: 'latest' names {tag!r}, which does not exist")
    return tag


def load(engine, ckpt_dir, expect: dict) -> dict:
    """Load the checkpoint `latest` names in ckpt_dir; checks that `expect` (world size, sp, G, ...) is
    unchanged, since the saved micro-batch order is only valid for the same layout. Returns the
    client_state."""
    tag = latest_tag(ckpt_dir)
    path, cs = engine.load_checkpoint(ckpt_dir, tag=tag)
    if path is None:
        raise UserError(f"--resume {ckpt_dir}: DeepSpeed could not load checkpoint {tag!r}")
    for k, v in expect.items():
        if cs.get(k) != v:
            raise UserError(f"--resume {ckpt_dir}: checkpoint has {k}={cs.get(k)!r}, this run has {v!r}; "
                            f"resuming the exact sample order needs the same value")
    return cs
