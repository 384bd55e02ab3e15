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
A publish removes every `.tmp-*` left by interrupted saves, whatever their step.

Resume checks first: the layout (world size, sp, G, plan keys, manifest size) is also written as
`<tag>/adaptive_load.json`, so `check_layout` can refuse a resume before DeepSpeed loads anything (DeepSpeed
fails on another world size with its own traceback).
"""
import json
import os
import shutil

import torch.distributed as dist

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train.failures import agree

TMP_PREFIX = ".tmp-"
LAYOUT_FILE = "adaptive_load.json"


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
    for name in os.listdir(out_dir):  # orphans of interrupted saves (and the replaced old tag)
        if name.startswith(TMP_PREFIX):
            path = os.path.join(out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def save(engine, out_dir, step: int, sampler_state: dict, extra: dict, faults=None, write_files=None) -> str:
    """Collective: every rank calls it. write_files(folder): this rank's own files (the model config, EMA
    partitions), written into the checkpoint before it is published. Returns the published folder."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, sampler_state)
    tag = f"global_step{step}"
    if dist.get_rank() == 0:  # leftovers of a save that was killed before publishing
        shutil.rmtree(os.path.join(out_dir, TMP_PREFIX + tag), ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(out_dir, tag=TMP_PREFIX + tag, save_latest=False,
                           client_state={"sampler": states, "step": step, **extra})  # ends with a barrier
    if write_files is not None:
        err = None
        try:
            write_files(os.path.join(out_dir, TMP_PREFIX + tag))
        except OSError as e:
            err = f"checkpoint {os.path.join(out_dir, tag)}: cannot write ({e.strerror or e})"
        agree(err)  # every rank's files are in place before rank 0 publishes
    if faults is not None:
        faults.before_publish(step)
    err = None
    if dist.get_rank() == 0:
        try:
            with open(os.path.join(out_dir, TMP_PREFIX + tag, LAYOUT_FILE), "w") as f:
                json.dump({"step": step, **extra}, f)
            publish(out_dir, tag)
        except OSError as e:  # disk full, permissions: told to every rank, not a traceback on one
            err = f"checkpoint {os.path.join(out_dir, tag)}: cannot publish ({e.strerror or e})"
    agree(err)  # also the barrier: every rank returns after the publish
    return os.path.join(out_dir, tag)


def latest_tag(ckpt_dir, flag="--resume") -> str:
    """The published tag `latest` names, checked to exist (what --resume loads; `export --checkpoint` too)."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {ckpt_dir}: no published checkpoint there (no 'latest' file)")
    with open(path) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise UserError(f"{flag} {ckpt_dir}: 'latest' names {tag!r}, which does not exist")
    return tag


def find(ckpt_dir):
    """The tag --resume loads, or None when ckpt_dir holds no checkpoint yet (missing, empty, or only
    interrupted `.tmp-*` saves): a wrapper may always pass --resume. Anything else without `latest` is
    not a checkpoint folder: an error."""
    if not os.path.exists(ckpt_dir):
        return None
    if not os.path.isdir(ckpt_dir):
        raise UserError(f"--resume {ckpt_dir}: not a folder")
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        return latest_tag(ckpt_dir)
    other = sorted(n for n in os.listdir(ckpt_dir) if not n.startswith(TMP_PREFIX))
    if other:
        raise UserError(f"--resume {ckpt_dir}: no 'latest' file, and the folder holds "
                        f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''}: not a checkpoint folder "
                        f"(OUTPUT/checkpoints of a run)")
    return None


def _raise_mismatch(ckpt_dir, tag, saved: dict, expect: dict) -> None:
    """The first key (a dict's first differing sub-key) whose saved value differs from this run's."""
    for k, v in expect.items():
        old = saved.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            sub = [kk for kk in v if old.get(kk) != v[kk]] + [kk for kk in old if kk not in v]
            if not sub:
                continue
            k, old, v = f"{k}.{sub[0]}", old.get(sub[0]), v.get(sub[0])
        elif old == v:
            continue
        raise UserError(f"--resume {ckpt_dir}: checkpoint {tag} was saved with {k}={old!r}, this run has "
                        f"{k}={v!r}; resuming the exact sample order needs the same value")


def check_layout(ckpt_dir, tag, expect: dict) -> None:
    """Before DeepSpeed loads anything: the saved layout must equal `expect`, since the saved micro-batch
    order is only valid for the same world size, sp, G, plan keys and manifest. Checkpoints without the
    layout file (older) are checked after loading (load)."""
    path = os.path.join(ckpt_dir, tag, LAYOUT_FILE)
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable checkpoint layout ({e})") from None
    _raise_mismatch(ckpt_dir, tag, saved if isinstance(saved, dict) else {}, expect)


def load(engine, ckpt_dir, tag, expect: dict) -> dict:
    """Load checkpoint `tag` (find) of ckpt_dir after check_layout; checks `expect` against the
    client_state too (checkpoints without the layout file). Returns the client_state."""
    path, cs = engine.load_checkpoint(ckpt_dir, tag=tag)
    if path is None:
        raise UserError(f"--resume {ckpt_dir}: DeepSpeed could not load checkpoint {tag!r}")
    _raise_mismatch(ckpt_dir, tag, cs, expect)
    return cs
