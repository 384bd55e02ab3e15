"""Checkpoints through DeepSpeed (model, optimizer, LR schedule) plus our state as JSON, written atomically,
checksummed, and loaded without running code from the files (docs/reliability.md).

Our state: every dp rank's sampler state (gathered; each rank takes its own entry on resume), the step and the
layout go into `<tag>/adaptive_load.json`, not into DeepSpeed's pickled client_state, so loading them runs
nothing. The saved sampler state is the one taken right after the last trained step was drawn
(data.MicroBatchStream), so a resumed run continues with exactly the micro-batches the uninterrupted run would
have trained next.

Save: DeepSpeed writes every rank's files into `.tmp-<tag>` without touching `latest` (a failed write is
recorded, not raised, so every rank finishes DeepSpeed's collectives: ckpt_safe.Guard); the ranks agree on any
error; each rank hashes and fsyncs the files it wrote; rank 0 writes the checksum manifest, renames the folder to
`<tag>` and replaces `latest` through a fsynced temporary file. A kill at any point leaves `latest` naming a
complete checkpoint (the previous one until the new one is complete). Assumes the checkpoint folder is on a
file system every rank sees (DeepSpeed's default). A publish removes every `.tmp-*` left by interrupted saves.

Resume (choose, then load): the newest checkpoint whose files match their checksums and whose tensor files
need nothing but tensors, containers and DeepSpeed's few classes (ckpt_safe); a damaged newest one falls back to
the next older intact one, with one line. The layout (world size, sp, G, plan keys, manifest size, ZeRO stage,
model) is checked before DeepSpeed loads anything.
"""
import json
import logging
import os
import re
import shutil

import torch.distributed as dist

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train import ckpt_files as files, ckpt_safe
from ds_adaptiveload.train.ckpt_files import LAYOUT_FILE, TMP_PREFIX  # noqa: F401  (the names tests use)
from ds_adaptiveload.train.failures import agree

logger = logging.getLogger(__name__)

SHAPE_KEYS = ("zero_stage", "model")
"""Layout keys that must match for DeepSpeed to load the weights at all; checkpoints from before they were stored
are left to DeepSpeed."""


def owner(rel: str, world: int) -> int:
    """The rank that hashes and fsyncs a checkpoint file: the one that wrote it (`zero_pp_rank_<r>_`, EMA
    `ema_rank<r>`), else 0."""
    m = re.search(r"(?:zero_pp_rank_|ema_rank)(\d+)", os.path.basename(rel))
    return int(m.group(1)) % world if m else 0


