"""Wan 2.1 DiT configuration: shape, parameter count and FLOPs. Pure Python (no torch) so planners and
reports can use it cheaply."""
import math
from dataclasses import dataclass, fields
from math import prod

from ds_adaptiveload.errors import UserError

# --attention of the trainer and calibrate: the self-attention kernels (model/attention.resolve_attention)
ATTENTION_BACKENDS = ("auto", "sdpa", "fa4")


@dataclass
class WanConfig:
    dim: int = 1536
    """Hidden size of the transformer (1536 for Wan 2.1 1.3B, 5120 for 14B)."""
    ffn_dim: int = 8960
    """Inner size of each block's GELU-tanh feed-forward network."""
    num_heads: int = 12
    """Attention heads; head_dim = dim / num_heads must be even and at least 6 (3D RoPE split)."""
    num_layers: int = 30
    """Number of transformer blocks."""
    in_dim: int = 16
    """Latent channels in (the Wan VAE has 16)."""
    out_dim: int = 16
    """Latent channels out (the prediction, e.g. the flow-matching velocity)."""
    text_dim: int = 4096
    """Width of the text-encoder embeddings (umT5-XXL: 4096)."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding fed to the time MLP."""
    text_len: int = 512
    """Text tokens after padding with zeros / truncating the context (Wan pads to 512)."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Patch of the 3D patch embedding over (frames, height, width) of the latent."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm and RMSNorm."""
    qk_norm: bool = True
    """RMSNorm on q and k (across all heads) in self- and cross-attention."""
    cross_attn_norm: bool = True
    """Affine LayerNorm (norm3) before cross-attention; identity when False."""

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise UserError(f"WanConfig.patch_size must be 3 positive ints, got {self.patch_size}")
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim", "text_dim",
                     "freq_dim", "text_len"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"WanConfig.{name} must be a positive int, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise UserError(f"WanConfig: dim {self.dim} is not divisible by num_heads {self.num_heads}")
        hd = self.head_dim
        # RoPE rotates pairs; the head's pairs are split frames/height/width as c-2(c//3), c//3, c//3.
        if hd % 2 or hd // 2 // 3 < 1:
            raise UserError(f"WanConfig: head_dim {hd} (dim/num_heads) must be even and >= 6 for 3D RoPE")
        if self.freq_dim % 2:
            raise UserError(f"WanConfig.freq_dim must be even, got {self.freq_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Real channels of each head rotated by frame, height and width position (Wan's split)."""
        c = self.head_dim // 2
        return (2 * (c - 2 * (c // 3)), 2 * (c // 3), 2 * (c // 3))

    @classmethod
    def from_yaml(cls, path) -> "WanConfig":
        """Read a YAML mapping of WanConfig fields (top level, or under a `model:` key)."""
        from ds_adaptiveload.fileio import read_yaml

        data = read_yaml(path, "model config")
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            data = data["model"]
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping of WanConfig fields")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "WanConfig") -> "WanConfig":
        """Keys and types checked here, naming `source` and the key (a `dim: "1536"` is refused, not converted);
        values by __post_init__."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise UserError(f"{source}: unknown model config key(s) {unknown}; known: {sorted(known)}")
        for key, value in data.items():
            must = _type_problem(known[key].type, value)
            if must:
                raise UserError(f"{source}: {key} must be {must}, got {value!r}")
        try:
            return cls(**data)
        except UserError as e:
            raise UserError(f"{source}: {e}") from None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["patch_size"] = list(self.patch_size)
        return d

    def num_params(self) -> int:
        """Exact parameter count of WanModel(self) (matches sum(p.numel() for p in model.parameters()))."""
        d, f = self.dim, self.ffn_dim
        p = prod(self.patch_size)
        linear = lambda i, o: i * o + o  # noqa: E731
        attn = 4 * linear(d, d) + (2 * d if self.qk_norm else 0)
        block = 2 * attn + (2 * d if self.cross_attn_norm else 0) + linear(d, f) + linear(f, d) + 6 * d
        return (linear(self.in_dim * p, d)                                   # patch_embedding
                + linear(self.text_dim, d) + linear(d, d)                    # text_embedding
                + linear(self.freq_dim, d) + linear(d, d)                    # time_embedding
                + linear(d, 6 * d)                                           # time_projection
                + self.num_layers * block
                + linear(d, self.out_dim * p) + 2 * d)                       # head

    def flops_per_sample(self, tokens: int, text_len: int | None = None) -> float:
        """Model FLOPs of forward + backward (3x forward) for one sample of `tokens` video tokens.

        Counts matmuls (2 FLOPs per multiply-add) in every linear/conv and the attention score and
        value products (self: tokens^2, cross: tokens x text_len). Norms, RoPE, activations and the
        recompute of activation checkpointing are not counted (the usual MFU convention)."""
        d, f, s = self.dim, self.ffn_dim, int(tokens)
        l = self.text_len if text_len is None else int(text_len)
        p = prod(self.patch_size)
        macs_block = (s * 4 * d * d            # self-attn q, k, v, o
                      + 2 * s * s * d          # self-attn QK^T and PV
                      + s * 2 * d * d          # cross-attn q, o
                      + l * 2 * d * d          # cross-attn k, v on the text
                      + 2 * s * l * d          # cross-attn QK^T and PV
                      + s * 2 * d * f)         # FFN
        macs = (self.num_layers * macs_block
                + s * self.in_dim * p * d                        # patch embedding
                + l * (self.text_dim * d + d * d)                # text embedding
                + self.freq_dim * d + d * d + d * 6 * d          # time MLP + projection
                + s * d * self.out_dim * p)                      # head
        return 3.0 * 2.0 * macs

    def _projection_shapes(self) -> dict:
        """(in, out) of every block projection LoRA can adapt, by block-relative name."""
        d, f = self.dim, self.ffn_dim
        return {**{f"{a}.{p}": (d, d) for a in ("self_attn", "cross_attn") for p in "qkvo"},
                "ffn.0": (d, f), "ffn.2": (f, d)}

    def lora_params(self, rank: int, modules) -> int:
        """Adapter parameters of rank `rank` on the block-relative projections `modules` (LoraSettings.modules()):
        r * (in + out) per projection and block."""
        shapes, modules = self._projection_shapes(), set(modules)
        head = rank * (self.dim + self.out_dim * prod(self.patch_size)) if "head" in modules else 0
        return self.num_layers * rank * sum(sum(shapes[m]) for m in modules - {"head"}) + head

    def lora_flops_per_sample(self, tokens: int, rank: int, modules, text_len: int | None = None) -> float:
        """Model FLOPs of a LoRA step (frozen base, adapters of rank `rank` on `modules`) for one sample: what it runs.

        - forward: every matmul of the model, as flops_per_sample counts them, and the adapters (x A^T, then B);
        - backward, base: the input gradient of every block projection and of the head (no weight gradients); none
          for the patch, text and time embeddings and the cross-attention's k, v on the text, whose inputs need no
          gradient (the adapters' own backward aside);
        - backward, attention: self-attention's QK^T and PV twice their forward (dQ, dK, dV); cross-attention's
          the same where its k or v carries an adapter, else once (dQ and dP only);
        - backward, adapters: twice their forward (input and weight gradients).
        Recompute of activation checkpointing is not counted, as in flops_per_sample."""
        d, f, s = self.dim, self.ffn_dim, int(tokens)
        l = self.text_len if text_len is None else int(text_len)
        p = prod(self.patch_size)
        shapes, modules = self._projection_shapes(), set(modules)
        rows = {m: (l if m in ("cross_attn.k", "cross_attn.v") else s) for m in shapes}
        proj = sum(rows[m] * i * o for m, (i, o) in shapes.items())          # block projections, forward MACs
        proj_bwd = sum(rows[m] * i * o for m, (i, o) in shapes.items() if rows[m] == s)
        self_attn, cross_attn = 2 * s * s * d, 2 * s * l * d
        cross_bwd = 2 if modules & {"cross_attn.k", "cross_attn.v"} else 1
        adapters = sum(rows[m] * rank * sum(shapes[m]) for m in modules - {"head"})
        embed = s * self.in_dim * p * d + l * (self.text_dim * d + d * d) + self.freq_dim * d + d * d + d * 6 * d
        head = s * d * self.out_dim * p
        head_adapter = 3 * s * rank * (d + self.out_dim * p) if "head" in modules else 0
        macs = (self.num_layers * (proj + proj_bwd + 3 * self_attn + (1 + cross_bwd) * cross_attn + 3 * adapters)
                + embed + 2 * head + head_adapter)
        return 2.0 * macs

def _type_problem(annotation, value):
    """What a WanConfig field of `annotation` must be, where `value` is not of its type (else None); bool is not an
    int here, as in JSON."""
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        return None if type(value) is int else "a positive integer"
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(type(v) is int for v in value)
    return None if ok else "a list of 3 positive integers"  # patch_size
