"""Cost profile: what a micro-batch costs on one GPU, read from YAML.

    time_ms(micro-batch of samples with S_i tokens)
        = smax(floor, fixed + per_token * sum(S_i) + per_token_sq * sum(S_i^2))

The quadratic term is attention; it is why equal-token batches are not equal-time batches. The floor
(default 0) is a step time that small micro-batches do not go below: under ZeRO-3 the host-side parameter
gathering of every step can take longer than the GPU work of a small micro-batch, and then the two overlap,
only partly: smax = (floor^q + line^q)^(1/q) with q = time_ms.floor_q (8 from `calibrate`; absent: the hard
max). Memory is a token budget (M_mem) per micro-batch on one GPU, each sample counting its tokens plus
memory.sample_tokens (its text context and other per-sample buffers, in tokens' worth; default 0). The
paper's compute constraint B * S^p <= M_comp is kept for the `dual` policy; when a profile has no `dual`
section the planner derives it from the time model and
the data's token range (see `derive_dual`). Pure Python: no torch.
"""
import dataclasses
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import yaml

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.fileio import read_yaml
from ds_adaptiveload.schedule.geometry import Geometry

# Allowed keys per section; anything else is a typo we refuse rather than ignore.
_SCHEMA = {
    "geometry": {"vae_stride", "patch_size"},
    "time_ms": {"fixed", "per_token", "per_token_sq", "step_fixed", "floor", "floor_q", "recompute_frac",
                "attention_recompute_frac", "ffn_recompute_frac"},
    "memory": {"budget_tokens", "sample_tokens", "fixed_bytes", "bytes_per_token", "bytes_per_sample",
               "capacity_bytes", "safety", "host_link_bytes_per_s", "host_bytes_per_rank", "block_bytes_per_token",
               "attention_bytes_per_token", "block_bytes_per_sample", "ffn_bytes_per_token"},
    "dual": {"p", "m_comp"},
    "meta": None,  # free-form provenance: model, device, versions, date, estimated
    "fit": None,   # free-form fit report written by `calibrate`
}


# Dataclass field -> the YAML key it is read from (error messages).
KEYS = {"fixed_ms": "time_ms.fixed", "per_token_ms": "time_ms.per_token", "per_token_sq_ms": "time_ms.per_token_sq",
        "step_fixed_ms": "time_ms.step_fixed", "floor_ms": "time_ms.floor", "sample_tokens": "memory.sample_tokens"}
