"""State-dict key conversion between the original Wan 2.1 names (ours) and diffusers'
WanTransformer3DModel. Pure key mapping: tensors are passed through untouched (no torch import)."""
import re

from ds_adaptiveload.errors import UserError

# (ours, diffusers) prefixes for the non-block parameters.
_TOP = [
    ("patch_embedding.", "patch_embedding."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
]
# (ours, diffusers) suffixes inside blocks.N. Wan's norm3 (affine, before cross-attention) is
# diffusers' norm2; the parameter-free norm1/norm2 have no keys.
_ATTN = [("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."), ("o.", "to_out.0."),
         ("norm_q.", "norm_q."), ("norm_k.", "norm_k.")]
_BLOCK = ([(f"self_attn.{a}", f"attn1.{b}") for a, b in _ATTN]
          + [(f"cross_attn.{a}", f"attn2.{b}") for a, b in _ATTN]
          + [("norm3.", "norm2."), ("ffn.0.", "ffn.net.0.proj."), ("ffn.2.", "ffn.net.2."),
             ("modulation", "scale_shift_table")])
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _rename(key: str, forward: bool) -> str:
    src, dst = (0, 1) if forward else (1, 0)
    m = _BLOCK_KEY.match(key)
    table, rest, prefix = (_BLOCK, m.group(2), f"blocks.{m.group(1)}.") if m else (_TOP, key, "")
    for pair in table:
        if rest.startswith(pair[src]):
            return prefix + pair[dst] + rest[len(pair[src]):]
    side = "Wan" if forward else "diffusers"
    raise UserError(f"state dict key {key!r} is not a known {side} Wan 2.1 T2V parameter")


def to_diffusers(sd: dict) -> dict:
    """Our (original Wan 2.1) state dict -> diffusers WanTransformer3DModel keys (same tensors)."""
    return {_rename(k, True): v for k, v in sd.items()}


def from_diffusers(sd: dict) -> dict:
    """diffusers WanTransformer3DModel state dict -> our (original Wan 2.1) keys (same tensors)."""
    return {_rename(k, False): v for k, v in sd.items()}


def diffusers_config(cfg) -> dict:
    """Constructor kwargs of diffusers.WanTransformer3DModel equal to WanConfig `cfg`.

    diffusers always builds norm_q/norm_k, so a qk_norm=False model has no strict diffusers twin."""
    return dict(
        patch_size=tuple(cfg.patch_size),
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim,
        out_channels=cfg.out_dim,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=cfg.cross_attn_norm,
        qk_norm="rms_norm_across_heads" if cfg.qk_norm else None,
        eps=cfg.eps,
        image_dim=None,
        added_kv_proj_dim=None,
    )
