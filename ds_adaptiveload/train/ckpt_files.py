"""A checkpoint folder's files, without collectives: tag names, which folders --resume may load and in which
order, the checksum manifest (sha256 per file, written at save, verified at load), fsync, and --keep-last.

A published checkpoint is a folder `global_step<N>` holding CHECKSUMS, which is written last, after every
file of the folder has been hashed and fsynced; a folder without it is a save that never finished (or one
from before checksums, accepted only where `latest` names it).
"""
import hashlib
import json
import os
import re
import shutil

from ds_adaptiveload.errors import UserError

TMP_PREFIX = ".tmp-"
LAYOUT_FILE = "adaptive_load.json"
CHECKSUMS = "checksums.json"
TAG_RE = re.compile(r"global_step(\d+)")
DS_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""DeepSpeed copies these recovery scripts into the checkpoint folder during its save, before our publish."""


def tag_step(tag: str):
    m = TAG_RE.fullmatch(tag)
    return int(m.group(1)) if m else None


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder: the names in it reach the disk). Best effort on file systems that
    refuse it for folders."""
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


def write_durable(path: str, text: str) -> None:
    """Write a small file through a temporary name: fsynced, then renamed over `path`."""
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def folder_files(folder: str) -> list:
    """Every file under `folder` (relative paths, sorted), CHECKSUMS left out."""
    out = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def hash_file(path: str, sync: bool = False) -> dict:
    """{"bytes", "sha256"} of a file; sync: fsync it too (what is published must be on the disk)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def write_checksums(folder: str, entries: dict) -> None:
    """CHECKSUMS of `folder` from {relative path: hash_file(...)}, fsynced with the folders under it."""
    for root, dirs, _ in os.walk(folder):
        for d in dirs:
            fsync_path(os.path.join(root, d))
    write_durable(os.path.join(folder, CHECKSUMS), json.dumps({"version": 1, "files": entries}, indent=1))
    fsync_path(folder)


def read_checksums(folder: str):
    """The manifest's {path: {"bytes", "sha256"}}, None where the folder has none; raises ValueError when
    it is unreadable."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        doc = json.load(f)
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise ValueError(f"{CHECKSUMS} holds no file table")
    return files


def check_file(folder: str, rel: str, want: dict):
    """Why `rel` does not match its manifest entry, or None."""
    if os.path.isabs(rel) or ".." in rel.split(os.sep):
        return f"{CHECKSUMS} names {rel!r}, outside the checkpoint"
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f"{rel} is missing"
    size = os.path.getsize(path)
    if size != want.get("bytes"):
        return f"{rel} has {size} bytes, the manifest says {want.get('bytes')} (truncated or rewritten)"
    if hash_file(path)["sha256"] != want.get("sha256"):
        return f"{rel}: sha256 differs from the manifest (the file changed after it was saved)"
    return None


# ----------------------------------------------------------------------------------------------------
# Which checkpoints --resume may load


def read_latest(ckpt_dir: str, flag: str = "--resume"):
    """The tag `latest` names (None without `latest`), refused where it is not a plain folder name: a `latest`
    naming `../..` or an absolute path would choose what gets loaded from anywhere."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        tag = f.read().strip()
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or tag.startswith(TMP_PREFIX) or \
            any(ord(c) < 32 for c in tag):
        raise UserError(f"{flag} {ckpt_dir}: 'latest' names {tag!r}, which is not a checkpoint folder inside "
                        f"{ckpt_dir}; refused (it should name one of its global_step<N> folders)")
    return tag


def candidates(ckpt_dir: str) -> tuple:
    """(tags to try, newest first; notes): what `latest` names (where it exists), then every published
    `global_step<N>` older than it (or every one, without `latest`), for the fallback when the newest is
    damaged. Empty when ckpt_dir holds no checkpoint yet: missing, empty, or only interrupted saves
    (`.tmp-*` folders and DeepSpeed's recovery scripts), so a wrapper may always pass --resume. A folder
    holding anything else without `latest` is not a checkpoint folder: an error."""
    if not os.path.exists(ckpt_dir):
        return [], []
    if not os.path.isdir(ckpt_dir):
        raise UserError(f"--resume {ckpt_dir}: not a folder")
    latest, notes = read_latest(ckpt_dir), []
    names = sorted(os.listdir(ckpt_dir))
    steps = {n: tag_step(n) for n in names if tag_step(n) is not None and os.path.isdir(os.path.join(ckpt_dir, n))}
    if latest is None:
        other = [n for n in names if not n.startswith(TMP_PREFIX) and n not in steps and n not in DS_SCRIPTS]
        if other:
            raise UserError(f"--resume {ckpt_dir}: no 'latest' file, and the folder holds "
                            f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''}: not a checkpoint folder "
                            f"(OUTPUT/checkpoints of a run)")
    older = sorted(steps, key=steps.get, reverse=True)
    if latest is not None:
        if os.path.isdir(os.path.join(ckpt_dir, latest)):
            top = tag_step(latest)
            return [latest] + [t for t in older if t != latest and (top is None or steps[t] < top)], notes
        notes.append(f"'latest' names {latest!r}, which does not exist")
    # without a (valid) latest, only folders that finished their save: they hold the manifest
    return [t for t in older if os.path.isfile(os.path.join(ckpt_dir, t, CHECKSUMS))], notes


def checkpoints_to_prune(ckpt_dir: str, latest: str, keep: int) -> list:
    """--keep-last: the published checkpoints older than `latest` beyond the newest `keep` (counting `latest`).
    `.tmp-*` saves and folders newer than `latest` (of a run that was resumed from further back) are never
    chosen, nor is `latest` itself."""
    top = tag_step(latest)
    if top is None or keep < 1:
        return []
    older = [(s, n) for n in os.listdir(ckpt_dir) if (s := tag_step(n)) is not None and s < top
             and os.path.isfile(os.path.join(ckpt_dir, n, CHECKSUMS))]
    return [n for _, n in sorted(older, reverse=True)[keep - 1:]]


def prune(ckpt_dir: str, latest: str, keep: int) -> list:
    """Delete what checkpoints_to_prune names (rank 0, after a publish); returns their names."""
    gone = checkpoints_to_prune(ckpt_dir, latest, keep)
    for name in gone:
        # rename first: a kill halfway leaves a `.tmp-` folder (ignored, deleted by the next publish), not a
        # published folder with missing files
        doomed = os.path.join(ckpt_dir, TMP_PREFIX + "pruned-" + name)
        os.replace(os.path.join(ckpt_dir, name), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return gone
