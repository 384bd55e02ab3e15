"""Latent datasets: the on-disk format, `python -m ds_adaptiveload synthesize`, and the torch side that
reads one micro-batch at a time.

On disk: a manifest (manifest.py) whose lines also carry
  shard       safetensors file holding the sample, relative to the manifest's folder
  latent_key  tensor [C=16, F', H/8, W/8] (VAE latent; F' = (frames-1)/4 + 1)
  text_key    tensor [L <= 512, text_dim] (text-encoder output, unpadded)
Synthetic data has these shapes and random values: it measures speed, not quality.

A micro-batch is a list of sample indices. Of one shape (every policy but `packed`), its samples stack
without padding and text contexts are zero-padded to the model's text_len as Wan does. Of several shapes
(`packed`), it comes back as lists in the packed model's input form (WanModel.forward(xs, t, contexts)),
samples of one shape contiguous.
"""
import os
from collections import deque

from ds_adaptiveload.errors import UserError

LATENT_CHANNELS = 16
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
"""Beside the manifest: the text encoder's output for the empty prompt (tensor "text", [L, text_dim]), which
adaptive_load.caption_dropout trains with in place of a sample's caption (train/captions.py)."""


# ----------------------------------------------------------------------------------------------------
# `python -m ds_adaptiveload synthesize`


def add_arguments(p):
    from ds_adaptiveload.flags import non_negative_int, positive_int
    from ds_adaptiveload.schedule.mixes import MIXES

    p.add_argument("--out", required=True, help="folder for manifest.jsonl and the safetensors shards")
    p.add_argument("--num", type=positive_int, required=True, help="number of samples")
    p.add_argument("--mix", default="video-heavy", choices=sorted(MIXES),
                   help="shape mix (ds_adaptiveload/schedule/mixes.py); 'tiny' suits the tiny model on CPU")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the shapes and the random values")
    p.add_argument("--text-dim", type=positive_int, default=4096, help="text embedding width (umT5-XXL: 4096)")
    p.add_argument("--text-len", type=positive_int, default=512,
                   help="longest text context; lengths are drawn in [8, this]")
    p.add_argument("--shard-size", type=positive_int, default=64, help="samples per safetensors shard")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="stored dtype")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dataset in --out (without it, a folder holding a manifest.jsonl is refused)")


def run(args) -> int:
    from ds_adaptiveload.schedule.mixes import make_mix

    check_out(args.out, args.overwrite)
    path = write_synthetic(args.out, make_mix(args.mix, args.num, args.seed), text_dim=args.text_dim,
                           max_text_len=args.text_len, seed=args.seed, shard_size=args.shard_size,
                           dtype=args.dtype)
    print(f"wrote {args.num} samples ({args.mix}) to {path}")
    return 0


def check_out(out, overwrite: bool) -> None:
    """--out: a folder (or one to create) whose dataset, if any, is replaced only with --overwrite: a dataset written
    over another keeps the old shards the new manifest does not name, and may be one a run still reads."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: is a file; give a folder")
    manifest = os.path.join(out, "manifest.jsonl")
    if os.path.exists(manifest) and not overwrite:
        raise UserError(f"--out {out}: holds a dataset already ({manifest}); pass --overwrite to replace it, or "
                        f"choose another folder")


def write_synthetic(out_dir, samples, text_dim=4096, max_text_len=512, seed=0, shard_size=64,
                    dtype="bf16", geometry=None) -> str:
    """Write random latents/text embeddings of the samples' shapes as shards + manifest.jsonl; returns the
    manifest path. The samples' `extra` gets the shard keys."""
    import torch
    from safetensors.torch import save_file

    from ds_adaptiveload.schedule.geometry import Geometry
    from ds_adaptiveload.schedule.manifest import write_manifest

    geometry = geometry or Geometry()
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(samples), shard_size):
        name = f"shard-{start // shard_size:05d}.safetensors"
        tensors = {}
        for s in samples[start:start + shard_size]:
            shape = geometry.latent_shape(s.frames, s.height, s.width)
            L = int(torch.randint(min(8, max_text_len), max_text_len + 1, (1,), generator=gen))
            tensors[f"{s.id}/latent"] = torch.randn(LATENT_CHANNELS, *shape, generator=gen).to(tdtype)
            tensors[f"{s.id}/text"] = torch.randn(L, text_dim, generator=gen).to(tdtype)
            s.extra = {**s.extra, "shard": name, "latent_key": f"{s.id}/latent", "text_key": f"{s.id}/text",
                       "latent_dtype": dtype}
        save_file(tensors, os.path.join(out_dir, name))
    # A stand-in for the empty prompt's embedding (umT5 encodes "" as one token), so caption dropout runs here too.
    save_file({"text": torch.randn(1, text_dim, generator=gen).to(tdtype)}, os.path.join(out_dir, EMPTY_PROMPT_FILE))
    path = os.path.join(out_dir, "manifest.jsonl")
    write_manifest(path, samples)
    return path


