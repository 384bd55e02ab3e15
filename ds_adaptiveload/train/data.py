"""Latent datasets: the on-disk format, `python -m ds_adaptiveload synthesize`, and the torch side that
reads one micro-batch at a time.

On disk: a manifest (manifest.py) whose lines also carry
  shard       safetensors file holding the sample, relative to the manifest's folder
  latent_key  tensor [C=16, F', H/8, W/8] (VAE latent; F' = (frames-1)/4 + 1)
  text_key    tensor [L <= 512, text_dim] (text-encoder output, unpadded)
Synthetic data has these shapes and random values: it measures speed, not quality.

A micro-batch is a list of sample indices of one shape (the planner guarantees it), so samples stack
without padding; text contexts are zero-padded to the model's text_len as Wan does.
"""
import os
from collections import deque

from ds_adaptiveload.errors import UserError

LATENT_CHANNELS = 16


# ----------------------------------------------------------------------------------------------------
# `python -m ds_adaptiveload synthesize`


def add_arguments(p):
    from ds_adaptiveload.mixes import MIXES

    p.add_argument("--out", required=True, help="folder for manifest.jsonl and the safetensors shards")
    p.add_argument("--num", type=int, required=True, help="number of samples")
    p.add_argument("--mix", default="video-heavy", choices=sorted(MIXES),
                   help="shape mix (ds_adaptiveload/mixes.py); 'tiny' suits the tiny model on CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the shapes and the random values")
    p.add_argument("--text-dim", type=int, default=4096, help="text embedding width (umT5-XXL: 4096)")
    p.add_argument("--text-len", type=int, default=512, help="longest text context; lengths are drawn in [8, this]")
    p.add_argument("--shard-size", type=int, default=64, help="samples per safetensors shard")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="stored dtype")


def run(args) -> int:
    if args.num < 1:
        raise UserError(f"--num must be >= 1, got {args.num}")
    from ds_adaptiveload.mixes import make_mix

    path = write_synthetic(args.out, make_mix(args.mix, args.num, args.seed), text_dim=args.text_dim,
                           max_text_len=args.text_len, seed=args.seed, shard_size=args.shard_size,
                           dtype=args.dtype)
    print(f"wrote {args.num} samples ({args.mix}) to {path}")
    return 0


def write_synthetic(out_dir, samples, text_dim=4096, max_text_len=512, seed=0, shard_size=64,
                    dtype="bf16", geometry=None) -> str:
    """Write random latents/text embeddings of the samples' shapes as shards + manifest.jsonl; returns the
    manifest path. The samples' `extra` gets the shard keys."""
    import torch
    from safetensors.torch import save_file

    from ds_adaptiveload.geometry import Geometry
    from ds_adaptiveload.manifest import write_manifest

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
            s.extra = {**s.extra, "shard": name, "latent_key": f"{s.id}/latent", "text_key": f"{s.id}/text"}
        save_file(tensors, os.path.join(out_dir, name))
    path = os.path.join(out_dir, "manifest.jsonl")
    write_manifest(path, samples)
    return path


# ----------------------------------------------------------------------------------------------------
# Reading


def _where(sample, manifest):
    return f"{manifest}:{sample.line}" if sample.line else str(manifest)


def _shard_path(sample, root, manifest):
    missing = [k for k in ("shard", "latent_key", "text_key") if k not in sample.extra]
    if missing:
        raise UserError(f"{_where(sample, manifest)}: sample {sample.id!r} lacks key(s) {', '.join(missing)} "
                        f"(a training manifest names its safetensors shard and tensor keys)")
    return os.path.join(root, sample.extra["shard"])


