"""Cost profile: what a micro-batch costs on one GPU, read from YAML.

    time_ms(micro-batch of samples with S_i tokens) = fixed + per_token * sum(S_i) + per_token_sq * sum(S_i^2)

The quadratic term is attention; it is why equal-token batches are not equal-time batches. Memory is a
token budget (M_mem) per micro-batch on one GPU. The paper's compute constraint B * S^p <= M_comp is kept
for the `dual` policy; when a profile has no `dual` section it is derived from the time model (see
`derive_dual`). Pure Python: no torch.
"""
import math
from dataclasses import dataclass, field

import yaml

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.geometry import Geometry

# Allowed keys per section; anything else is a typo we refuse rather than ignore.
_SCHEMA = {
    "geometry": {"vae_stride", "patch_size"},
    "time_ms": {"fixed", "per_token", "per_token_sq", "step_fixed"},
    "memory": {"budget_tokens", "fixed_bytes", "bytes_per_token", "capacity_bytes", "safety"},
    "dual": {"p", "m_comp"},
    "meta": None,  # free-form provenance: model, device, versions, date, estimated
    "fit": None,   # free-form fit report written by `calibrate`
}


@dataclass
class CostProfile:
    fixed_ms: float
    """Per-micro-batch overhead (launches, weights gathered under ZeRO-3) in ms."""
    per_token_ms: float
    """Linear cost per token (matmuls) in ms."""
    per_token_sq_ms: float
    """Quadratic cost per token^2 of one sample (attention) in ms."""
    budget_tokens: int
    """M_mem: the most tokens one micro-batch may hold on one GPU."""
    step_fixed_ms: float = 0.0
    """Once per optimizer step (optimizer, gradient reduction); equal on every rank."""
    dual_p: float = None
    """Exponent p of the paper's compute constraint B * S^p <= M_comp (derived when absent)."""
    dual_m_comp: float = None
    """M_comp of the compute constraint (derived when absent)."""
    geometry: Geometry = field(default_factory=Geometry)
    memory: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("fixed_ms", "per_token_ms", "per_token_sq_ms", "step_fixed_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise UserError(f"profile: {name} must be a finite number >= 0, got {v!r}")
        if self.per_token_ms == 0 and self.per_token_sq_ms == 0:
            raise UserError("profile: per_token and per_token_sq cannot both be 0")
        if not isinstance(self.budget_tokens, int) or self.budget_tokens < 1:
            raise UserError(f"profile: memory.budget_tokens must be a positive integer, "
                            f"got {self.budget_tokens!r}")
        if self.dual_p is None or self.dual_m_comp is None:
            if (self.dual_p is None) != (self.dual_m_comp is None):
                raise UserError("profile: dual needs both p and m_comp")
            self.dual_p, self.dual_m_comp = derive_dual(self)
        if not (self.dual_p > 0 and self.dual_m_comp > 0):
            raise UserError(f"profile: dual p and m_comp must be > 0, got {self.dual_p}, {self.dual_m_comp}")

    def sample_ms(self, tokens: int) -> float:
        """Marginal cost of one sample inside a micro-batch (no fixed part)."""
        return self.per_token_ms * tokens + self.per_token_sq_ms * tokens * tokens

    def micro_ms(self, batch: int, tokens: int) -> float:
        """Predicted forward+backward ms of a micro-batch of `batch` samples of `tokens` tokens each."""
        return self.fixed_ms + batch * self.sample_ms(tokens)

    def mem_batch(self, tokens: int) -> int:
        """Largest B with B * S <= M_mem (0 when one sample does not fit)."""
        return self.budget_tokens // tokens

    def comp_batch(self, tokens: int) -> int:
        """Largest B with B * S^p <= M_comp, at least 1 (a lone sample always runs)."""
        return max(1, int(self.dual_m_comp / tokens ** self.dual_p))

    @classmethod
    def load(cls, path) -> "CostProfile":
        try:
            with open(path) as f:
                doc = yaml.safe_load(f)
        except OSError as e:
            raise UserError(f"profile {path}: cannot read: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise UserError(f"profile {path}: invalid YAML: {e}") from None
        try:
            return cls.from_dict(doc)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, doc) -> "CostProfile":
        if not isinstance(doc, dict):
            raise UserError("profile: top level must be a mapping")
        unknown = [k for k in doc if k not in _SCHEMA]
        for section, keys in _SCHEMA.items():
            value = doc.get(section)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise UserError(f"profile: section {section!r} must be a mapping")
            if keys is not None:
                unknown += [f"{section}.{k}" for k in value if k not in keys]
        if unknown:
            raise UserError(f"profile: unknown keys {', '.join(map(str, unknown))}")
        for section, needed in (("time_ms", ("fixed", "per_token", "per_token_sq")),
                                ("memory", ("budget_tokens",))):
            missing = [k for k in needed if k not in (doc.get(section) or {})]
            if missing:
                raise UserError(f"profile: missing {', '.join(f'{section}.{k}' for k in missing)}")
        t, mem, dual, geo = doc["time_ms"], doc["memory"], doc.get("dual") or {}, doc.get("geometry") or {}
        try:
            geometry = Geometry(tuple(geo.get("vae_stride", (4, 8, 8))), tuple(geo.get("patch_size", (1, 2, 2))))
        except TypeError:
            raise UserError("profile: geometry.vae_stride and geometry.patch_size must be lists of 3 integers") from None
        if any(len(v) != 3 or not all(isinstance(x, int) and x > 0 for x in v)
               for v in (geometry.vae_stride, geometry.patch_size)):
            raise UserError("profile: geometry.vae_stride and geometry.patch_size must be lists of 3 positive integers")
        return cls(fixed_ms=t["fixed"], per_token_ms=t["per_token"], per_token_sq_ms=t["per_token_sq"],
                   step_fixed_ms=t.get("step_fixed", 0.0), budget_tokens=mem["budget_tokens"],
                   dual_p=dual.get("p"), dual_m_comp=dual.get("m_comp"), geometry=geometry,
                   memory=dict(mem), meta=dict(doc.get("meta") or {}), fit=dict(doc.get("fit") or {}))

    def to_dict(self) -> dict:
        doc = {
            "geometry": {"vae_stride": list(self.geometry.vae_stride), "patch_size": list(self.geometry.patch_size)},
            "time_ms": {"fixed": self.fixed_ms, "per_token": self.per_token_ms,
                        "per_token_sq": self.per_token_sq_ms, "step_fixed": self.step_fixed_ms},
            "memory": {**self.memory, "budget_tokens": self.budget_tokens},
            "dual": {"p": self.dual_p, "m_comp": self.dual_m_comp},
        }
        if self.meta:
            doc["meta"] = self.meta
        if self.fit:
            doc["fit"] = self.fit
        return doc

    def to_yaml(self, path) -> None:
        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)


def derive_dual(profile: CostProfile, points: int = 64) -> tuple:
    """Fit the paper's B * S^p <= M_comp to the time model.

    Target: every micro-batch gets the compute that a full memory budget of tokens costs in linear work
    alone, per_token * M_mem. For S tokens that allows B(S) = per_token*M / (per_token*S + per_token_sq*S^2)
    samples; short sequences are then memory-bound, long ones compute-bound. log B = log M_comp - p log S is
    fitted by least squares on S log-spaced from 256 tokens to M_mem. A purely quadratic model (per_token=0)
    has no linear budget, so it uses the quadratic cost of one sample at M_mem instead.
    """
    m = profile.budget_tokens
    lo = min(256, m)
    if profile.per_token_ms > 0:
        budget = profile.per_token_ms * m
    else:
        budget = profile.per_token_sq_ms * m * m
    xs, ys = [], []
    for i in range(points):
        s = lo * (m / lo) ** (i / max(1, points - 1))
        xs.append(math.log(s))
        ys.append(math.log(budget / profile.sample_ms(s)))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else -1.0
    p = max(1e-6, -slope)
    return p, math.exp(my + p * mx)
