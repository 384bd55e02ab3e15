"""Training configuration: the DeepSpeed JSON plus its `adaptive_load` section (ours), read once.

DeepSpeed's batch keys describe a fixed micro-batch. Ours vary (the scheduler picks B per micro-batch),
so `ds_batch_keys` sets them to count *micro-batches*: train_micro_batch_size_per_gpu = 1 and
train_batch_size = G * dp. DeepSpeed uses them only for its own bookkeeping (`global_samples`, the
samples axis of its monitor events, throughput log lines); its LR schedules step per optimizer step and
are unaffected. True sample and token counts are in our step log and monitor events.
"""
import difflib
import json
import os
from typing import Annotated, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.fileio import read_json_object
from ds_adaptiveload.model.fp8 import FP8_MODES
from ds_adaptiveload.schedule.policies import POLICIES
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


def setting(default=..., must=None, plan=False, **constraints):
    """A field of AdaptiveLoadConfig: `must` completes "adaptive_load.KEY must be ..." in errors (a Literal's choices
    need none); plan=True: the key shapes the plan, so a resume must keep it (layout_keys)."""
    return Field(default, json_schema_extra={"must": must, "plan": plan}, **constraints)


# LoRA target names (adaptive_load.lora.targets, --lora-targets) -> the block-relative module names they adapt. q, k,
# v, o name both attentions' projections; ffn.0 is the FFN's first linear, ffn.2 its second (after the GELU).
LORA_TARGETS = {
    **{p: (f"self_attn.{p}", f"cross_attn.{p}") for p in "qkvo"},
    **{f"{a}.{p}": (f"{a}.{p}",) for a in ("self_attn", "cross_attn") for p in "qkvo"},
    "self_attn": tuple(f"self_attn.{p}" for p in "qkvo"), "cross_attn": tuple(f"cross_attn.{p}" for p in "qkvo"),
    "ffn": ("ffn.0", "ffn.2"), "ffn.0": ("ffn.0",), "ffn.2": ("ffn.2",),
    "head": ("head",),  # the output projection (head.head), not in a block
}
# The set musubi-tuner and DiffSynth-Studio train on Wan: every attention projection and both FFN linears.
DEFAULT_LORA_TARGETS = ("q", "k", "v", "o", "ffn")


class LoraSettings(BaseModel):
    """adaptive_load.lora: train LoRA adapters (through peft) on a frozen base instead of every weight."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True,
                              validate_assignment=True)

    rank: int = setting(must="a positive integer", ge=1)
    """Rank r of each adapter: W x + (alpha / r) B A x, A [r, in], B [out, r] (B starts at zero)."""
    alpha: Optional[float] = setting(None, must="a positive number or null (the rank)", gt=0)
    """Scale numerator: the adapter's output is multiplied by alpha / rank (null: alpha = rank, scale 1)."""
    dropout: float = setting(0.0, must="a number in [0, 1)", ge=0.0, lt=1.0)
    """Dropout on the adapter's input (not on the base path)."""
    targets: list[Literal[tuple(LORA_TARGETS)]] = setting(list(DEFAULT_LORA_TARGETS), min_length=1,
                                                           must="a non-empty list of " + ", ".join(LORA_TARGETS))
    """Projections of every block that get adapters: q, k, v, o (both attentions), self_attn.q ... cross_attn.o,
    self_attn, cross_attn (their four), ffn.0, ffn.2, ffn (both); and head, the model's output projection. Default:
    q, k, v, o, ffn."""

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

    def modules(self) -> tuple:
        """The module names the targets adapt (block-relative; "head" for the output projection), sorted, each once."""
        return tuple(sorted({m for t in self.targets for m in LORA_TARGETS[t]}))


