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
from ds_adaptiveload.schedule.planner import check_pack_tokens
from ds_adaptiveload.train.lr_scaling import METHODS as LR_SCALING_METHODS


ALLOC_CONF = "expandable_segments:True"
LOSS_WEIGHTINGS = ("none", "bell")  # flow.timestep_weight


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
    policy: str = "packed"
    """packed | balanced | dual | equal-tokens (schedule/packed.py, schedule/planner.py). packed (the default since
    2026-12-02: docs/benchmarks.md) fills micro-batches with samples of several shapes, which the model runs as one
    packed forward; a model that takes one shape per micro-batch needs balanced."""
    seed: int = 0
    """Plan shuffling seed, and the seed of model init, noise and timesteps. `data_efficiency.seed`, when
    given, sets it (DeepSpeed's data-efficiency seed)."""
    on_oversize: str = "error"
    """error | skip: a sample whose per-GPU tokens exceed the profile's memory budget."""
    window: int = None
    """balanced with G = 1, or G >= 2 under ZeRO-2/3 (lockstep): steps per cost-sorting window (None = whole
    epoch; smaller keeps steps closer to the data's composition, at some balance)."""
    fill: float = None
    """balanced with G >= 2: fraction of a step's R*G micro-batch slots to fill (None: the planner
    chooses by predicted wall time, see balanced.FILL_CHOICES)."""
    replicate: bool = None
    """packed: light samples in runs of R of one shape, so that the micro-batches of a round are copies and
    cost the same (None: when a micro-batch holds fewer than about 10 samples, as with memory for one long
    clip; schedule/packed.py)."""
    pack_tokens: object = None
    """packed: the memory a micro-batch may fill, in tokens: null (the profile's budget), an integer (at most the
    budget), or "auto": the cap with the least predicted time per token (schedule/packed.pack_cap). With
    --checkpoint-blocks auto and a profile with time_ms.recompute_frac, smaller micro-batches leave blocks open and
    skip their recompute; steps then hold fewer samples (G micro-batches each)."""
    on_bad_sample: str = "error"
    """error | skip: a sample that cannot be read (missing or truncated shard, missing tensor, shape or
    dtype not matching the manifest, NaN/Inf values) or a non-finite loss. skip drops samples found
    bad before training from the plan, and skips a whole step on every rank when one is found during
    training (docs/reliability.md); both are counted and reported."""
    on_oom: str = "error"
    """error | skip: an accelerator out-of-memory error in a micro-batch. skip drops that step on every
    rank (no optimizer update) and continues; needs ZeRO-3 (docs/reliability.md)."""
    loss_weighting: str = "none"
    """none | bell: per-sample loss weight by timestep. bell is the bell-shaped weighting of
    DiffSynth-Studio's Wan training, centred on t = 0.5, zero at t = 1, mean 1 over the training
    timesteps (flow.timestep_weight)."""
    lr_scaling_method: str = "none"
    """none | linear | sqrt: scale each step's learning rate by (N / lr_reference_batch_size) or its square
    root, N the step's samples over all ranks (DeepSpeed's dynamic_batching.lr_scaling_method; DeepSpeed's
    default is linear, ours none, so the configured LR is the LR applied)."""
    lr_reference_batch_size: int = None
    """Samples per step that the configured LR refers to; None: the engine's train_batch_size(), as
    DeepSpeed's dynamic batching uses."""

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
        for key, choices in (("loss_weighting", LOSS_WEIGHTINGS), ("lr_scaling_method", LR_SCALING_METHODS)):
            if d.get(key, "none") not in choices:
                raise UserError(f"{source}: adaptive_load.{key} must be one of {', '.join(choices)}, got {d[key]!r}")
        if d.get("replicate") not in (None, True, False):
            raise UserError(f"{source}: adaptive_load.replicate must be true, false or null, got {d['replicate']!r}")
        check_pack_tokens(d.get("pack_tokens"), f"{source}: adaptive_load.pack_tokens")
        ref = d.get("lr_reference_batch_size")
        if ref is not None and (not isinstance(ref, int) or isinstance(ref, bool) or ref < 1):
            raise UserError(f"{source}: adaptive_load.lr_reference_batch_size must be a positive integer, got {ref!r}")
        return cls(**d)

    def resolve_profile(self, json_path) -> str:
        """json_path None (a config given as a dict): only the working directory is tried."""
        if os.path.isabs(self.profile) or os.path.exists(self.profile):
            return self.profile
        alt = json_path and os.path.join(os.path.dirname(os.path.abspath(json_path)), self.profile)
        if alt and os.path.exists(alt):
            return alt
        raise UserError(f"{json_path}: adaptive_load.profile {self.profile!r} not found (looked in the working "
                        f"directory and next to the JSON)")

    def to_dict(self) -> dict:
        return asdict(self)


NESTED = "data_efficiency.data_sampling.adaptive_load"


def adaptive_load_section(ds: dict, source, pop=False) -> AdaptiveLoadConfig:
    """The `adaptive_load` section of a DeepSpeed dict, at the top level or (DeepSpeed's data-efficiency
    convention, beside `dynamic_batching`) at data_efficiency.data_sampling.adaptive_load; giving both is an
    error. `data_efficiency.seed`, when given, is the seed. pop: remove the section from `ds`."""
    de = ds.get("data_efficiency")
    de = de if isinstance(de, dict) else {}
    sampling = de.get("data_sampling")
    sampling = sampling if isinstance(sampling, dict) else {}
    top, nested = "adaptive_load" in ds, "adaptive_load" in sampling
    if top and nested:
        raise UserError(f"{source}: adaptive_load is given twice, at the top level and at {NESTED}; keep one")
    if not (top or nested):
        raise UserError(f"{source}: no adaptive_load section (profile, policy, seed, on_oversize) at the top "
                        f"level or at {NESTED}")
    owner = ds if top else sampling
    section = owner.pop("adaptive_load") if pop else owner["adaptive_load"]
    if isinstance(section, dict) and "seed" in de:
        if "seed" in section and section["seed"] != de["seed"]:
            raise UserError(f"{source}: adaptive_load.seed {section['seed']!r} and data_efficiency.seed "
                            f"{de['seed']!r} differ; give one")
        section = {**section, "seed": de["seed"]}
    return AdaptiveLoadConfig.from_dict(section, source)


def load_ds_config(path):
    """-> (DeepSpeed dict without `adaptive_load`, AdaptiveLoadConfig). DeepSpeed's config parser tolerates
    unknown keys, but it stores the dict in every checkpoint and prints it, so ours is removed."""
    ds = read_json_object(path, "DeepSpeed config")
    al = adaptive_load_section(ds, path, pop=True)
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


def zero_stage(ds_cfg: dict) -> int:
    """zero_optimization.stage of a DeepSpeed config dict (0 when absent): the one reader of it."""
    if not isinstance(ds_cfg, dict):
        raise UserError(f"build_model: ds_cfg must be the DeepSpeed config dict, got {type(ds_cfg).__name__}")
    return int((ds_cfg.get("zero_optimization") or {}).get("stage", 0))


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