# ----------------------------------------------------------------------------------------------------
# Reading


def _where(sample, manifest):
    return f"{manifest}:{sample.line}" if sample.line else str(manifest)


def _shard_path(sample, root, manifest, external=False):
    """The sample's shard file. A shard outside the manifest's folder (an absolute path, or one through `..`) is
    refused unless `external`: a manifest from elsewhere could otherwise make the run open any file the user can
    read. The check is on the path as written; a symbolic link inside the folder is followed."""
    missing = [k for k in ("shard", "latent_key", "text_key") if k not in sample.extra]
    if missing:
        raise UserError(f"{_where(sample, manifest)}: sample {sample.id!r} lacks key(s) {', '.join(missing)} "
                        f"(a training manifest names its safetensors shard and tensor keys)")
    name = sample.extra["shard"]
    path = os.path.normpath(os.path.join(root, name))
    if not external and (os.path.isabs(name) or os.path.commonpath([root, path]) != root):
        raise UserError(f"{_where(sample, manifest)}: sample {sample.id!r}: shard {name!r} is outside the manifest's "
                        f"folder {root}; shards are read there only (allow others with the trainer's "
                        f"--allow-external-shards, or LatentDataset(..., external_shards=True))")
    return path


SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors format's own limit on its JSON header, in bytes


def _not_safetensors(path):
    """Why the file at `path` cannot be a safetensors file (its 8-byte little-endian header length, then a JSON
    object that fits in the file), or None. Read before safe_open, so that a foreign file (a manifest naming
    /etc/passwd, a video) is named as such, not failed on inside the reader."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(9)
    n = int.from_bytes(head[:8], "little") if len(head) == 9 else -1
    if not 2 <= n <= min(size - 8, SAFETENSORS_MAX_HEADER) or head[8:9] != b"{":
        return f"not a safetensors file ({size} bytes, no safetensors header)"
    return None


# safetensors header dtype -> the manifest's optional `latent_dtype` spelling; latents must be floats.
FLOAT_DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def _open_shard(path):
    """(safe_open handle, None), or (None, why the shard cannot be read: missing, not a file, not safetensors)."""
    from safetensors import safe_open

    if not os.path.exists(path):
        return None, "shard missing"
    if not os.path.isfile(path):
        return None, "not a regular file"
    problem = _not_safetensors(path)
    if problem:
        return None, problem
    try:
        return safe_open(path, framework="pt"), None
    except Exception as e:  # a truncated or foreign file; safetensors raises its own types
        return None, f"not a readable safetensors file ({e})"


def check_samples(samples, manifest, geometry, text_dim, on_bad="error", external_shards=False) -> list:
    """Fail before training on a missing or unreadable (e.g. truncated) shard, a missing tensor, a latent
    whose shape disagrees with the manifest or whose dtype is not a float (or not the manifest's
    `latent_dtype`). Reads only the safetensors headers (cheap), once per shard. on_bad="skip": return
    [(sample, reason)] of the bad samples instead of raising at the first. external_shards: shards outside the
    manifest's folder may be read (_shard_path)."""
    root = os.path.dirname(os.path.abspath(manifest))
    by_shard, bad = {}, []

    def fail(s, msg):
        if on_bad != "skip":
            raise UserError(msg)
        bad.append((s, msg))

    for s in samples:
        try:
            by_shard.setdefault(_shard_path(s, root, manifest, external_shards), []).append(s)
        except UserError as e:
            fail(s, str(e))
    for path, group in by_shard.items():
        f, problem = _open_shard(path)
        for s in group if f is None else ():
            if problem == "shard missing":
                fail(s, f"{path}: shard missing (needed by sample {s.id!r}, {_where(s, manifest)}"
                        f"{' and %d more' % (len(group) - 1) if len(group) > 1 and s is group[0] else ''})")
            else:
                fail(s, f"{path}: {problem} (sample {s.id!r}, {_where(s, manifest)})")
        if f is None:
            continue
        with f:
            keys = set(f.keys())
            for s in group:
                missing = [k for k in (s.extra["latent_key"], s.extra["text_key"]) if k not in keys]
                if missing:
                    fail(s, f"{path}: no tensor {missing[0]!r} for sample {s.id!r} ({_where(s, manifest)})")
                    continue
                lat = f.get_slice(s.extra["latent_key"])
                problem = _layout_problem(s, path, manifest, geometry, text_dim, lat.get_shape(),
                                          FLOAT_DTYPES.get(lat.get_dtype()), lat.get_dtype(),
                                          f.get_slice(s.extra["text_key"]).get_shape())
                if problem:
                    fail(s, problem)
    return bad


