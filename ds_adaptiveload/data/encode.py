"""`python -m ds_adaptiveload encode`: a `manifest` of captioned videos and images -> the latent dataset
training reads (latents.py's format), with Wan 2.1's VAE (diffusers AutoencoderKLWan) and umT5 encoder
(transformers UMT5EncoderModel).

Per sample: frames decoded as the manifest mapped them (frames.py), scaled to [-1, 1], encoded by the VAE;
the latent is the posterior mean normalised per channel, (mu - latents_mean) / latents_std, which is what
diffusers' Wan pipeline undoes before decoding (x = z * std + mean). The caption is tokenised to at most
--text-len tokens and the encoder's hidden states are kept unpadded, [L, text_dim], as Wan pads them to
text_len itself (latents.py pads on read).

Layout: samples, in manifest order, are cut into shards of --shard-size; shard k belongs to rank
k % world (torchrun or the deepspeed launcher set RANK / WORLD_SIZE), so ranks encode disjoint slices.
A shard is written whole to a `.partial` file and renamed, and its safetensors metadata lists its ids and
the errors of samples that could not be decoded: a re-run skips every shard whose file holds exactly its
ids, and rewrites an interrupted (or changed) one. When all ranks are done, rank 0 merges the shards'
metadata into OUT/manifest.jsonl and OUT/errors.jsonl.
"""
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train import failures

DTYPES = ("bf16", "fp32")  # no fp16: T5-family encoders overflow in it
SAVE_DTYPE = "bf16"


def add_arguments(p):
    p.add_argument("--manifest", required=True, help="manifest from `manifest` (with path and caption per line)")
    p.add_argument("--vae", required=True, help="diffusers AutoencoderKLWan folder (a save_pretrained folder, "
                   "the Wan2.1 diffusers repo's vae/, or the repo itself)")
    p.add_argument("--text-encoder", required=True, help="transformers UMT5EncoderModel folder (text_encoder/ "
                   "of the Wan2.1 diffusers repo, or the repo)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --text-encoder if it holds one, else the "
                   "tokenizer/ folder beside it)")
    p.add_argument("--out", required=True, help="folder for the shards, manifest.jsonl and errors.jsonl")
    p.add_argument("--batch-size", type=int, default=1, help="samples of one shape per VAE call; captions "
                   "per text-encoder call (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype of both models (default "
                   "bf16); latents and text states are stored in bf16")
    p.add_argument("--text-len", type=int, default=512, help="longest caption in tokens (Wan: 512)")
    p.add_argument("--shard-size", type=int, default=64, help="samples per safetensors shard (default 64)")
    p.add_argument("--vae-tiling", action="store_true", help="encode in overlapping spatial tiles "
                   "(diffusers enable_tiling) to bound memory at 720p and above")
    p.add_argument("--decode-workers", type=int, default=4, help="threads decoding video ahead of the "
                   "encoders (default 4)")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")


# ---------------------------------------------------------------------------------------------------- models


@dataclass
class Models:
    vae: object
    text_encoder: object
    tokenizer: object
    device: object
    dtype: object


def _folder(path, arg, sub, marker):
    """The model folder: `path` itself when it holds `marker`, else its `sub` folder (a whole diffusers
    repo), else a UserError naming the argument."""
    if not os.path.isdir(path):
        raise UserError(f"{arg} {path}: not a folder")
    for d in (path, os.path.join(path, sub)):
        if os.path.isfile(os.path.join(d, marker)):
            return d
    raise UserError(f"{arg} {path}: no {marker} here or in {sub}/ (expected a save_pretrained folder)")


def tokenizer_folder(te_dir, tok):
    if tok:
        return _folder(tok, "--tokenizer", "tokenizer", "tokenizer_config.json")
    for d in (te_dir, os.path.join(te_dir, "tokenizer"), os.path.join(os.path.dirname(te_dir.rstrip("/")), "tokenizer")):
        if os.path.isfile(os.path.join(d, "tokenizer_config.json")):
            return d
    raise UserError(f"--text-encoder {te_dir}: no tokenizer in it, in tokenizer/ or beside it; give --tokenizer")