def publish(out_dir: str, tag: str) -> None:
    """Rank 0: make `.tmp-<tag>` the checkpoint `<tag>` and point `latest` at it."""
    tmp, final = os.path.join(out_dir, TMP_PREFIX + tag), os.path.join(out_dir, tag)
    if os.path.exists(final):  # re-saving a step after resuming from an older checkpoint
        old = os.path.join(out_dir, TMP_PREFIX + "old-" + tag)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    files.fsync_path(out_dir)  # the rename is on the disk before `latest` names it
    files.write_durable(os.path.join(out_dir, "latest"), tag)
    files.fsync_path(out_dir)
    for name in os.listdir(out_dir):  # orphans of interrupted saves (and the replaced old tag)
        if name.startswith(TMP_PREFIX):
            path = os.path.join(out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def _hash_mine(folder: str, rank: int, world: int):
    """({relative path: hash} of the files this rank owns, fsynced; error line or None)."""
    mine = {}
    try:
        for rel in files.folder_files(folder):
            if owner(rel, world) == rank:
                mine[rel] = files.hash_file(os.path.join(folder, rel), sync=True)
    except OSError as e:
        return mine, f"{folder}: {e.strerror or e}"
    return mine, None


def save(engine, out_dir, step: int, sampler_state: dict, layout: dict, faults=None, keep_last: int = 0,
         write_files=None) -> str:
    """Collective: every rank calls it. write_files(folder): this rank's own files (the model config, EMA
    partitions), written into the checkpoint before it is hashed and published. Returns the published folder.
    A full disk anywhere is one agreed error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    states = [None] * world
    dist.all_gather_object(states, sampler_state)
    tag = f"global_step{step}"
    tmp, final = os.path.join(out_dir, TMP_PREFIX + tag), os.path.join(out_dir, tag)
    if rank == 0:  # leftovers of a save that was killed before publishing
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    guard = ckpt_safe.install(engine, faults=faults)
    guard.error, guard.step = None, step
    engine.save_checkpoint(out_dir, tag=TMP_PREFIX + tag, save_latest=False, client_state={})  # ends with a barrier
    err = guard.error
    if write_files is not None and not err:
        try:
            write_files(tmp)
        except OSError as e:
            err = f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    if rank == 0 and not err:
        try:
            with open(os.path.join(tmp, LAYOUT_FILE), "w") as f:
                json.dump({"step": step, **layout, "sampler": states}, f)
        except OSError as e:
            err = f"{os.path.join(tmp, LAYOUT_FILE)}: {e.strerror or e}"
    _agree_io(err, final, "save")
    if faults is not None:
        faults.before_publish(step)
    mine, err = _hash_mine(tmp, rank, world)
    shares = [None] * world
    dist.all_gather_object(shares, (mine, err))
    _agree_io(next((e for _, e in shares if e), None) if rank == 0 else None, final, "save")
    err = None
    if rank == 0:
        try:
            files.write_checksums(tmp, {k: v for m, _ in shares for k, v in m.items()})
            publish(out_dir, tag)
            for name in files.prune(out_dir, tag, keep_last) if keep_last else ():
                logger.info(f"[train_wan] --keep-last {keep_last}: deleted checkpoint {name}")
        except OSError as e:  # disk full, permissions: told to every rank, not a traceback on one
            err = f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    _agree_io(err, final, "publish")  # also the barrier: every rank returns after the publish
    return final


def _agree_io(err, final, what) -> None:
    agree(f"checkpoint {final}: cannot {what} ({err}); free space or fix the folder, then relaunch with --resume "
          f"(the previous checkpoint is intact)" if err else None)


def latest_tag(ckpt_dir, flag="--resume") -> str:
    """The published tag `latest` names, checked to be a folder inside ckpt_dir (what --resume loads; `export
    --checkpoint` too)."""
    tag = files.read_latest(ckpt_dir, flag)
    if tag is None:
        raise UserError(f"{flag} {ckpt_dir}: no published checkpoint there (no 'latest' file)")
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise UserError(f"{flag} {ckpt_dir}: 'latest' names {tag!r}, which does not exist")
    return tag


def find(ckpt_dir):
    """The newest checkpoint --resume would try (before verification), or None where ckpt_dir holds none yet."""
    tags, _ = files.candidates(ckpt_dir)
    return tags[0] if tags else None


def refuse_fresh_start(out_dir: str, overwrite: bool) -> None:
    """A run starting from step 0 into an OUTPUT whose checkpoints/ holds `latest` would overwrite that run's
    checkpoints and point `latest` back: refused unless --overwrite."""
    ckpt = os.path.join(out_dir, "checkpoints")
    if not overwrite and os.path.isfile(os.path.join(ckpt, "latest")):
        raise UserError(f"--output {out_dir}: {ckpt} holds checkpoints of an earlier run (latest: "
                        f"{open(os.path.join(ckpt, 'latest'), errors='replace').read().strip()!r}); continue it "
                        f"with --resume {ckpt}, or pass --overwrite to start from step 0 and delete them")


def clear(ckpt_dir: str, rank: int = 0) -> None:
    """--overwrite: rank 0 removes the checkpoints of an earlier run from ckpt_dir, `latest` first."""
    if rank != 0 or not os.path.isdir(ckpt_dir):
        return
    latest = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(latest):
        os.remove(latest)
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if files.tag_step(name) is not None or name.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _verify_mine(folder: str, rank: int, world: int, trust: bool) -> list:
    """This rank's share of a checkpoint's problems: [("unsafe" | "damaged", line)]."""
    out = []
    try:
        sums = files.read_checksums(folder)
    except (OSError, ValueError) as e:
        return [("damaged", f"{files.CHECKSUMS} unreadable ({e})")] if rank == 0 else []
    sums = sums or {}
    for rel in sorted(set(sums) | set(files.folder_files(folder))):
        if owner(rel, world) != rank:
            continue
        why = files.check_file(folder, rel, sums[rel]) if rel in sums else None
        if why is None and not trust and rel.endswith(".pt"):
            try:
                needs = ckpt_safe.unsafe_globals(os.path.join(folder, rel))
            except ValueError as e:
                why = f"{rel}: {e}"
            else:
                if needs:
                    out.append(("unsafe", ckpt_safe.refusal(os.path.join(folder, rel), needs)))
        if why:
            out.append(("damaged", why))
    return out


def choose(ckpt_dir, tags: list, notes: list, layout: dict, trust: bool = False):
    """Collective: the checkpoint to resume from among `tags` (ckpt_files.candidates), newest first: the first whose
    files match their checksums, after one line per damaged one. A file that needs unpickling beyond DeepSpeed's
    types is refused (every rank raises); no intact checkpoint left is an error too. None when `tags` is empty."""
    from ds_adaptiveload.train.failures import agreed

    rank, world = dist.get_rank(), dist.get_world_size()
    damaged = list(notes)
    for tag in tags:
        everyone = [None] * world
        dist.all_gather_object(everyone, _verify_mine(os.path.join(ckpt_dir, tag), rank, world, trust))
        problems = [p for share in everyone for p in share]
        agree(next((line for kind, line in problems if kind == "unsafe"), None) if rank == 0 else None)
        if not problems:
            if damaged and rank == 0:
                logger.warning(f"[train_wan] warning: --resume {ckpt_dir}: {'; '.join(damaged)}; resuming from {tag}, "
                               f"the newest intact checkpoint")
            if not os.path.isfile(os.path.join(ckpt_dir, tag, files.CHECKSUMS)) and rank == 0:
                logger.warning(f"[train_wan] note: checkpoint {tag} has no {files.CHECKSUMS} (saved before checksums): "
                               f"not verified")
            agreed(check_layout, ckpt_dir, tag, layout)
            return tag
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        damaged.append(f"checkpoint {tag} is damaged: {problems[0][1]}{more}")
    if damaged:
        agree(f"--resume {ckpt_dir}: no intact checkpoint: {'; '.join(damaged)}" if rank == 0 else None)
    return None


def _raise_mismatch(ckpt_dir, tag, saved: dict, expect: dict) -> None:
    """The first key (a dict's first differing sub-key) whose saved value differs from this run's."""
    for k, v in expect.items():
        if k in SHAPE_KEYS and k not in saved:
            continue
        old = saved.get(k)
        key = k
        if isinstance(v, dict) and isinstance(old, dict):
            sub = [kk for kk in v if old.get(kk) != v[kk]] + [kk for kk in old if kk not in v]
            if not sub:
                continue
            key, old, v = f"{k}.{sub[0]}", old.get(sub[0]), v.get(sub[0])
        elif old == v:
            continue
        why = ("DeepSpeed loads a checkpoint only into the same ZeRO stage and model" if k in SHAPE_KEYS else
               "resuming the exact sample order needs the same value")
        raise UserError(f"--resume {ckpt_dir}: checkpoint {tag} was saved with {key}={old!r}, this run has "
                        f"{key}={v!r}; {why}")


def read_state(ckpt_dir, tag):
    """The checkpoint's adaptive_load.json (step, layout, sampler states), or None (checkpoints from before it)."""
    path = os.path.join(ckpt_dir, tag, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable checkpoint layout ({e})") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: unreadable checkpoint layout (not a JSON object)")
    return saved


def check_layout(ckpt_dir, tag, expect: dict) -> None:
    """Before DeepSpeed loads anything: the saved layout must equal `expect`, since the saved micro-batch
    order is only valid for the same world size, sp, G, plan keys and manifest, and DeepSpeed's files only load
    into the same ZeRO stage and model. Checkpoints without the layout file (older) are checked after loading."""
    saved = read_state(ckpt_dir, tag)
    if saved is not None:
        _raise_mismatch(ckpt_dir, tag, saved, expect)


def load(engine, ckpt_dir, tag, expect: dict, trust: bool = False) -> dict:
    """Load checkpoint `tag` (choose) into the engine; returns {"step", "sampler": [per dp rank]}. DeepSpeed reads
    its files through ckpt_safe (weights_only unless trust)."""
    ckpt_safe.install(engine, trust)
    try:
        path, cs = engine.load_checkpoint(ckpt_dir, tag=tag)
    except UserError:
        raise
    except Exception as e:  # the files do not fit this run (DeepSpeed's own error, one line)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(f"--resume {ckpt_dir}: checkpoint {tag} does not load into this run "
                        f"({type(e).__name__}: {first})") from None
    if path is None:
        raise UserError(f"--resume {ckpt_dir}: DeepSpeed could not load checkpoint {tag!r}")
    saved = read_state(ckpt_dir, tag)
    state = saved if saved is not None and "sampler" in saved else cs  # older checkpoints: client_state
    _raise_mismatch(ckpt_dir, tag, state, expect)
    return {"step": state["step"], "sampler": state["sampler"]}