# memory keys beyond the budget that the trainer and calibrate read as numbers.
# block_bytes_per_token / attention_bytes_per_token / block_bytes_per_sample / ffn_bytes_per_token:
# --checkpoint-blocks auto (schedule/memory.py). host_link_bytes_per_s / host_bytes_per_rank: activation offload
# (schedule/offload.py).
MEMORY_NUMBERS = ("fixed_bytes", "bytes_per_token", "bytes_per_sample", "capacity_bytes", "safety",
                  "block_bytes_per_token", "attention_bytes_per_token", "block_bytes_per_sample", "ffn_bytes_per_token",
                  "host_link_bytes_per_s", "host_bytes_per_rank")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(key, v, bound: str) -> None:
    """A finite real number >= 0 (or > 0); ints too large for a float are refused as not finite."""
    try:
        ok = _is_number(v) and math.isfinite(v) and (v >= 0 if bound == ">= 0" else v > 0)
    except OverflowError:
        ok = False
    if not ok:
        raise UserError(f"profile: {key} must be a {'finite ' if bound == '>= 0' else ''}number {bound}, got {v!r}")


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
    floor_ms: float = 0.0
    """A micro-batch takes at least this long (host-bound ZeRO-3 steps; 0 = no floor)."""
    floor_q: float = math.inf
    """Sharpness of the smooth max between floor and line (inf: the hard max)."""
    sample_tokens: float = 0.0
    """Memory of one sample beyond its tokens (text context), in tokens' worth: B * (S + this) <= M_mem."""
    dual_p: float = None
    """Exponent p of the paper's compute constraint B * S^p <= M_comp (None: derived per dataset)."""
    dual_m_comp: float = None
    """M_comp of the compute constraint (None: derived per dataset)."""
    geometry: Geometry = field(default_factory=Geometry)
    memory: dict = field(default_factory=dict)
    """The memory section as read or written, in its order: the typed fields above (budget_tokens,
    sample_tokens) win over the copies here; the rest (fixed_bytes, capacity_bytes, ...) is kept as is."""
    meta: dict = field(default_factory=dict)
    fit: dict = field(default_factory=dict)
    header: str = ""
    """The comment block at the top of the YAML (without the '# '): how the profile was made. Read by
    load, written by to_yaml."""
    recompute_frac: float = 0.0
    """time_ms.recompute_frac: the share of a fully checkpointed micro-batch's fwd+bwd that recompute takes
    (schedule/memory.recompute_factor; calibrate measures it, 0: not known)."""
    attention_recompute_frac: float = 0.0
    """time_ms.attention_recompute_frac: the share of it that recomputing attention takes, which a block keeping
    its attention outputs skips (the attention checkpoint policy; 0: not known)."""
    ffn_recompute_frac: float = 0.0
    """time_ms.ffn_recompute_frac: the share of it that the FFN's second matmul takes, which a kept block that also
    keeps its FFN output skips (memory.ffn_bytes_per_token; schedule/memory.ffn_blocks; 0: not known)."""

    def __post_init__(self):
        # Messages name the YAML keys (KEYS), the names a user edits.
        for name in ("fixed_ms", "per_token_ms", "per_token_sq_ms", "step_fixed_ms", "floor_ms", "sample_tokens"):
            _number(KEYS[name], getattr(self, name), ">= 0")
        try:  # an int too large for a float would overflow in smooth_max's power
            q = float(self.floor_q) if _is_number(self.floor_q) else None
        except OverflowError:
            q = None
        if q is None or not q >= 1:
            raise UserError(f"profile: time_ms.floor_q must be a number >= 1, got {self.floor_q!r}")
        if self.per_token_ms == 0 and self.per_token_sq_ms == 0:
            raise UserError("profile: time_ms.per_token and time_ms.per_token_sq cannot both be 0")
        for key in ("recompute_frac", "attention_recompute_frac", "ffn_recompute_frac"):
            v = getattr(self, key)
            if not (_is_number(v) and 0 <= v < 1):
                raise UserError(f"profile: time_ms.{key} must be a number in [0, 1), got {v!r}")
        if type(self.budget_tokens) is not int or self.budget_tokens < 1:  # bool is an int: refused
            raise UserError(f"profile: memory.budget_tokens must be a positive integer, "
                            f"got {self.budget_tokens!r}")
        for key in MEMORY_NUMBERS:
            if key in self.memory:
                _number(f"memory.{key}", self.memory[key], ">= 0")
        if (self.dual_p is None) != (self.dual_m_comp is None):
            raise UserError("profile: dual needs both p and m_comp")
        if self.dual_p is not None:
            _number("dual.p", self.dual_p, "> 0")
            _number("dual.m_comp", self.dual_m_comp, "> 0")

    def sample_ms(self, tokens: int) -> float:
        """Marginal cost of one sample inside a micro-batch (no fixed part)."""
        return self.per_token_ms * tokens + self.per_token_sq_ms * tokens * tokens

    def micro_ms(self, batch: int, tokens: int) -> float:
        """Predicted forward+backward ms of a micro-batch of `batch` samples of `tokens` tokens each."""
        return smooth_max(self.floor_ms, self.fixed_ms + batch * self.sample_ms(tokens), self.floor_q)

    def packed_ms(self, tokens) -> float:
        """micro_ms generalised to a micro-batch of samples of several shapes (`tokens`: per-GPU tokens of each
        sample): attention is per sample, so the quadratic term is sum(S_i^2), not (sum S_i)^2. Samples are
        summed per distinct length, so a one-shape micro-batch costs exactly micro_ms(B, S), float for float."""
        counts = Counter(tokens)
        line = self.fixed_ms + sum(n * self.sample_ms(s) for s, n in counts.items())
        return smooth_max(self.floor_ms, line, self.floor_q)

    def mem_tokens(self, tokens: int) -> float:
        """What one sample of `tokens` tokens takes of M_mem."""
        return tokens + self.sample_tokens

    def mem_batch(self, tokens: int) -> int:
        """Largest B with B * (S + sample_tokens) <= M_mem (0 when one sample does not fit)."""
        return int(self.budget_tokens // self.mem_tokens(tokens))

    def dual_for(self, s_lo: int, s_hi: int) -> tuple:
        """(p, M_comp): the profile's own, else derived for per-GPU sequences from s_lo to s_hi tokens."""
        if self.dual_p is not None:
            return self.dual_p, self.dual_m_comp
        return derive_dual(self, s_lo, s_hi)

    @staticmethod
    def comp_batch(tokens: int, dual: tuple) -> int:
        """Largest B with B * S^p <= M_comp, at least 1 (a lone sample always runs)."""
        p, m_comp = dual
        return max(1, int(m_comp / tokens ** p * (1 + 1e-9)))

    @classmethod
    def load(cls, path) -> "CostProfile":
        doc = read_yaml(path, "cost profile")
        try:
            prof = cls.from_dict(doc)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
        prof.header = _read_header(path)
        return prof

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
                   step_fixed_ms=t.get("step_fixed", 0.0), floor_ms=t.get("floor", 0.0),
                   floor_q=t.get("floor_q", math.inf), budget_tokens=mem["budget_tokens"],
                   sample_tokens=mem.get("sample_tokens", 0.0),
                   dual_p=dual.get("p"), dual_m_comp=dual.get("m_comp"), geometry=geometry,
                   memory=dict(mem), meta=dict(doc.get("meta") or {}), fit=dict(doc.get("fit") or {}),
                   recompute_frac=t.get("recompute_frac", 0.0),
                   attention_recompute_frac=t.get("attention_recompute_frac", 0.0),
                   ffn_recompute_frac=t.get("ffn_recompute_frac", 0.0))

    def to_dict(self) -> dict:
        doc = {
            "geometry": {"vae_stride": list(self.geometry.vae_stride), "patch_size": list(self.geometry.patch_size)},
            "time_ms": {"fixed": self.fixed_ms, "per_token": self.per_token_ms,
                        "per_token_sq": self.per_token_sq_ms, "step_fixed": self.step_fixed_ms,
                        **({"floor": self.floor_ms} if self.floor_ms else {}),
                        **({"floor_q": self.floor_q} if math.isfinite(self.floor_q) else {}),
                        **({"recompute_frac": self.recompute_frac} if self.recompute_frac else {}),
                        **({"attention_recompute_frac": self.attention_recompute_frac}
                           if self.attention_recompute_frac else {}),
                        **({"ffn_recompute_frac": self.ffn_recompute_frac} if self.ffn_recompute_frac else {})},
            "memory": {**self.memory, "budget_tokens": self.budget_tokens},
        }
        if self.sample_tokens or "sample_tokens" in self.memory:  # in memory's place when it has one
            doc["memory"]["sample_tokens"] = self.sample_tokens
        if self.dual_p is not None:
            doc["dual"] = {"p": self.dual_p, "m_comp": self.dual_m_comp}
        if self.meta:
            doc["meta"] = self.meta
        if self.fit:
            doc["fit"] = self.fit
        return doc

    def to_yaml(self, path) -> None:
        """The one profile writer: the header as comments, then to_dict (short sections on one line)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.writelines(f"# {line}\n" if line else "#\n" for line in self.header.splitlines())
            yaml.safe_dump(self.to_dict(), f, sort_keys=False, default_flow_style=None, width=120)


def _read_header(path) -> str:
    """The comment lines before the first YAML line, without their '# '."""
    lines = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "".join(lines).rstrip("\n")


def smooth_max(floor: float, line: float, q: float = math.inf) -> float:
    """(floor^q + line^q)^(1/q) without overflow, negative parts as 0: ~max(floor, line) away from the knee,
    2^(1/q) x at it; q = inf is the max itself. The time model of a micro-batch (profile and calibrate)."""
    m = max(floor, line, 0.0)
    if math.isinf(q) or m == 0:
        return m
    return m * ((max(floor, 0.0) / m) ** q + (max(line, 0.0) / m) ** q) ** (1 / q)


# Capacities this close count as the same GPU: drivers report an H200's a few MiB apart.
SAME_CAPACITY = 0.001


def for_device(profile: CostProfile, capacity_bytes, device: str = None, source: str = "profile") -> tuple:
    """(profile, notes): the profile's memory moved to a GPU of `capacity_bytes` (device: its name, None if not
    known). budget_tokens = (capacity * safety - fixed_bytes) / bytes_per_token is linear in the capacity, so it
    moves by (capacity - memory.capacity_bytes) * safety / bytes_per_token, and memory.capacity_bytes becomes this
    GPU's, which is what --checkpoint-blocks auto plans open blocks from. The time model is kept: balance needs only
    its ratios, but its absolute times stay the measuring GPU's, and a note says so. capacity_bytes None (a CPU
    run), or a profile without capacity_bytes or bytes_per_token (hand-written ones): the profile as it is."""
    mem, meta = profile.memory, profile.meta
    cap0, per_token = mem.get("capacity_bytes"), mem.get("bytes_per_token")
    measured_on = meta.get("device") or "another GPU"
    other_gpu = device is not None and meta.get("device") not in (None, device)
    times = (f"{source}: its times were measured on {measured_on}: the plan's balance uses their ratios, its "
             f"absolute predicted times are that GPU's (calibrate on this one for exact times)")
    if capacity_bytes is None or not cap0 or not per_token:
        return profile, [times] if other_gpu else []
    _number("the device's memory capacity", capacity_bytes, "> 0")
    if abs(capacity_bytes - cap0) <= SAME_CAPACITY * cap0:
        return profile, [times] if other_gpu else []
    safety = mem.get("safety", 0.9)
    budget = math.floor(profile.budget_tokens + (capacity_bytes - cap0) * safety / per_token)
    here = device or "this GPU"
    if budget < 1:
        raise UserError(f"{source}: {here} has {capacity_bytes / 2**30:.1f} GiB, which by the profile's memory model "
                        f"({mem.get('fixed_bytes', 0) / 2**30:.1f} GiB fixed, measured on {measured_on}) leaves no "
                        f"memory for tokens; use a higher ZeRO stage or more GPUs")
    moved = dataclasses.replace(
        profile, budget_tokens=budget, memory={**mem, "capacity_bytes": int(capacity_bytes), "budget_tokens": budget},
        meta={**meta, **({"device": device} if device else {}),
              "rescaled_from": {**(meta.get("rescaled_from") or {}), "device": meta.get("device"),
                                "capacity_bytes": cap0, "budget_tokens": profile.budget_tokens}})
    return moved, [f"{source}: memory moved from {measured_on} ({cap0 / 2**30:.1f} GiB) to {here} "
                   f"({capacity_bytes / 2**30:.1f} GiB): budget {profile.budget_tokens:,} -> {budget:,} tokens per "
                   f"micro-batch, checkpointed blocks planned for this capacity; its times were measured on "
                   f"{measured_on}: balance uses their ratios, absolute predicted times are that GPU's"]


MODEL_KEYS = ("dim", "ffn_dim", "num_heads", "num_layers")  # what tells models apart in meta.model


def describe(profile: CostProfile) -> str:
    """The run a profile was measured for, in words: its GPU, ZeRO stage and Ulysses degree."""
    meta = profile.meta
    return f"{meta.get('device', 'unknown device')}, ZeRO-{meta.get('zero_stage', '?')}, sp={meta.get('sp', 1)}"


def closest_profile(profiles: dict, model: dict, device: str, capacity_bytes, zero_stage: int, sp: int) -> tuple:
    """(name, exact) of the profile in `profiles` ({name: CostProfile}) that fits a run best, or (None, False) where
    none was measured for `model` (its MODEL_KEYS as in meta.model). exact: measured on `device` (a GPU's name, or
    "cpu") under this ZeRO stage and Ulysses degree. Otherwise the closest: a profile's per-GPU times depend most on
    sp (-33% on the 1.3B model at the other degree), then on the stage (ZeRO-3's host-bound floor), then on the GPU,
    then on how near its capacity is; ties go to the first name in sorted order."""
    def fits(prof):
        m = prof.meta.get("model")
        return isinstance(m, dict) and all(m.get(k) == model.get(k) for k in MODEL_KEYS)

    def rank(name):
        prof = profiles[name]
        cap = prof.memory.get("capacity_bytes")
        gap = abs(math.log(cap / capacity_bytes)) if cap and capacity_bytes else math.inf
        same = (prof.meta.get("sp", 1) == sp, prof.meta.get("zero_stage") == zero_stage,
                prof.meta.get("device") == device)
        return (*(not s for s in same), gap, name)

    names = sorted((n for n, p in profiles.items() if fits(p)), key=rank)
    if not names:
        return None, False
    return names[0], not any(rank(names[0])[:3])


def derive_dual(profile: CostProfile, s_lo: int, s_hi: int, points: int = 64) -> tuple:
    """Fit the paper's B * S^p <= M_comp to the time model, for sequences of s_lo..s_hi tokens per GPU.

    Target compute per micro-batch: T = max(cost of one sample of s_hi tokens, per_token * M_mem). No
    micro-batch can be cheaper than the longest lone sample, so aiming lower only starves the rest; and
    per_token * M_mem (the linear work of a full memory budget) keeps short sequences compute-capped only
    where they would be far cheaper than that. B(S) = T / cost(S), and log B = log M_comp - p log S is
    fitted by least squares on S log-spaced over [s_lo, s_hi]. When the longest sample fills M_mem, the cap
    never binds harder than memory and `dual` equals `equal-tokens`; it binds when memory holds several
    long samples (the paper's setting).
    """
    s_lo, s_hi = max(1, min(s_lo, s_hi)), max(1, s_hi)
    target = max(profile.sample_ms(s_hi), profile.per_token_ms * profile.budget_tokens)
    if s_lo == s_hi:
        return 1.0, target / profile.sample_ms(s_hi) * s_hi
    xs, ys = [], []
    for i in range(points):
        s = s_lo * (s_hi / s_lo) ** (i / (points - 1))
        xs.append(math.log(s))
        ys.append(math.log(target / profile.sample_ms(s)))
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    p = max(1e-6, -slope)
    # Shift the line up to the envelope so the fitted cap never falls below T / cost(S) at the ends.
    shift = max(y + p * x for x, y in zip(xs, ys)) - (my + p * mx)
    return p, math.exp(my + p * mx + shift)
