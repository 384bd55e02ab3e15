"""adaptive_load.caption_dropout: a share p of the samples train on the empty prompt's embedding instead of their
caption, so the model also learns the unconditional prediction that classifier-free guidance needs at sampling.

The choice of a sample is a function of (seed, epoch, sample id) only: the same on resume, at any world size and in
any micro-batch; another epoch drops other samples. The empty prompt's embedding is the one `encode` wrote beside
the shards (data/latents.EMPTY_PROMPT_FILE)."""
import hashlib
import os

from ds_adaptiveload.errors import UserError


def dropped(seed: int, epoch: int, sample_id: str, p: float) -> bool:
    """Whether this sample's caption is replaced in this epoch: a uniform draw from a hash of the three, below p."""
    if p <= 0:
        return False
    h = hashlib.sha256(f"caption/{seed}/{epoch}/{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < p


def load_empty_prompt(manifest: str, text_dim: int):
    """The [L, text_dim] embedding beside `manifest`; a missing or wrong file is an error naming it and the key."""
    from safetensors import safe_open

    from ds_adaptiveload.data.latents import EMPTY_PROMPT_FILE

    path = os.path.join(os.path.dirname(os.path.abspath(manifest)), EMPTY_PROMPT_FILE)
    if not os.path.isfile(path):
        raise UserError(f"adaptive_load.caption_dropout needs {path}: the empty prompt's embedding, which `encode` "
                        f"writes beside the shards (re-run encode on this --out to add it)")
    try:
        with safe_open(path, framework="pt") as f:
            text = f.get_tensor("text")
    except Exception as e:  # a foreign or truncated file, or no "text" tensor
        raise UserError(f"{path}: cannot read tensor 'text' ({e})") from None
    if text.ndim != 2 or text.shape[1] != text_dim:
        raise UserError(f"{path}: tensor 'text' has shape {list(text.shape)}, the model expects [L, {text_dim}]")
    return text


def apply(batch: dict, empty, seed: int, epoch: int, p: float) -> int:
    """Replace the dropped samples' text in a micro-batch, in place: a packed micro-batch's list entry becomes the
    empty embedding; a stacked [B, text_len, text_dim] row becomes it, zero-padded. Returns how many."""
    n = 0
    for b, sid in enumerate(batch.get("ids", ())):
        if not dropped(seed, epoch, sid, p):
            continue
        n += 1
        text = batch["text"]
        if isinstance(text, list):
            text[b] = empty.to(text[b].dtype)
        else:
            row = text[b]
            row.zero_()
            L = min(empty.shape[0], row.shape[0])
            row[:L] = empty[:L].to(row.dtype)
    return n
