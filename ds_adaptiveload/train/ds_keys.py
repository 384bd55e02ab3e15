"""The DeepSpeed part of a training JSON, checked before DeepSpeed reads it: every top-level key one the installed
DeepSpeed reads, zero_optimization against DeepSpeed's own schema, and the numbers that would otherwise fail deep
inside an optimizer or LR schedule (NaN, negative) or plan for ever (gradient_accumulation_steps)."""
import collections.abc
import difflib
import functools
import logging
import math

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train.config import AdaptiveLoadConfig, shown

OURS = "adaptive_load"
READ_AT_INITIALIZE = ("sequence_parallel_size", "data_parallel_size")
"""Top-level keys deepspeed.initialize reads where a process group exists, which the probe below has not."""


class _Reads(dict):
    """A dict that records every key asked of it (get, [], in, keys() membership, pop, setdefault)."""

    def __init__(self, *args, seen=None, **kw):
        super().__init__(*args, **kw)
        self.seen = set() if seen is None else seen

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return collections.abc.KeysView(self)  # `key in d.keys()` goes through __contains__

    def pop(self, key, *default):
        self.seen.add(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.seen.add(key)
        return super().setdefault(key, default)

    def __copy__(self):  # DeepSpeedConfig reads a copy.copy of the dict
        return _Reads(self, seen=self.seen)


@functools.cache
def deepspeed_keys() -> frozenset:
    """The top-level keys the installed DeepSpeed reads: its config reader (DeepSpeedConfig) run on a minimal config
    that records what is asked of it. Each section's reader asks for its key whether present or not, so a new
    DeepSpeed's keys are known without a list kept here."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = _Reads(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    quiet = logging.getLogger("DeepSpeed")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        DeepSpeedConfig(probe)
    except Exception:  # a reader that needs more than the probe gives: the keys asked before it still count
        pass
    finally:
        quiet.setLevel(level)
    return frozenset(k for k in probe.seen if isinstance(k, str)) | set(READ_AT_INITIALIZE)


def check_deepspeed_config(ds: dict, source) -> None:
    """UserError naming `source` and the key for the first problem of a DeepSpeed dict (`adaptive_load` removed)."""
    check_top_keys(ds, source)
    gas = ds.get("gradient_accumulation_steps", 1)
    if type(gas) is not int or gas < 1:
        raise UserError(f"{source}: gradient_accumulation_steps must be a positive integer, got {gas!r}")
    sp = ds.get("sequence_parallel_size", 1)
    if type(sp) is not int or sp < 1:
        raise UserError(f"{source}: sequence_parallel_size must be a positive integer, got {sp!r}")
    if "gradient_clipping" in ds:
        _non_negative(ds["gradient_clipping"], "gradient_clipping", source)
    check_zero(ds.get("zero_optimization"), source)
    for section in ("optimizer", "scheduler"):
        check_params(ds.get(section), section, source)


def check_top_keys(ds: dict, source) -> None:
    import deepspeed
    import deepspeed.runtime.config as ds_config

    known = deepspeed_keys()
    removed = getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})  # DeepSpeed refuses these with a message
    for key in ds:
        if key in removed:
            raise UserError(f"{source}: {key}: {removed[key]}")
        if key in known:
            continue
        if key in AdaptiveLoadConfig.model_fields:
            raise UserError(f"{source}: {key!r} is an {OURS} key; move it into the {OURS} section")
        close = difflib.get_close_matches(key, [*known, OURS], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"{source}: unknown top-level key {key!r}{hint}: DeepSpeed {deepspeed.__version__} does not "
                        f"read it, so it would have no effect; this project's keys live under {OURS}")


def check_zero(zero, source) -> None:
    """zero_optimization: an object of DeepSpeedZeroConfig's keys (its names or aliases), an integer stage 0-3 (not
    "2": DeepSpeed would convert it), and values DeepSpeed's schema accepts."""
    if zero is None or isinstance(zero, bool):  # absent, or DeepSpeed's old boolean form
        return
    if not isinstance(zero, dict):
        raise UserError(f"{source}: zero_optimization must be an object, got {shown(zero)}")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    fields = DeepSpeedZeroConfig.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    for key in zero:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean zero_optimization.{close[0]}?)" if close else ""
            raise UserError(f"{source}: unknown key {key!r} in zero_optimization{hint}")
    stage = zero.get("stage", 0)
    if type(stage) is not int or not 0 <= stage <= 3:
        raise UserError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3 (an integer), got {shown(stage)}")
    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise UserError(f"{source}: zero_optimization.{key}: {err['msg']}, got {shown(err.get('input'))}") from None
    except (AssertionError, ValueError) as e:  # DeepSpeed's own checks of deprecated keys
        raise UserError(f"{source}: zero_optimization: {e}") from None


def check_params(section, name: str, source) -> None:
    """optimizer / scheduler: an object whose `params` numbers are finite and >= 0 (learning rates, betas, eps,
    weight decay, warmup and decay steps of DeepSpeed's optimizers and schedules all are), and a number `lr`."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise UserError(f"{source}: {name} must be an object, got {shown(section)}")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise UserError(f"{source}: {name}.params must be an object, got {shown(params)}")
    for key, value in params.items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            if _is_number(v) or (key == "lr" and not isinstance(value, list)):
                _non_negative(v, f"{name}.params.{key}", source)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _non_negative(v, key: str, source) -> None:
    if not _is_number(v) or not math.isfinite(v) or v < 0:
        raise UserError(f"{source}: {key} must be a finite number >= 0, got {shown(v)}")