def check_samples(samples, manifest, geometry, text_dim) -> None:
    """Fail before training on a missing shard, a missing tensor or a latent whose shape disagrees with
    the manifest. Reads only the safetensors headers (cheap), once per shard."""
    from safetensors import safe_open

    root = os.path.dirname(os.path.abspath(manifest))
    by_shard = {}
    for s in samples:
        by_shard.setdefault(_shard_path(s, root, manifest), []).append(s)
    for path, group in by_shard.items():
        if not os.path.isfile(path):
            raise UserError(f"{path}: shard missing (needed by sample {group[0].id!r}, "
                            f"{_where(group[0], manifest)}{' and %d more' % (len(group) - 1) if len(group) > 1 else ''})")
        try:
            f = safe_open(path, framework="pt")
        except Exception as e:  # a truncated or foreign file; safetensors raises its own types
            raise UserError(f"{path}: not a readable safetensors file ({e}) (sample {group[0].id!r})") from None
        with f:
            keys = set(f.keys())
            for s in group:
                for k in (s.extra["latent_key"], s.extra["text_key"]):
                    if k not in keys:
                        raise UserError(f"{path}: no tensor {k!r} for sample {s.id!r} ({_where(s, manifest)})")
                want = (LATENT_CHANNELS, *geometry.latent_shape(s.frames, s.height, s.width))
                got = tuple(f.get_slice(s.extra["latent_key"]).get_shape())
                if got != want:
                    raise UserError(f"{path}: sample {s.id!r} latent has shape {list(got)}, but the manifest's "
                                    f"{s.frames}x{s.height}x{s.width} needs {list(want)} ({_where(s, manifest)})")
                tshape = tuple(f.get_slice(s.extra["text_key"]).get_shape())
                if len(tshape) != 2 or tshape[1] != text_dim:
                    raise UserError(f"{path}: sample {s.id!r} text embedding has shape {list(tshape)}, the model "
                                    f"needs [L, {text_dim}] ({_where(s, manifest)})")


class LatentDataset:
    """torch Dataset over manifest samples. `__getitems__(indices)` (what DataLoader calls with a
    batch_sampler) reads one micro-batch and returns
    {'latent': [B, 16, F', H', W'], 'text': [B, text_len, text_dim], 'index': [...], 'ids': [...]}.
    Tensors keep the stored dtype; the trainer casts on the device."""

    def __init__(self, samples, manifest, geometry, text_len, text_dim):
        self.samples, self.manifest, self.geometry = samples, manifest, geometry
        self.root = os.path.dirname(os.path.abspath(manifest))
        self.text_len, self.text_dim = text_len, text_dim
        self._open = {}  # shard path -> safe_open handle, per worker process

    def __len__(self):
        return len(self.samples)

    def _read(self, i):
        from safetensors import safe_open

        s = self.samples[i]
        path = _shard_path(s, self.root, self.manifest)
        f = self._open.get(path)
        if f is None:
            if not os.path.isfile(path):
                raise UserError(f"{path}: shard missing (sample {s.id!r}, {_where(s, self.manifest)})")
            if len(self._open) >= 16:  # bound open files/mmaps per worker
                self._open.pop(next(iter(self._open))).__exit__(None, None, None)
            f = self._open[path] = safe_open(path, framework="pt").__enter__()
        latent = f.get_tensor(s.extra["latent_key"])
        want = (LATENT_CHANNELS, *self.geometry.latent_shape(s.frames, s.height, s.width))
        if tuple(latent.shape) != want:
            raise UserError(f"{path}: sample {s.id!r} latent has shape {list(latent.shape)}, but the manifest's "
                            f"{s.frames}x{s.height}x{s.width} needs {list(want)} ({_where(s, self.manifest)})")
        text = f.get_tensor(s.extra["text_key"])[: self.text_len]
        if text.ndim != 2 or text.shape[1] != self.text_dim:
            raise UserError(f"{path}: sample {s.id!r} text embedding has shape {list(text.shape)}, the model "
                            f"needs [L, {self.text_dim}] ({_where(s, self.manifest)})")
        return latent, text

    def __getitems__(self, indices):
        import torch

        latents, texts = zip(*(self._read(i) for i in indices))
        text = torch.zeros(len(indices), self.text_len, self.text_dim, dtype=texts[0].dtype)
        for b, t in enumerate(texts):
            text[b, : t.shape[0]] = t
        return {"latent": torch.stack(latents), "text": text, "index": list(indices),
                "ids": [self.samples[i].id for i in indices]}

    def __getitem__(self, i):
        return self.__getitems__([i])


def first(batch):
    """collate_fn: __getitems__ already returns the stacked micro-batch."""
    return batch


class PlannedStep:
    """One optimizer step for this rank, as the training loop needs it."""

    def __init__(self, batch, epoch, state):
        self.step, self.epoch, self.state = batch.step, epoch, state
        self.micro_batches = batch.micro_batches
        self.pred_ms = list(batch.pred_ms)
        self.pad = [m for m, is_pad in enumerate(batch.pad) if is_pad]
        """This rank's pad micro-batches (repeats that keep ranks in lockstep; zero loss weight)."""
        self.global_samples = batch.global_samples
        """Real samples of the step over all dp ranks: the loss normalizer N."""


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