class AdaptiveLoadConfig(BaseModel):
    """The `adaptive_load` section of the DeepSpeed JSON: types, ranges, choices and unknown keys checked
    (strict: `"seed": true` or `"window": "4"` are refused, not converted). A new key is one field here."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True,
                              validate_assignment=True)

    profile: str = setting(must="the path of a cost profile YAML or \"auto\"", min_length=1, plan=True)
    """Cost profile YAML (profile.py): a relative path is looked up from the working directory, then from the JSON
    file's folder, then among the shipped profiles, which a name alone selects ("h100-wan1.3b-zero2"). "auto": the
    shipped profile measured for this model, GPU, ZeRO stage and sp, else the closest one, its memory moved to this
    GPU (shipped.py)."""
    policy: Literal[POLICIES] = setting("packed", plan=True)
    """A name of schedule/policies REGISTRY: packed | balanced | dual | equal-tokens. packed (the default since
    2026-12-02: docs/results.md) fills micro-batches with samples of several shapes, which the model runs as one
    packed forward; a model that takes one shape per micro-batch needs balanced."""
    seed: int = setting(0, must="a non-negative integer below 2**64", ge=0, lt=2**64, plan=True)
    """Plan shuffling seed, and the seed of model init, noise and timesteps. `data_efficiency.seed`, when
    given, sets it (DeepSpeed's data-efficiency seed). At most 2**64 - 1, torch.manual_seed's range."""
    on_oversize: Literal["error", "skip"] = setting("error", plan=True)
    """error | skip: a sample whose per-GPU tokens exceed the profile's memory budget."""
    window: Optional[int] = setting(None, must="an integer >= 0 or null", ge=0, plan=True)
    """balanced with G = 1, or G >= 2 under ZeRO-2/3 (lockstep): steps per cost-sorting window (None or 0 = whole
    epoch; smaller keeps steps closer to the data's composition, at some balance)."""
    fill: Optional[float] = setting(None, must="a number in [0.1, 1] or null", ge=0.1, le=1.0, plan=True)
    """balanced with G >= 2: fraction of a step's R*G micro-batch slots to fill (None: the planner
    chooses by predicted wall time, see policies/balanced.py FILL_CHOICES)."""
    replicate: Optional[bool] = setting(None, must="true, false or null", plan=True)
    """packed: light samples in runs of R of one shape, so that the micro-batches of a round are copies and
    cost the same (None: when a micro-batch holds fewer than about 10 samples, as with memory for one long
    clip; schedule/policies/packed.py)."""
    pack_tokens: Union[None, Literal["auto"], Annotated[int, Field(ge=1)]] = setting(
        None, must='a positive integer, "auto" or null', plan=True)
    """packed: the memory a micro-batch may fill, in tokens: null (the profile's budget), an integer (at most the
    budget), or "auto": the cap with the least predicted time per token (schedule/packed.pack_cap). With
    --checkpoint-blocks auto and a profile with time_ms.recompute_frac, smaller micro-batches leave blocks open and
    skip their recompute; steps then hold fewer samples (G micro-batches each)."""
    heavy_mix: float = setting(0.0, must="a number in [0, 1)", ge=0.0, lt=1.0, plan=True)
    """packed: the fraction of each heavy round's slots (clips that fill a micro-batch alone, as a 720p clip when
    memory holds about one) left to light samples (images, short clips), so that the steps that hold heavy clips
    hold the data's other samples too: steps closer to the data's composition (lower mix_tv), at more idle
    (docs/scheduler.md, "Step composition against balance"). 0: heavy clips fill whole rounds."""
    on_bad_sample: Literal["error", "skip"] = setting("error")
    """error | skip: a sample that cannot be read (missing or truncated shard, missing tensor, shape or
    dtype not matching the manifest, NaN/Inf values) or a non-finite loss. skip drops samples found
    bad before training from the plan, and skips a whole step on every rank when one is found during
    training (docs/reliability.md); both are counted and reported."""
    on_oom: Literal["error", "skip"] = setting("error")
    """error | skip: an accelerator out-of-memory error in a micro-batch. skip drops that step on every
    rank (no optimizer update) and continues; needs ZeRO-3 (docs/reliability.md)."""
    loss_weighting: Literal[LOSS_WEIGHTINGS] = setting("none")
    """none | bell: per-sample loss weight by timestep. bell is the bell-shaped weighting of
    DiffSynth-Studio's Wan training, centred on t = 0.5, zero at t = 1, mean 1 over the training
    timesteps (flow.timestep_weight)."""
    lr_scaling_method: Literal[LR_SCALING_METHODS] = setting("none")
    """none | linear | sqrt: scale each step's learning rate by (N / lr_reference_batch_size) or its square
    root, N the step's samples over all ranks (DeepSpeed's dynamic_batching.lr_scaling_method; DeepSpeed's
    default is linear, ours none, so the configured LR is the LR applied)."""
    lr_reference_batch_size: Optional[int] = setting(None, must="a positive integer or null", ge=1)
    """Samples per step that the configured LR refers to; None: the engine's train_batch_size(), as
    DeepSpeed's dynamic batching uses."""

    caption_dropout: float = setting(0.0, must="a number in [0, 1]", ge=0.0, le=1.0)
    """Share of samples that train on the empty prompt's embedding instead of their caption (classifier-free
    guidance; Wan and most video trainers use 0.1). The choice is seeded by (seed, epoch, sample id): the same on
    resume and at any world size. Needs empty_prompt.safetensors beside the manifest, which `encode` writes."""
    activation_offload: Union[Literal["off", "auto"], Annotated[int, Field(ge=0, strict=True)]] = setting(
        "off", must='"off", "auto" or an integer >= 0', plan=True)
    """Keep the inputs of checkpointed blocks in pinned host memory instead of device memory from forward to
    backward, copied on a side stream that overlaps compute (model/offload.py). "off"; an integer n: the first n
    checkpointed blocks; "auto" (needs --checkpoint-blocks auto): per micro-batch, the number with the least
    predicted time that fits, weighing the host link (profile memory.host_link_bytes_per_s, default 25e9 B/s)
    against the recompute the freed memory saves (schedule/offload.py). The planner costs every micro-batch with
    it: the recompute it saves and the host-copy time it does not hide."""
    ema_decay: Optional[float] = setting(None, must="a number in [0, 1) or null", ge=0.0, lt=1.0)
    """Keep an exponential moving average of the weights, ema = d * ema + (1 - d) * w after every applied update
    (e.g. 0.999), in fp32, partitioned like the weights under ZeRO-3; saved in checkpoints, exported with
    `export --ema`. null: none."""
    lora: Optional[LoraSettings] = setting(None, must="an object {rank, alpha, dropout, targets} or null")
    """LoRA fine-tuning (model/lora.py, docs/training.md): the base weights frozen in bf16 and out of the optimizer,
    adapters of rank `rank` on `targets` trained. null: every weight is trained."""
    fp8: Literal[FP8_MODES] = setting("off")
    """off | linear: linear runs every block's attention projections (q, k, v, o of both attentions) and FFN linears
    as torchao float8 layers with rowwise scaling (model/fp8.py); embeddings, head, modulation and attention stay
    bf16. Needs torchao (pip install 'torchao>=0.18') and a CUDA GPU of compute capability 8.9 or newer; not with
    lora. Off by default until the 300-step numerics run shows its held-out loss within the bf16 seed spread."""

    @model_validator(mode="after")
    def _pack_tokens_for_packed(self):
        for key, unset in (("pack_tokens", None), ("heavy_mix", 0.0)):
            if getattr(self, key) != unset and self.policy != "packed":
                raise PydanticCustomError("related", f"applies to the packed policy only (policy is {self.policy!r})",
                                          {"key": key})
        return self

    @model_validator(mode="after")
    def _fp8_without_lora(self):
        if self.fp8 != "off" and self.lora is not None:
            raise PydanticCustomError("related", f"{self.fp8!r} does not run with LoRA (adaptive_load.lora or "
                                      "--lora-rank): peft wraps the projections it converts; use \"off\" for LoRA",
                                      {"key": "fp8"})
        return self

    @classmethod
    def from_dict(cls, d, source, prefix="adaptive_load.", names=None) -> "AdaptiveLoadConfig":
        """Validate a section; a bad one is a UserError naming `source` and each bad key as prefix + key (names: a
        key's label where it came from elsewhere, e.g. {"seed": "data_efficiency.seed"})."""
        if not isinstance(d, dict):
            raise UserError(f"{source}: {prefix.rstrip('.')} must be an object, got {shown(d)}")
        return cls.checked(d, lambda key: (names or {}).get(key, prefix + key), f"{source}: ")

    @classmethod
    def checked(cls, values: dict, label, where: str = "") -> "AdaptiveLoadConfig":
        """cls(**values), with every validation error in one UserError line: `where`, then per error the key as
        label(key) names it (a JSON key, a command-line flag)."""
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise UserError(where + "; ".join(explain(cls, e, label))) from None

    def plan_config(self, world_size, sp=1, grad_accum=1, zero_stage=0, *, lockstep=None, **checkpoint):
        """The PlanConfig of a run: these keys with the run's layout. ZeRO-2/3 synchronise ranks at every
        micro-batch (reduce-scatter / all-gather), so zero_stage >= 2 plans lockstep rounds, not totals; lockstep
        overrides that (the plan command's --lockstep). checkpoint: PlanConfig's checkpoint and checkpoint_policy."""
        from ds_adaptiveload.schedule.planner import PlanConfig

        return PlanConfig(policy=self.policy, world_size=world_size, sp=sp, grad_accum=grad_accum, seed=self.seed,
                          on_oversize=self.on_oversize, window=self.window, fill=self.fill, replicate=self.replicate,
                          pack_tokens=self.pack_tokens, lockstep=zero_stage >= 2 if lockstep is None else lockstep,
                          activation_offload=self.activation_offload, heavy_mix=self.heavy_mix, **checkpoint)

    def layout_keys(self) -> dict:
        """The keys that shape the plan (setting(plan=True)), as a checkpoint's layout stores them: a resume must
        keep them; the others (failure policies, loss weighting, LR scaling, ...) may change between launches.
        pack_tokens null, heavy_mix 0 and activation_offload "off" are left out, as before those keys shaped the
        plan, so older checkpoints resume."""
        keys = {k: getattr(self, k) for k, f in type(self).model_fields.items() if f.json_schema_extra["plan"]}
        if keys.get("pack_tokens") is None:
            keys.pop("pack_tokens", None)
        if not keys.get("heavy_mix"):
            keys.pop("heavy_mix", None)
        if keys.get("activation_offload") in ("off", 0):
            keys.pop("activation_offload", None)
        return keys

    def resolve_profile(self, json_path) -> str:
        """The profile's path: as given, from the working directory, next to the JSON (json_path None, a config given
        as a dict: not tried), then among the shipped profiles (shipped.py). "auto" needs the run: profile_path."""
        from ds_adaptiveload import shipped

        if self.profile == "auto":
            raise UserError(f"{json_path}: adaptive_load.profile \"auto\" is chosen by the trainer for its model and "
                            f"GPU; here, name a profile (shipped: {', '.join(shipped.profile_names())})")
        return shipped.resolve(self.profile, f"{json_path}: adaptive_load.profile", json_path)

    def profile_path(self, json_path, model=None, zero_stage: int = 0, sp: int = 1, gpu=None) -> tuple:
        """(path, notes): resolve_profile's path, or for "auto" the shipped profile closest to this run (model: its
        WanConfig; gpu: train/setup.gpu_of's (name, capacity), None on a CPU; shipped.auto_profile) and a line
        saying which it took."""
        if self.profile != "auto":
            return self.resolve_profile(json_path), []
        from ds_adaptiveload import shipped

        return shipped.auto_profile(model, zero_stage, sp, gpu)

    def to_dict(self) -> dict:
        return self.model_dump()


def flag_name(key: str) -> str:
    """The command-line flag that mirrors an adaptive_load key: pack_tokens -> --pack-tokens."""
    return "--" + key.replace("_", "-")


def add_flag(parser, key: str, model=None, prefix: str = "", **kw):
    """parser.add_argument for the AdaptiveLoadConfig field `key` (or the field of `model`, a nested section, its flag
    named prefix + key), derived from the schema: the flag's name, default, choices (a Literal's) or type (int, float)
    and help (the field's docstring); kw overrides any of them. The value is checked by the schema afterwards
    (AdaptiveLoadConfig.checked(..., flag_name))."""
    field = (model or AdaptiveLoadConfig).model_fields[key]
    spec = {"default": field.default, "help": " ".join((field.description or "").split()).replace("%", "%%")}
    if get_origin(field.annotation) is Literal:
        spec["choices"] = get_args(field.annotation)
    else:
        spec["type"] = next((t for t in (field.annotation, *get_args(field.annotation)) if t in (int, float)), str)
    return parser.add_argument(flag_name(prefix + key), **{**spec, **kw})


def offload_arg(text):
    """--activation-offload's value as the schema takes it: off, auto, or an integer (digits)."""
    return int(text) if isinstance(text, str) and text.strip().isdigit() else text


def offload_from_flags(args, al: "AdaptiveLoadConfig", source: str) -> "AdaptiveLoadConfig":
    """`al` with --activation-offload (when given) over adaptive_load.activation_offload, checked by the schema."""
    value = getattr(args, "activation_offload", None)
    if value is None:
        return al
    return AdaptiveLoadConfig.checked({**al.model_dump(), "activation_offload": offload_arg(value)},
                                      lambda k: flag_name(k) if k == "activation_offload" else f"adaptive_load.{k}",
                                      f"{source}: ")


def fp8_from_flags(args, al: "AdaptiveLoadConfig", source: str) -> "AdaptiveLoadConfig":
    """`al` with --fp8 (when given) over adaptive_load.fp8, checked by the schema again, so that a LoRA section or
    --lora-* flags merged before are refused with it (the error names --fp8 where the flag gave it)."""
    value = getattr(args, "fp8", None)
    if value is None and al.fp8 == "off":
        return al
    given = value is not None
    values = {**al.model_dump(), **({"fp8": value} if given else {})}
    return AdaptiveLoadConfig.checked(values, lambda k: flag_name(k) if k == "fp8" and given else f"adaptive_load.{k}",
                                      f"{source}: ")


def _comma_list(text: str) -> list:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_lora_flags(parser) -> None:
    """--lora-rank, --lora-alpha, --lora-dropout and --lora-targets (a comma list), derived from LoraSettings; each
    left None when not given, so that lora_from_flags keeps the JSON's adaptive_load.lora values."""
    for key in LoraSettings.model_fields:
        kw = {"type": _comma_list, "metavar": "T[,T...]"} if key == "targets" else {}
        add_flag(parser, key, model=LoraSettings, prefix="lora_", default=None, **kw)


def lora_from_flags(args, al: "AdaptiveLoadConfig") -> "AdaptiveLoadConfig":
    """`al` with the --lora-* flags given on the command line merged over its lora section (a flag wins over the
    JSON's key); bad values are one UserError naming the flags. `al` itself when no flag is given."""
    given = {k: getattr(args, "lora_" + k) for k in LoraSettings.model_fields
             if getattr(args, "lora_" + k, None) is not None}
    if not given:
        return al
    values = {**(al.lora.model_dump() if al.lora else {}), **given}
    try:
        lora = LoraSettings.model_validate(values)
    except ValidationError as e:
        label = (lambda k: flag_name("lora_" + k) if k in given or k not in values else f"adaptive_load.lora.{k}")
        raise UserError("; ".join(explain(LoraSettings, e, label))) from None
    return al.model_copy(update={"lora": lora})


def lora_settings(args, ds: dict, source: str) -> Optional[LoraSettings]:
    """The LoRA settings of a tool that reads a DeepSpeed dict (calibrate): the --lora-* flags over the dict's
    adaptive_load.lora, or None for full training."""
    section = (ds.get("adaptive_load") or {}) if isinstance(ds, dict) else {}
    base = section.get("lora") if isinstance(section, dict) else None
    al = AdaptiveLoadConfig.model_construct(lora=None)
    if base is not None:
        try:
            al = AdaptiveLoadConfig.model_construct(lora=LoraSettings.model_validate(base))
        except ValidationError as e:
            raise UserError(f"{source}: " + "; ".join(explain(LoraSettings, e, lambda k: f"adaptive_load.lora.{k}")))
    return lora_from_flags(args, al).lora


def explain(model, err: ValidationError, label) -> list:
    """One phrase per bad key of a pydantic ValidationError of `model`: "LABEL must be <the field's must>, got
    <value>", "unknown key ... (did you mean ...)", "LABEL is required". A union reports one error per member; the
    key is named once."""
    out, done = [], set()
    for e in err.errors():
        ctx = e.get("ctx") or {}
        names, field, owner, inner = _field_at(model, e["loc"])
        if ctx.get("key"):  # a model validator's error about one of its keys
            names, field = names + [ctx["key"]], inner.model_fields.get(ctx["key"])
        key = ".".join(names)
        if key in done:
            continue
        done.add(key)
        if e["type"] == "extra_forbidden":
            out.append(_unknown(owner, names, label))
        elif e["type"] == "missing":
            out.append(f"{label(key)} is required ({_must(field)})")
        elif ctx.get("key"):
            out.append(f"{label(key)} {e['msg']}")
        elif field is not None:
            out.append(f"{label(key)} must be {_must(field)}, got {shown(e['input'])}")
        else:
            out.append(f"{label(key) if key else 'the section'}: {e['msg']}, got {shown(e['input'])}")
    return out


def _field_at(model, loc):
    """(the key path, its FieldInfo or None for an unknown key, the model the last key belongs to, the nested model
    the path ends in or None) of an error's location, descending into nested models (a section such as
    `lora: {...}`). After a plain field, `loc` goes on with a union member's tag ("int", "literal['auto']") or a
    list index: not keys."""
    names, field, owner = [], None, model
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None:
            break
        owner, field = model, fields.get(part)
        names.append(str(part))
        if field is None:
            break  # a key the model does not have
        model = next((a for a in (field.annotation, *get_args(field.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return names, field, owner, model


def _must(field) -> str:
    extra = (field.json_schema_extra or {}) if field is not None else {}
    if extra.get("must"):
        return extra["must"]
    choices = get_args(field.annotation) if field is not None and get_origin(field.annotation) is Literal else ()
    quoted = [json.dumps(c) for c in choices]
    if len(quoted) == 2:
        return " or ".join(quoted)
    return f"one of {', '.join(quoted)}" if quoted else "valid"


def _unknown(model, names, label) -> str:
    known = list(model.model_fields)
    close = difflib.get_close_matches(names[-1], known, n=1)
    hint = f" (did you mean {label('.'.join(names[:-1] + close))}?)" if close else ""
    section = label(".".join(names[:-1])) if names[:-1] else label("").rstrip(".-") or "the section"
    return f"unknown key {names[-1]!r} in {section}{hint}; known: {', '.join(known)}"


def shown(value) -> str:
    """A bad value as an error line quotes it: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    prefix, names = "adaptive_load." if top else f"{NESTED}.", {}
    if isinstance(section, dict) and "seed" in de:
        mine, theirs = section.get("seed"), de["seed"]
        if "seed" in section and (type(mine) is not type(theirs) or mine != theirs):  # true is not 1
            raise UserError(f"{source}: adaptive_load.seed {mine!r} and data_efficiency.seed {theirs!r} differ; "
                            f"give one")
        section, names = {**section, "seed": theirs}, {"seed": "data_efficiency.seed"}
    return AdaptiveLoadConfig.from_dict(section, source, prefix, names)


def load_ds_config(path):
    """-> (DeepSpeed dict without `adaptive_load`, AdaptiveLoadConfig). DeepSpeed ignores a top-level key it does not
    read (a misspelt `zero_optimisation` trained under ZeRO-0), so its keys are checked against the installed
    DeepSpeed first (ds_keys.py). Ours is removed: DeepSpeed stores the dict in every checkpoint and prints it."""
    ds = read_json_object(path, "DeepSpeed config")
    al = adaptive_load_section(ds, path, pop=True)
    from ds_adaptiveload.train.ds_keys import check_deepspeed_config

    check_deepspeed_config(ds, path)
    gas = ds.get("gradient_accumulation_steps", 1)
    if not isinstance(gas, int) or isinstance(gas, bool) or gas < 1:
        raise UserError(f"{path}: gradient_accumulation_steps must be a positive integer, got {gas!r}")
    sp = ds.get("sequence_parallel_size", 1)
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise UserError(f"{path}: sequence_parallel_size must be a positive integer, got {sp!r}")
    check_monitors(ds, path)
    return ds, al


def check_grad_accum(G: int, dp: int, num_samples: int, label: str, data) -> None:
    """A step is G micro-batches on each of dp ranks, each holding at least one sample: with more micro-batches
    than samples every step would be mostly pads (repeats trained with weight 0), and a G of millions plans for
    ever. Checked before planning; `label` names G where it was given, `data` where the samples are."""
    if G * dp > num_samples:
        fix = f"; give at most {num_samples // dp}" if num_samples >= dp else ""
        raise UserError(f"{label} {G} x {dp} data-parallel rank(s) = {G * dp} micro-batches per step, more than the "
                        f"{num_samples} samples in {data}{fix}")


def ds_batch_keys(ds: dict, dp_world: int) -> dict:
    """Set DeepSpeed's batch keys to count micro-batches (module docstring); returns what changed."""
    gas = ds.get("gradient_accumulation_steps", 1)
    want = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
            "train_batch_size": gas * dp_world}
    changed = {k: (ds.get(k), v) for k, v in want.items() if k in ds and ds[k] != v}
    ds.update(want)
    return changed


MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")
MONITOR_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                    "comet": ("comet_ml", "comet_ml>=3.41.0")}
"""DeepSpeed monitor section -> (the module it imports, what to pip install); csv_monitor needs no package."""


def module_installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def check_monitors(ds: dict, source) -> None:
    """A monitor the DeepSpeed JSON enables whose package is missing, named when the config is read. DeepSpeed imports
    it only inside deepspeed.initialize, on rank 0: a CPU run with tensorboard enabled and not installed failed 89 s
    in, its cause buried in C++ stack dumps of the other rank."""
    for key, (module, pip) in MONITOR_PACKAGES.items():
        section = ds.get(key)
        if isinstance(section, dict) and section.get("enabled") and not module_installed(module):
            raise UserError(f"{source}: {key}.enabled is true but the {module} package is not installed: "
                            f"pip install '{pip}', or set {key}.enabled to false")


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