def model_folders(args) -> tuple:
    """(vae, text encoder, tokenizer) folders, checked before anything is written."""
    return (_folder(args.vae, "--vae", "vae", "config.json"),
            _folder(args.text_encoder, "--text-encoder", "text_encoder", "config.json"),
            tokenizer_folder(args.text_encoder, args.tokenizer))


def load_models(args, folders, device) -> Models:
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ds_adaptiveload.data.latents import LATENT_CHANNELS

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    vae_dir, te_dir, tok_dir = folders
    vae = AutoencoderKLWan.from_pretrained(vae_dir, torch_dtype=dtype).to(device).eval()
    if vae.config.z_dim != LATENT_CHANNELS:
        raise UserError(f"--vae {vae_dir}: z_dim {vae.config.z_dim}, training expects {LATENT_CHANNELS} channels")
    if args.vae_tiling:
        vae.enable_tiling()
    te = UMT5EncoderModel.from_pretrained(te_dir, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    return Models(vae, te, tok, device, dtype)


def latent_stats(vae, device):
    """Wan's per-channel latents_mean / latents_std as [1, C, 1, 1, 1] float32 tensors."""
    import torch

    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32, device=device).view(shape)
    return mean, std


def encode_videos(vae, x):
    """[B, 3, F, H, W] in [-1, 1] -> normalised latents [B, 16, F', H/8, W/8], float32: the posterior mean,
    (mu - latents_mean) / latents_std."""
    import torch

    mean, std = latent_stats(vae, x.device)
    with torch.inference_mode():
        mu = vae.encode(x.to(vae.dtype)).latent_dist.mean
    return (mu.float() - mean) / std


def encode_texts(text_encoder, tokenizer, captions, text_len, device):
    """Captions -> list of unpadded hidden states [L_i, text_dim] (L_i <= text_len), as Wan's pipeline
    computes them before padding, from captions cleaned as it cleans prompts (so training and inference
    see the same text)."""
    import torch
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokens = tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=text_len, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    with torch.inference_mode():
        hidden = text_encoder(ids, attention_mask=mask).last_hidden_state
    return [h[: int(n)] for h, n in zip(hidden, mask.sum(dim=1))]


def write_empty_prompt(models, out, text_len) -> str:
    """OUT/empty_prompt.safetensors: the empty prompt's hidden states (the unconditional input of classifier-free
    guidance), which adaptive_load.caption_dropout puts in place of a dropped caption. Written once, by rank 0."""
    import torch
    from safetensors.torch import save_file

    from ds_adaptiveload.data.latents import EMPTY_PROMPT_FILE

    (text,) = encode_texts(models.text_encoder, models.tokenizer, [""], text_len, models.device)
    path = os.path.join(out, EMPTY_PROMPT_FILE)
    save_file({"text": text.to({"bf16": torch.bfloat16}[SAVE_DTYPE]).cpu().contiguous()}, path + ".partial")
    os.replace(path + ".partial", path)
    return path


# ---------------------------------------------------------------------------------------------------- shards


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def read_shard_meta(path):
    """The shard's metadata {ids: [...], errors: {id: reason}}, or None when the file is absent or not a
    complete safetensors file."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        return dict(ids=json.loads(meta["ids"]), errors=json.loads(meta["errors"]))
    except Exception:  # torn or foreign file: encode the shard again
        return None


def _grouped(items, size):
    """Consecutive chunks of `items` of at most `size`."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def _decode_ahead(pool, samples, decode, ahead):
    """Futures of decode(record) in sample order, at most `ahead` submitted beyond the one consumed: decoded
    clips are large (81 x 720 x 1280 x 3 bytes = 224 MB), so they must not pile up faster than encoding."""
    from collections import deque

    queue, it = deque(), iter(samples)
    for s in it:
        queue.append(pool.submit(decode, {"id": s.id, "frames": s.frames, "height": s.height, "width": s.width,
                                          **s.extra}))
        if len(queue) > ahead:
            yield queue.popleft()
    yield from queue


