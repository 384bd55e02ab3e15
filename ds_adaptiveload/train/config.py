"""Training configuration: the DeepSpeed JSON plus its `adaptive_load` section (ours), read once.

DeepSpeed's batch keys describe a fixed micro-batch. Ours vary (the scheduler picks B per micro-batch),
so `ds_batch_keys` sets them to count *micro-batches*: train_micro_batch_size_per_gpu = 1 and
train_batch_size = G * dp. DeepSpeed uses them only for its own bookkeeping (`global_samples`, the
samples axis of its monitor events, throughput log lines); its LR schedules step per optimizer step and
are unaffected. True sample and token counts are in our step log and monitor events.
"""
import os
from dataclasses import asdict, dataclass, fields

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.fileio import read_json_object


ALLOC_CONF = "expandable_segments:True"


def default_alloc_conf():
    """Micro-batch shapes change every step here, which fragments PyTorch's caching allocator: blocks cut
    for one shape sit half-used under the next, until a large activation finds no contiguous room although
    the total would fit. Expandable segments grow one mapped range per stream instead (NeMo sets it for
    dynamic batch shapes too). Must run before the first CUDA allocation; a user's own
    PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF is kept. Calibration and training both call it, so the
    profile is measured under the allocator the training run uses. Returns the setting in effect."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")


@dataclass
class AdaptiveLoadConfig:
    """The `adaptive_load` section of the DeepSpeed JSON."""

    profile: str
    """Cost profile YAML (profile.py); a relative path is looked up from the working directory, then
    from the JSON file's folder."""
    policy: str = "balanced"
    """balanced | dual | equal-tokens (planner.py)."""
    seed: int = 0
    """Plan shuffling seed, and the seed of model init, noise and timesteps."""
    on_oversize: str = "error"
    """error | skip: a sample whose per-GPU tokens exceed the profile's memory budget."""
    window: int = None
    """balanced with G = 1, or G >= 2 under ZeRO-2/3 (lockstep): steps per cost-sorting window (None = whole
    epoch; smaller keeps steps closer to the data's composition, at some balance)."""
    fill: float = None
    """balanced with G >= 2: fraction of a step's R*G micro-batch slots to fill (None: the planner
    chooses by predicted wall time, see planner.FILL_CHOICES)."""
    on_bad_sample: str = "error"
    """error | skip: a sample that cannot be read (missing or truncated shard, missing tensor, shape or
    dtype not matching the manifest, NaN/Inf values) or a non-finite loss. skip drops samples found
    bad before training from the plan, and skips a whole step on every rank when one is found during
    training (docs/reliability.md); both are counted and reported."""
    on_oom: str = "error"
    """error | skip: an accelerator out-of-memory error in a micro-batch. skip drops that step on every
    rank (no optimizer update) and continues; needs ZeRO-3 (docs/reliability.md)."""

    @classmethod
    def from_dict(cls, d, source) -> "AdaptiveLoadConfig":
        if not isinstance(d, dict):
            raise UserError(f"{source}: adaptive_load must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{source}: unknown adaptive_load key(s) {unknown}; known: {sorted(known)}")
        if "profile" not in d:
            raise UserError(f"{source}: adaptive_load.profile is required (a cost profile YAML)")
        for key in ("on_oversize", "on_bad_sample", "on_oom"):
            if d.get(key, "error") not in ("error", "skip"):
                raise UserError(f"{source}: adaptive_load.{key} must be \"error\" or \"skip\", got {d[key]!r}")
        return cls(**d)

    def resolve_profile(self, json_path) -> str:
        if os.path.isabs(self.profile) or os.path.exists(self.profile):
            return self.profile
        alt = os.path.join(os.path.dirname(os.path.abspath(json_path)), self.profile)
        if os.path.exists(alt):
            return alt
        raise UserError(f"{json_path}: adaptive_load.profile {self.profile!r} not found (looked in the working "
                        f"directory and next to the JSON)")

    def to_dict(self) -> dict:
        return asdict(self)


def load_ds_config(path):
    """-> (DeepSpeed dict without `adaptive_load`, AdaptiveLoadConfig). DeepSpeed's config parser tolerates
    unknown top-level keys, but it stores the dict in every checkpoint and prints it, so ours is removed."""
    ds = read_json_object(path, "DeepSpeed config")
    if "adaptive_load" not in ds:
        raise UserError(f"{path}: no adaptive_load section (profile, policy, seed, on_oversize)")
    al = AdaptiveLoadConfig.from_dict(ds.pop("adaptive_load"), path)
    gas = ds.get("gradient_accumulation_steps", 1)
    if not isinstance(gas, int) or gas < 1:
        raise UserError(f"{path}: gradient_accumulation_steps must be a positive integer, got {gas!r}")
    sp = ds.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or sp < 1:
        raise UserError(f"{path}: sequence_parallel_size must be a positive integer, got {sp!r}")
    return ds, al


def ds_batch_keys(ds: dict, dp_world: int) -> dict:
    """Set DeepSpeed's batch keys to count micro-batches (module docstring); returns what changed."""
    gas = ds.get("gradient_accumulation_steps", 1)
    want = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "train_batch_size": gas * dp_world}
    changed = {k: (ds.get(k), v) for k, v in want.items() if k in ds and ds[k] != v}
    ds.update(want)
    return changed


MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")


def derive_ds_config(base, *, zero_stage=None, grad_accum=None, dp=None, sp=None, bf16=None, adaptive_load=None,
                     monitor_path=None, **top) -> dict:
    """A DeepSpeed JSON dict derived from `base` (a path or a dict; neither is modified): the one place
    that derives one (benchmarks, calibration, tests). Every override left None keeps the base's value.

    zero_stage: zero_optimization.stage. grad_accum: gradient_accumulation_steps. dp: set the batch keys
    to count micro-batches for dp data-parallel ranks (ds_batch_keys). sp: sequence_parallel_size (1
    removes the key). bf16: bf16.enabled. adaptive_load: keys merged into that section (a None value
    removes the key). monitor_path: output_path of every monitor section the base has. top: other
    top-level keys, set as given (None removes the key)."""
    import copy

    ds = copy.deepcopy(read_json_object(base, "DeepSpeed config") if isinstance(base, (str, os.PathLike))
                       else base)
    if zero_stage is not None:
        ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": zero_stage}
    if grad_accum is not None:
        ds["gradient_accumulation_steps"] = grad_accum
    if sp is not None:
        if sp == 1:
            ds.pop("sequence_parallel_size", None)
        else:
            ds["sequence_parallel_size"] = sp
    if bf16 is not None:
        ds["bf16"] = {**ds.get("bf16", {}), "enabled": bool(bf16)}
    if adaptive_load:
        section = {**ds.get("adaptive_load", {}), **adaptive_load}
        ds["adaptive_load"] = {k: v for k, v in section.items() if v is not None}
    if monitor_path is not None:
        for name in MONITORS:
            if isinstance(ds.get(name), dict):
                ds[name] = {**ds[name], "output_path": str(monitor_path)}
    for k, v in top.items():
        if v is None:
            ds.pop(k, None)
        else:
            ds[k] = v
    if dp is not None:
        ds_batch_keys(ds, dp)
    return ds