def _layout_problem(s, path, manifest, geometry, text_dim, latent_shape, dtype, dtype_label, text_shape):
    """The error message for a latent/text whose shape or dtype disagrees with the manifest and model, or
    None. Shared by the header check before training and the Dataset's read."""
    want = (LATENT_CHANNELS, *geometry.latent_shape(s.frames, s.height, s.width))
    if tuple(latent_shape) != want:
        return (f"{path}: sample {s.id!r} latent has shape {list(latent_shape)}, but the manifest's "
                f"{s.frames}x{s.height}x{s.width} needs {list(want)} ({_where(s, manifest)})")
    if dtype is None or s.extra.get("latent_dtype", dtype) != dtype:
        return (f"{path}: sample {s.id!r} latent has dtype {dtype_label}, the manifest says "
                f"{s.extra.get('latent_dtype', 'a float (fp32, fp16, bf16)')} ({_where(s, manifest)})")
    if len(text_shape) != 2 or text_shape[1] != text_dim:
        return (f"{path}: sample {s.id!r} text embedding has shape {list(text_shape)}, the model "
                f"needs [L, {text_dim}] ({_where(s, manifest)})")
    return None


class LatentDataset:
    """torch Dataset over manifest samples. `__getitems__(indices)` (what DataLoader calls with a
    batch_sampler) reads one micro-batch and returns, for samples of one shape,
    {'latent': [B, 16, F', H', W'], 'text': [B, text_len, text_dim], 'index': [...], 'ids': [...]};
    for samples of several shapes (packed), {'latent': list of [16, F'_i, H'_i, W'_i], 'text': list of
    [L_i <= text_len, text_dim] (unpadded: the packed model pads), 'index', 'ids'}, reordered so samples of
    one shape are contiguous (stable: the packed planner already emits that order), the four in one order.
    Tensors keep the stored dtype; the trainer casts on the device."""

    def __init__(self, samples, manifest, geometry, text_len, text_dim, on_bad="error", external_shards=False):
        self.samples, self.manifest, self.geometry = samples, manifest, geometry
        self.external_shards = external_shards
        """Read shards outside the manifest's folder too (refused by default: _shard_path)."""
        self.on_bad = on_bad
        """error: a bad sample raises UserError; skip: the micro-batch comes back as {'bad': [(id, reason)],
        'index', 'ids'} without tensors, and the trainer skips the step on every rank."""
        self.root = os.path.dirname(os.path.abspath(manifest))
        self.text_len, self.text_dim = text_len, text_dim
        self._open = {}  # shard path -> safe_open handle, per worker process

    def __len__(self):
        return len(self.samples)

    def _read(self, i):
        import torch

        s = self.samples[i]
        path = _shard_path(s, self.root, self.manifest, self.external_shards)
        f = self._open.get(path)
        if f is None:
            if len(self._open) >= 16:  # bound open files/mmaps per worker
                self._open.pop(next(iter(self._open))).__exit__(None, None, None)
            f, problem = _open_shard(path)
            if f is None:
                raise UserError(f"{path}: {problem} (sample {s.id!r}, {_where(s, self.manifest)})")
            self._open[path] = f.__enter__()
        try:
            latent = f.get_tensor(s.extra["latent_key"])
            text = f.get_tensor(s.extra["text_key"])[: self.text_len]
        except Exception as e:  # tensor missing, or the file changed under the open handle
            raise UserError(f"{path}: cannot read sample {s.id!r} ({e}) ({_where(s, self.manifest)})") from None
        dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(latent.dtype)
        problem = _layout_problem(s, path, self.manifest, self.geometry, self.text_dim, latent.shape, dtype,
                                  latent.dtype, text.shape)
        if problem:
            raise UserError(problem)
        for name, t in (("latent", latent), ("text embedding", text)):
            if not torch.isfinite(t).all():
                n = int((~torch.isfinite(t)).sum())
                raise UserError(f"{path}: sample {s.id!r} {name} has {n} NaN/Inf value(s) ({_where(s, self.manifest)})")
        return latent, text

    def __getitems__(self, indices):
        import torch

        shapes = [self._shape(i) for i in indices]
        packed = len(set(shapes)) > 1
        if packed:  # group by shape, first-seen order of shapes, stable within a shape
            first = {}
            for sh in shapes:
                first.setdefault(sh, len(first))
            indices = [i for _, i in sorted(zip(shapes, indices), key=lambda p: first[p[0]])]
        ids = [self.samples[i].id for i in indices]
        if self.on_bad == "skip":
            read, bad = [], []
            for i in indices:
                try:
                    read.append(self._read(i))
                except UserError as e:
                    bad.append((self.samples[i].id, str(e)))
            if bad:
                return {"bad": bad, "index": list(indices), "ids": ids}
        else:
            read = [self._read(i) for i in indices]
        latents, texts = zip(*read)
        if packed:
            return {"latent": list(latents), "text": list(texts), "index": list(indices), "ids": ids}
        text = torch.zeros(len(indices), self.text_len, self.text_dim, dtype=texts[0].dtype)
        for b, t in enumerate(texts):
            text[b, : t.shape[0]] = t
        return {"latent": torch.stack(latents), "text": text, "index": list(indices), "ids": ids}

    def __getitem__(self, i):
        return self.__getitems__([i])

    def _shape(self, i):
        s = self.samples[i]
        return (s.frames, s.height, s.width)