def encode_shard(models, samples, path, args, pool, bar):
    """Encode one shard's samples and write it atomically; returns the number of errors."""
    import torch
    from safetensors.torch import save_file

    from ds_adaptiveload.data.frames import DecodeError, decode_sample, to_model_input

    tensors, errors = {}, {}
    save = {"bf16": torch.bfloat16}[SAVE_DTYPE]
    caps = [s.extra.get("caption") or "" for s in samples]
    for group in _grouped(list(range(len(samples))), max(1, args.batch_size)):
        for i, t in zip(group, encode_texts(models.text_encoder, models.tokenizer, [caps[i] for i in group],
                                            args.text_len, models.device)):
            tensors[f"{samples[i].id}/text"] = t.to("cpu", save).contiguous()
    # Decode ahead in threads (PyAV releases the GIL), encode in order, batching equal shapes.
    futures = _decode_ahead(pool, samples, decode_sample, ahead=2 * args.decode_workers + args.batch_size)
    pending = {}  # (frames, height, width) -> [(sample, pixels)]

    def flush(key):
        batch = pending.pop(key)
        x = torch.stack([to_model_input(p) for _, p in batch]).to(models.device)
        for (s, _), z in zip(batch, encode_videos(models.vae, x)):
            tensors[f"{s.id}/latent"] = z.to("cpu", save).contiguous()
        bar.update(len(batch))

    for s, fut in zip(samples, futures):
        try:
            pixels = fut.result()
        except DecodeError as e:
            errors[s.id] = str(e)
        except Exception as e:  # an OS or decoder error specific to this file: record it, keep going
            errors[s.id] = f"{type(e).__name__}: {e}"
        else:
            key = (s.frames, s.height, s.width)
            pending.setdefault(key, []).append((s, pixels))
            if len(pending[key]) >= args.batch_size:
                flush(key)
            continue
        tensors.pop(f"{s.id}/text", None)
        bar.update(1)
    for key in list(pending):
        flush(key)
    meta = {"ids": json.dumps([s.id for s in samples]), "errors": json.dumps(errors)}
    save_file(tensors, path + ".partial", metadata=meta)
    os.replace(path + ".partial", path)
    return len(errors)


def merge(out, samples, shard_size):
    """Rank 0, once every shard is written: OUT/manifest.jsonl (the input lines of the encoded samples,
    in input order, with shard, latent_key, text_key, latent_dtype) and OUT/errors.jsonl."""
    from ds_adaptiveload.schedule.manifest import Sample, write_manifest

    encoded, errors = [], []
    for k, chunk in enumerate(_grouped(samples, shard_size)):
        meta = read_shard_meta(os.path.join(out, shard_name(k)))
        if meta is None or meta["ids"] != [s.id for s in chunk]:
            raise UserError(f"{os.path.join(out, shard_name(k))}: missing or stale after encoding; run again")
        for s in chunk:
            if s.id in meta["errors"]:
                errors.append(dict(id=s.id, path=s.extra.get("path"), reason=meta["errors"][s.id]))
                continue
            extra = {**s.extra, "shard": shard_name(k), "latent_key": f"{s.id}/latent",
                     "text_key": f"{s.id}/text", "latent_dtype": SAVE_DTYPE}
            encoded.append(Sample(s.id, s.frames, s.height, s.width, extra, s.line))
    path = os.path.join(out, "manifest.jsonl")
    write_manifest(path + ".partial", encoded)
    os.replace(path + ".partial", path)
    with open(os.path.join(out, "errors.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in errors)
    return len(encoded), len(errors)


def check_inputs(args, samples):
    for name, v, lo in (("--batch-size", args.batch_size, 1), ("--shard-size", args.shard_size, 1),
                        ("--text-len", args.text_len, 1), ("--decode-workers", args.decode_workers, 1)):
        if v < lo:
            raise UserError(f"{name} {v}: must be >= {lo}")
    for s in samples:
        missing = [k for k in ("path", "caption") if k not in s.extra]
        if missing:
            raise UserError(f"{args.manifest}:{s.line}: sample {s.id!r} has no {' or '.join(missing)} (write the "
                            f"manifest with `python -m ds_adaptiveload manifest`, which reads captions)")


def check_settings(args, folders, rank):
    """OUT/encode.json: resuming with other models or settings would mix two encodings in one dataset."""
    path = os.path.join(args.out, "encode.json")
    vae, te, tok = (os.path.abspath(d) for d in folders)
    params = dict(manifest=os.path.abspath(args.manifest), vae=vae, text_encoder=te, tokenizer=tok,
                  dtype=args.dtype, text_len=args.text_len,
                  shard_size=args.shard_size, vae_tiling=args.vae_tiling, save_dtype=SAVE_DTYPE)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        diff = {k: (old.get(k), v) for k, v in params.items() if old.get(k) != v}
        if diff:
            raise UserError(f"{args.out} was encoded with other settings ({path}): " + ", ".join(
                f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()) + "; use a new --out")
    elif rank == 0:
        with open(path + ".partial", "w") as f:
            json.dump(params, f, indent=1)
        os.replace(path + ".partial", path)


def _distributed():
    """(rank, world, local_rank, finish) from torchrun / deepspeed-launcher variables; gloo serves the agreements
    (failures.agreed), so no GPU collective is needed and one slow rank cannot time out the others (24 h)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, local_rank, lambda: None
    from datetime import timedelta

    import torch.distributed as dist

    if dist.is_initialized():  # a caller's group: leave it to them
        return dist.get_rank(), dist.get_world_size(), local_rank, lambda: None
    dist.init_process_group("gloo", timeout=timedelta(hours=24))
    failures.register_rank()  # a peer that finds this rank's process gone names it
    return dist.get_rank(), dist.get_world_size(), local_rank, dist.destroy_process_group


def prepare_out(args, folders, rank) -> None:
    os.makedirs(args.out, exist_ok=True)
    check_settings(args, folders, rank)


def encode_mine(args, folders, shards, mine, rank, world, local_rank) -> None:
    """Encode this rank's shards that are not done yet, and on rank 0 the empty prompt (no collectives: the caller
    agrees on the error)."""
    import torch
    from tqdm import tqdm

    from ds_adaptiveload.data.latents import EMPTY_PROMPT_FILE

    todo = [k for k in mine if (read_shard_meta(os.path.join(args.out, shard_name(k))) or {}).get("ids")
            != [s.id for s in shards[k]]]
    n_mine = sum(len(shards[k]) for k in mine)
    n_todo = sum(len(shards[k]) for k in todo)
    t0, n_err, models = time.perf_counter(), 0, None
    device = torch.device(args.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"))
    if todo:
        models = load_models(args, folders, device)
        bar = tqdm(total=n_mine, initial=n_mine - n_todo, unit="sample", desc=f"encode rank {rank}/{world}",
                   disable=None if rank == 0 else True, dynamic_ncols=True)
        with ThreadPoolExecutor(args.decode_workers) as pool, bar:
            for k in todo:
                n_err += encode_shard(models, shards[k], os.path.join(args.out, shard_name(k)), args, pool, bar)
    dt = time.perf_counter() - t0
    print(f"[encode rank {rank}/{world}] {n_todo} samples encoded ({n_err} errors), {n_mine - n_todo} already "
          f"done, in {dt:.1f} s ({n_todo / dt if dt > 0 and n_todo else 0:.2f} samples/s)", file=sys.stderr)
    if rank == 0 and not os.path.isfile(os.path.join(args.out, EMPTY_PROMPT_FILE)):
        write_empty_prompt(models or load_models(args, folders, device), args.out, args.text_len)


def merged(args, samples) -> None:
    n_ok, n_bad = merge(args.out, samples, args.shard_size)
    print(f"{os.path.join(args.out, 'manifest.jsonl')}: {n_ok} samples; {n_bad} errors "
          f"({os.path.join(args.out, 'errors.jsonl')})", file=sys.stderr)


def run(args) -> int:
    """Every stage after the process group exists runs on each rank and is agreed (failures.agreed): an error on one
    rank (a full disk, out of memory, a stale shard) ends every rank with one error line and the same exit code,
    where that rank alone used to exit while its peers died in the next barrier with gloo's traceback."""
    from ds_adaptiveload.schedule.manifest import load_manifest

    samples = load_manifest(args.manifest)
    check_inputs(args, samples)
    folders = model_folders(args)
    rank, world, local_rank, finish = _distributed()
    failures.agreed(prepare_out, args, folders, rank)  # also the barrier before the other ranks read encode.json
    shards = _grouped(samples, args.shard_size)
    mine = [k for k in range(len(shards)) if k % world == rank]
    failures.agreed(encode_mine, args, folders, shards, mine, rank, world, local_rank)
    failures.agreed(merged if rank == 0 else lambda *a: None, args, samples)
    finish()
    return 0