def first(batch):
    """collate_fn: __getitems__ already returns the stacked micro-batch."""
    return batch


class PlannedStep:
    """One optimizer step for this rank, as the training loop needs it."""

    def __init__(self, batch, epoch, state):
        self.step, self.epoch, self.state = batch.step, epoch, state
        self.micro_batches = batch.micro_batches
        self.pred_ms = list(batch.pred_ms)
        self.pred_wall_ms = batch.pred_wall_ms
        self.pad = [m for m, is_pad in enumerate(batch.pad) if is_pad]
        """This rank's pad micro-batches (repeats that keep ranks in lockstep; zero loss weight)."""
        self.global_samples = batch.global_samples
        """Real samples of the step over all dp ranks: the loss normalizer N."""
        self.all_micro_batches = batch.all_micro_batches
        """Every dp rank's micro-batches of the step (sample indices), as planned."""


class MicroBatchStream:
    """batch_sampler for the DataLoader: the AdaptiveSampler's steps, flattened into micro-batches, epoch
    after epoch. The DataLoader draws ahead (prefetch), so every step drawn is queued in `pending` as a
    PlannedStep carrying the sampler state taken right after drawing it; the training loop pops one per
    step and checkpoints that state, which points at the step after the last one trained, not at the
    prefetched one."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.pending = deque()

    def __iter__(self):
        while True:
            epoch = self.sampler.epoch
            drawn = False
            for batch in self.sampler:
                drawn = True
                self.pending.append(PlannedStep(batch, epoch, self.sampler.state_dict()))
                yield from batch.micro_batches
            if not drawn and len(self.sampler) == 0:
                raise UserError("the sampler planned no steps (is every sample oversize and skipped?)")
            self.sampler.set_epoch(epoch + 1)
