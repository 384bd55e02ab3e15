"""Bad input files give a UserError naming file and line (or the YAML key), never a traceback: the
manifest and profile loaders and the adaptive_load schema fuzzed with arbitrary bytes and arbitrary JSON / YAML
values for each field (hypothesis), plus the cases of issue #16 item 6, `plan --dump` into a folder, and the
adaptive_load keys named in their errors (the file and the key, or the plan command's flag)."""
import json
import math
import os
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.manifest import load_manifest
from ds_adaptiveload.schedule.profile import CostProfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
GOOD_LINE = {"id": "a", "frames": 1, "height": 16, "width": 16, "shard": "s.safetensors"}
GOOD_PROFILE = {"time_ms": {"fixed": 1.0, "per_token": 0.01, "per_token_sq": 0.0},
                "memory": {"budget_tokens": 1000}}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70) | st.just(10**400)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
yaml_values = json_values | st.binary(max_size=4) | st.dates() | st.datetimes()


def only_user_error(fn, *args):
    """fn either returns or raises UserError; anything else fails the test (hypothesis shrinks it)."""
    try:
        return fn(*args)
    except UserError as e:
        assert str(e)
        return None


# ----------------------------------------------------------------------------------------------------
# Manifest


@FUZZ
@given(data=st.binary(max_size=300))
def test_manifest_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "m.jsonl"
    path.write_bytes(data)
    only_user_error(load_manifest, str(path))


@FUZZ
@given(key=st.sampled_from(sorted(GOOD_LINE) + ["other"]), value=json_values, drop=st.booleans())
def test_manifest_arbitrary_field_values(tmp_path, key, value, drop):
    rec = dict(GOOD_LINE)
    if drop:
        rec.pop(key, None)
    else:
        rec[key] = value
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(GOOD_LINE | {"id": "b"}) + "\n" + json.dumps(rec) + "\n")
    samples = only_user_error(load_manifest, str(path))
    if samples is not None:  # accepted: the geometry fields are the integers the planner needs
        s = samples[1]
        assert all(type(v) is int and v > 0 for v in (s.frames, s.height, s.width)) and isinstance(s.id, str)


def test_manifest_bad_byte_names_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(json.dumps(GOOD_LINE).encode() + b"\n" + b'{"id": "caf\xe9", "frames": 1}\n')
    with pytest.raises(UserError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at byte 12 of the line\)"):
        load_manifest(str(path))


def test_manifest_with_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD_LINE).encode() + b"\n")
    assert [s.id for s in load_manifest(str(path))] == ["a"]


def test_manifest_deep_nesting_and_huge_numbers(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("[" * 100000 + "\n")
    with pytest.raises(UserError, match=rf"{path}:1: not valid JSON"):
        load_manifest(str(path))
    path.write_text('{"id": "a", "frames": ' + "9" * 5000 + ', "height": 16, "width": 16}\n')
    with pytest.raises(UserError, match=rf"{path}:1: not valid JSON"):
        load_manifest(str(path))


# ----------------------------------------------------------------------------------------------------
# Profile


def write_profile(tmp_path, doc):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return str(path)


@FUZZ
@given(data=st.binary(max_size=300))
def test_profile_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "p.yaml"
    path.write_bytes(data)
    only_user_error(CostProfile.load, str(path))


FIELDS = [("time_ms", k) for k in ("fixed", "per_token", "per_token_sq", "step_fixed", "floor", "floor_q")] + \
         [("memory", k) for k in ("budget_tokens", "sample_tokens", "fixed_bytes", "bytes_per_token",
                                  "bytes_per_sample", "capacity_bytes", "safety")] + \
         [("dual", "p"), ("dual", "m_comp"), ("geometry", "vae_stride"), ("geometry", "patch_size"),
          ("meta", "sp"), ("time_ms", None), ("memory", None), ("dual", None), ("geometry", None), ("meta", None)]


@FUZZ
@given(field=st.sampled_from(FIELDS), value=yaml_values)
def test_profile_arbitrary_field_values(tmp_path, field, value):
    doc = json.loads(json.dumps(GOOD_PROFILE))
    section, key = field
    if key is None:
        doc[section] = value
    elif section == "dual":  # p and m_comp come together
        doc["dual"] = {"p": 1.0, "m_comp": 1.0, key: value}
    else:
        doc.setdefault(section, {})
        doc[section][key] = value
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    p = only_user_error(CostProfile.load, write_profile(tmp_path, text))
    if p is not None:  # accepted: every number the planner reads is a real, finite number
        for v in (p.fixed_ms, p.per_token_ms, p.per_token_sq_ms, p.step_fixed_ms, p.floor_ms, p.sample_tokens):
            assert type(v) in (int, float) and math.isfinite(v) and v >= 0
        assert type(p.budget_tokens) is int and p.budget_tokens >= 1
        assert p.micro_ms(1, 10) >= 0 and isinstance(p.meta, dict)


@pytest.mark.parametrize("doc, message", [
    ({"dual": {"p": "x", "m_comp": 1.0}}, r"dual.p must be a number > 0, got 'x'"),
    ({"memory": {"budget_tokens": True}}, r"memory.budget_tokens must be a positive integer, got True"),
    ({"time_ms": {"per_token": -1.0}}, r"time_ms.per_token must be a finite number >= 0, got -1.0"),
    ({"time_ms": {"floor_q": "8"}}, r"time_ms.floor_q must be a number >= 1, got '8'"),
    ({"memory": {"bytes_per_token": "1e6"}}, r"memory.bytes_per_token must be a finite number >= 0, got '1e6'"),
    ({"meta": [1]}, r"section 'meta' must be a mapping"),
])
def test_profile_wrong_types_name_the_yaml_key(tmp_path, doc, message):
    full = json.loads(json.dumps(GOOD_PROFILE))
    for section, values in doc.items():
        full[section] = {**full.get(section, {}), **values} if isinstance(values, dict) else values
    path = write_profile(tmp_path, full)
    with pytest.raises(UserError, match=rf"{path}: profile: {message}"):
        CostProfile.load(path)


def test_profile_bad_byte_and_bom(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + yaml.safe_dump(GOOD_PROFILE).encode())
    assert CostProfile.load(str(path)).budget_tokens == 1000
    path.write_bytes(yaml.safe_dump(GOOD_PROFILE).encode() + b"# caf\xe9\n")
    with pytest.raises(UserError, match=rf"{path}: invalid YAML"):
        CostProfile.load(str(path))


# ----------------------------------------------------------------------------------------------------
# plan --dump


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_plan_dump_into_a_folder_or_missing_folder(tmp_path, where, capsys):
    from ds_adaptiveload.cli import main

    dump = tmp_path if where == "folder" else tmp_path / "no" / "plan.jsonl"
    code = main(["plan", "--mix", "tiny:50", "--profile", os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"),
                 "--world-size", "2", "--dump", str(dump)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --dump {dump}: "), err
    assert ("is a folder" if where == "folder" else "its folder does not exist") in err


def test_profile_floor_q_too_large_for_a_float_is_a_user_error(tmp_path):
    """Found by the fuzz test in CI: an integer floor_q beyond float range overflowed in smooth_max."""
    doc = json.loads(json.dumps(GOOD_PROFILE))
    doc["time_ms"]["floor_q"] = 10 ** 400
    with pytest.raises(UserError, match="time_ms.floor_q must be a number >= 1"):
        CostProfile.load(write_profile(tmp_path, yaml.safe_dump(doc)))


# ----------------------------------------------------------------------------------------------------
# The adaptive_load section (train/config.AdaptiveLoadConfig, a pydantic schema)

AL_KEYS = ["profile", "policy", "seed", "on_oversize", "window", "fill", "replicate", "pack_tokens", "heavy_mix",
           "on_bad_sample", "on_oom", "loss_weighting", "lr_scaling_method", "lr_reference_batch_size", "other"]


@FUZZ
@given(key=st.sampled_from(AL_KEYS), value=json_values)
def test_adaptive_load_arbitrary_values(key, value):
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    al = only_user_error(AdaptiveLoadConfig.from_dict, {"profile": "p.yaml", key: value}, "ds.json")
    if al is not None:  # accepted: exactly the types the planner and trainer read, nothing converted
        assert type(al.seed) is int and 0 <= al.seed < 2**64 and isinstance(al.profile, str) and al.profile
        assert al.window is None or (type(al.window) is int and al.window >= 0)
        assert al.fill is None or (type(al.fill) is float and 0.1 <= al.fill <= 1)
        assert al.replicate in (None, True, False) and al.on_oom in ("error", "skip")
        assert al.pack_tokens in (None, "auto") or (type(al.pack_tokens) is int and al.pack_tokens >= 1)
        assert type(al.heavy_mix) is float and 0 <= al.heavy_mix < 1
        assert getattr(al, key) == value


@pytest.mark.parametrize("section, message", [
    ({"seed": 1.5}, "adaptive_load.seed must be a non-negative integer below 2**64, got 1.5"),
    ({"seed": "zero"}, "adaptive_load.seed must be a non-negative integer below 2**64, got 'zero'"),
    ({"seed": float("nan")}, "adaptive_load.seed must be a non-negative integer below 2**64, got nan"),
    ({"seed": True}, "adaptive_load.seed must be a non-negative integer below 2**64, got True"),
    ({"seed": -1}, "adaptive_load.seed must be a non-negative integer below 2**64, got -1"),
    ({"seed": 2**64}, "adaptive_load.seed must be a non-negative integer below 2**64, got 18446744073709551616"),
    ({"window": "abc"}, "adaptive_load.window must be an integer >= 0 or null, got 'abc'"),
    ({"window": 2.0}, "adaptive_load.window must be an integer >= 0 or null, got 2.0"),
    ({"fill": float("inf")}, "adaptive_load.fill must be a number in [0.1, 1] or null, got inf"),
    ({"policy": "fast"}, 'adaptive_load.policy must be one of "balanced", "dual", "equal-tokens", "packed", got'),
    ({"pack_tokens": 8, "policy": "balanced"}, "adaptive_load.pack_tokens applies to the packed policy only"),
    ({"seeed": 1}, "unknown key 'seeed' in adaptive_load (did you mean adaptive_load.seed?); known: profile, "),
    ({"profile": None}, "adaptive_load.profile must be the path of a cost profile YAML or \"auto\", got None"),
])
def test_adaptive_load_errors_name_file_and_key(tmp_path, section, message):
    """No silent coercion (true is not 1, 1.5 and "4" are not integers) and no traceback: one line naming the file
    and the key."""
    from ds_adaptiveload.train.config import load_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"adaptive_load": {"profile": "p.yaml", **section}}))
    with pytest.raises(UserError) as e:
        load_ds_config(str(path))
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_adaptive_load_errors_name_where_the_key_is(tmp_path):
    """The nested form names its path; data_efficiency.seed, which sets the seed, is named as itself; a section
    that is not an object says so."""
    from ds_adaptiveload.train.config import load_ds_config

    path = tmp_path / "ds.json"
    for doc, message in [
        ({"data_efficiency": {"data_sampling": {"adaptive_load": {"profile": "p", "fill": 0}}}},
         "data_efficiency.data_sampling.adaptive_load.fill must be a number in [0.1, 1] or null, got 0"),
        ({"data_efficiency": {"seed": 0.5}, "adaptive_load": {"profile": "p"}},
         "data_efficiency.seed must be a non-negative integer below 2**64, got 0.5"),
        ({"data_efficiency": {"seed": 1}, "adaptive_load": {"profile": "p", "seed": True}},
         "adaptive_load.seed True and data_efficiency.seed 1 differ"),
        ({"adaptive_load": ["p"]}, "adaptive_load must be an object, got ['p']")]:
        path.write_text(json.dumps(doc))
        with pytest.raises(UserError, match=re.escape(f"{path}: {message}")):
            load_ds_config(str(path))


@pytest.mark.parametrize("section", [{}, {"policy": "balanced", "window": 3, "fill": 0.5, "seed": 9},
                                     {"replicate": False, "pack_tokens": "auto", "on_oversize": "skip"},
                                     {"policy": "dual", "seed": 2**63}, {"policy": "equal-tokens", "window": 0}])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_plan_config_is_the_hand_built_one(section, stage):
    """AdaptiveLoadConfig.plan_config gives the PlanConfig the trainer, the loader API and the plan command built by
    hand before (plans do not change: tests/test_plan_digests.py)."""
    from ds_adaptiveload.schedule.planner import PlanConfig
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", **section}, "ds.json")
    ckpt = {"checkpoint": "auto-step" if stage == 3 else "auto", "checkpoint_policy": "full"}
    assert al.plan_config(8, 2, 4, stage, **ckpt) == PlanConfig(
        policy=al.policy, world_size=8, sp=2, grad_accum=4, seed=al.seed, on_oversize=al.on_oversize, window=al.window,
        fill=al.fill, replicate=al.replicate, pack_tokens=al.pack_tokens, lockstep=stage >= 2, **ckpt)
    assert al.plan_config(8, zero_stage=3, lockstep=False).lockstep is False  # plan --lockstep decides there


def test_plan_config_is_built_in_one_place():
    """Outside the torch-free schedule/, only AdaptiveLoadConfig.plan_config builds a PlanConfig."""
    pkg = os.path.join(ROOT, "ds_adaptiveload")
    builders = []
    for folder, _, files in os.walk(pkg):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and os.sep + "schedule" + os.sep not in path:
                builders += [os.path.relpath(path, ROOT) for line in open(path) if "PlanConfig(" in line]
    assert builders == [os.path.join("ds_adaptiveload", "train", "config.py")]


def test_layout_keys_are_the_plan_keys():
    """A checkpoint's layout holds the keys that shape the plan, the same as before the schema (older checkpoints
    resume); failure policies, loss weighting and LR scaling may change between launches."""
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    al = AdaptiveLoadConfig.from_dict({"profile": "p.yaml", "on_oom": "skip", "lr_scaling_method": "sqrt"}, "ds.json")
    assert al.layout_keys() == {"profile": "p.yaml", "policy": "packed", "seed": 0, "on_oversize": "error",
                                "window": None, "fill": None, "replicate": None}
    assert al.model_copy(update={"pack_tokens": "auto"}).layout_keys()["pack_tokens"] == "auto"
    assert al.model_copy(update={"activation_offload": 2}).layout_keys()["activation_offload"] == 2  # costed by it


def test_every_field_has_a_docstring():
    from ds_adaptiveload.train.config import AdaptiveLoadConfig

    assert all(f.description and len(f.description) > 20 for f in AdaptiveLoadConfig.model_fields.values())


def test_plan_flags_are_checked_by_the_schema(capsys):
    """plan's flags that mirror adaptive_load keys come from the schema and are checked by it, named as flags."""
    from ds_adaptiveload.cli import main

    args = ["plan", "--mix", "tiny:50", "--profile", os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"),
            "--world-size", "2"]
    for extra, message in [(["--seed", "-1"], "error: --seed must be a non-negative integer below 2**64, got -1"),
                           (["--fill", "nan"], "error: --fill must be a number in [0.1, 1] or null, got nan"),
                           (["--window", "-2"], "error: --window must be an integer >= 0 or null, got -2"),
                           (["--policy", "balanced", "--pack-tokens", "9"],
                            "error: --pack-tokens applies to the packed policy only (policy is 'balanced')")]:
        assert main([*args, *extra]) == 2
        err = capsys.readouterr().err
        assert err.strip() == message, err


# ----------------------------------------------------------------------------------------------------
# The trainer's checks before DeepSpeed (python -m ds_adaptiveload train, launch/train_wan.py): every bad input of
# the table is one UserError (exit 2 on every rank, one `error:` line) naming the file, line, key, flag or sample;
# none is a traceback, none is accepted


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 16-sample tiny dataset (two shards), the tiny-CPU DeepSpeed JSON and model YAML, and one shard copied
    outside the dataset's folder: the good inputs the table's cases change one thing of."""
    from ds_adaptiveload.data import latents
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.mixes import make_mix

    root = tmp_path_factory.mktemp("tiny")
    model = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    manifest = latents.write_synthetic(str(root / "data"), make_mix("tiny", 16, 0), text_dim=model.text_dim,
                                       max_text_len=model.text_len, dtype="fp32", shard_size=8)
    (root / "outside.safetensors").write_bytes((root / "data" / "shard-00000.safetensors").read_bytes())
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        ds = json.load(f)
    ds["adaptive_load"]["profile"] = os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml")
    ds["csv_monitor"]["output_path"] = str(root / "monitor")
    with open(os.path.join(ROOT, "configs", "wan_tiny.yaml")) as f:
        model_yaml = f.read()
    return {"root": root, "manifest": manifest, "ds": ds, "model": model_yaml}


def _set(*path_value):
    """A DeepSpeed-JSON change: set the key at path (a dotted path) to value; None as the value removes it."""
    *keys, value = path_value

    def change(ds):
        *parents, last = keys[0].split(".")
        for k in parents:
            ds = ds[k]
        if value is None:
            ds.pop(last)
        else:
            ds[last] = value
    return change


def _rename(old, new):
    return lambda ds: ds.__setitem__(new, ds.pop(old))


def _line(i, **changes):
    """A manifest change: line i (0-based) updated with `changes`; values may be callables of the dataset root."""
    return lambda recs, root: recs[i].update({k: v(root) if callable(v) else v for k, v in changes.items()})


OUTSIDE = lambda root: str(root / "outside.safetensors")  # noqa: E731

# (case, change, what the error line must name). A change is {"ds": f(ds dict), "model": {key: YAML value text} (the
# key's line replaced; "extra line": a line appended), "manifest": f(records, root), "flags": [...]}.
TRAIN_CASES = [
    # the DeepSpeed JSON: our section
    ("seed float", {"ds": _set("adaptive_load.seed", 1.5)}, "adaptive_load.seed must be a non-negative integer"),
    ("seed string", {"ds": _set("adaptive_load.seed", "zero")}, "adaptive_load.seed must be a non-negative integer"),
    ("seed NaN", {"ds": _set("adaptive_load.seed", float("nan"))}, "adaptive_load.seed must be"),
    ("seed true", {"ds": _set("adaptive_load.seed", True)}, "adaptive_load.seed must be a non-negative integer"),
    ("seed negative", {"ds": _set("adaptive_load.seed", -1)}, "adaptive_load.seed must be a non-negative integer"),
    # ... and DeepSpeed's keys
    ("lr NaN", {"ds": _set("optimizer.params.lr", float("nan"))}, "optimizer.params.lr must be a finite number >= 0"),
    ("lr negative", {"ds": _set("optimizer.params.lr", -1e-4)}, "optimizer.params.lr must be a finite number >= 0"),
    ("lr string", {"ds": _set("optimizer.params.lr", "1e-4")}, "optimizer.params.lr must be a finite number >= 0"),
    ("warmup negative", {"ds": _set("scheduler.params.warmup_num_steps", -2)},
     "scheduler.params.warmup_num_steps must be a finite number >= 0, got -2"),
    ("stage 7", {"ds": _set("zero_optimization.stage", 7)}, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ("stage string", {"ds": _set("zero_optimization.stage", "2")},
     "zero_optimization.stage must be 0, 1, 2 or 3 (an integer), got '2'"),
    ("misspelt top-level key", {"ds": _rename("zero_optimization", "zero_optimisation")},
     "unknown top-level key 'zero_optimisation' (did you mean zero_optimization?)"),
    ("misspelt zero key", {"ds": _set("zero_optimization.overlap_com", True)},
     "unknown key 'overlap_com' in zero_optimization (did you mean zero_optimization.overlap_comm?)"),
    ("zero value of the wrong type", {"ds": _set("zero_optimization.reduce_bucket_size", "lots")},
     "zero_optimization.reduce_bucket_size"),
    ("our key at the top level", {"ds": _set("policy", "balanced")},
     "'policy' is an adaptive_load key; move it into the adaptive_load section"),
    ("huge gradient_accumulation_steps", {"ds": _set("gradient_accumulation_steps", 10**9)},
     "gradient_accumulation_steps 1000000000 x 2 data-parallel rank(s)"),
    ("gradient_accumulation_steps true", {"ds": _set("gradient_accumulation_steps", True)},
     "gradient_accumulation_steps must be a positive integer, got True"),
    # the model YAML
    ("dim as a string", {"model": {"dim": '"128"'}}, "model.yaml: dim must be a positive integer, got '128'"),
    ("eps as a string", {"model": {"eps": '"1e-6"'}}, "model.yaml: eps must be a finite number, got '1e-6'"),
    ("num_layers true", {"model": {"num_layers": "true"}}, "model.yaml: num_layers must be a positive integer"),
    ("duplicate YAML key", {"model": {"extra line": "num_layers: 3"}},
     "model.yaml:18: duplicate key 'num_layers' (first on line 8)"),
    # the manifest
    ("latent_key a list", {"manifest": _line(2, latent_key=["a"])}, ":3: sample 'tiny-0000002': latent_key must be"),
    ("shard an integer", {"manifest": _line(0, shard=5)}, ":1: sample 'tiny-0000000': shard must be"),
    ("shard through ..", {"manifest": _line(1, shard="../outside.safetensors")},
     "shard '../outside.safetensors' is outside the manifest's folder"),
    ("shard absolute", {"manifest": _line(1, shard=OUTSIDE)}, "is outside the manifest's folder"),
    ("shard /etc/passwd", {"manifest": _line(4, shard="/etc/passwd")}, "'/etc/passwd' is outside the manifest's"),
    ("shard /etc/passwd, external allowed", {"manifest": _line(4, shard="/etc/passwd"),
                                             "flags": ["--allow-external-shards"]},
     "/etc/passwd: not a safetensors file"),
    ("shard a folder, external allowed", {"manifest": _line(4, shard="/etc"), "flags": ["--allow-external-shards"]},
     "/etc: not a regular file"),
    ("id with an escape sequence", {"manifest": _line(3, id="x\x1b[2Jy")}, ":4: id 'x\\x1b[2Jy' holds a control"),
    ("id with a newline", {"manifest": _line(3, id="x\ny")}, ":4: id 'x\\ny' holds a control character"),
    # flags
    ("--max-steps 0", {"flags": ["--max-steps", "0"]}, "--max-steps must be a positive integer, got '0'"),
    ("--max-steps negative", {"flags": ["--max-steps", "-3"]}, "--max-steps must be a positive integer, got '-3'"),
    ("--save-every negative", {"flags": ["--save-every", "-1"]}, "--save-every must be an integer >= 0, got '-1'"),
    ("--num-workers negative", {"flags": ["--num-workers", "-1"]}, "--num-workers must be an integer >= 0"),
    ("--prefetch-factor 0", {"flags": ["--prefetch-factor", "0"]}, "--prefetch-factor must be a positive integer"),
    ("--peak-tflops 0", {"flags": ["--peak-tflops", "0"]}, "--peak-tflops must be a number > 0, got '0'"),
    ("--peak-tflops nan", {"flags": ["--peak-tflops", "nan"]}, "--peak-tflops must be a finite number, got 'nan'"),
    ("--timestep-shift 0", {"flags": ["--timestep-shift", "0"]}, "--timestep-shift must be a number > 0"),
    ("--timestep-shift negative", {"flags": ["--timestep-shift", "-1"]}, "--timestep-shift must be a number > 0"),
    ("--checkpoint-blocks negative", {"flags": ["--checkpoint-blocks", "-1"]},
     "--checkpoint-blocks must be 'auto' or a number of blocks >= 0, got '-1'"),
    ("--checkpoint-blocks above the layers", {"flags": ["--checkpoint-blocks", "99"]},
     "--checkpoint-blocks 99: more than the model's 2 blocks"),
    ("--output a file", {"flags": ["--output", "FILE"]}, "--output must be a folder, but"),
    ("--synthetic-num 0", {"flags": ["--synthetic", "--synthetic-num", "0"]}, "--synthetic-num must be a positive"),
]


def train_argv(run, change, tmp_path) -> list:
    """train_wan's argv for the tiny run with one change applied (files written under tmp_path)."""
    ds = json.loads(json.dumps(run["ds"]))
    if "ds" in change:
        change["ds"](ds)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    lines = run["model"].splitlines()
    for key, value in change.get("model", {}).items():
        if key == "extra line":
            lines.append(value)
        else:
            lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in lines]
    (tmp_path / "model.yaml").write_text("\n".join(lines) + "\n")
    manifest = run["manifest"]
    if "manifest" in change:
        with open(manifest) as f:
            recs = [json.loads(line) for line in f]
        change["manifest"](recs, run["root"])
        manifest = os.path.join(os.path.dirname(manifest), f"changed-{tmp_path.name}.jsonl")
        with open(manifest, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "FILE").write_text("")
    flags = [str(tmp_path / "FILE") if a == "FILE" else a for a in change.get("flags", [])]
    data = [] if "--synthetic" in flags else ["--data", manifest]
    return ["--deepspeed_config", str(tmp_path / "ds.json"), "--model-config", str(tmp_path / "model.yaml"), *data,
            "--output", str(tmp_path / "out"), "--max-steps", "2", *flags]


def train_outcome(run, change, tmp_path):
    """("error", its line), ("traceback", the traceback) or ("accepted", "") of the trainer's checks before DeepSpeed
    (flags, config, model, profile, manifest with its shard headers, plan) on rank 0 of 2: what every rank runs
    before its first collective; a UserError there ends every rank with exit 2 and one line (train/failures.py)."""
    import traceback

    from ds_adaptiveload import train_cli
    from ds_adaptiveload.train.setup import prepare_data, read_config

    try:
        args = train_cli.parse_args(train_argv(run, change, tmp_path))
        train_cli.check(args)
        c = read_config(args, 2, 0)
        if args.data:
            prepare_data(args, args.data, c, 2, 0)
    except UserError as e:
        return "error", str(e)
    except Exception:
        return "traceback", traceback.format_exc()
    return "accepted", ""


@pytest.mark.parametrize("case, change, message", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_wan_refuses_bad_input_in_one_line(tiny_run, tmp_path, case, change, message):
    kind, text = train_outcome(tiny_run, change, tmp_path)
    assert kind == "error", (case, kind, text)
    assert message in text and "\n" not in text, text


def test_the_table_counts_no_traceback_and_no_silent_accept(tiny_run, tmp_path):
    """Over every case of the table: 0 tracebacks, 0 accepted; the unchanged run and external shards allowed by the
    flag are accepted (the checks refuse what is wrong, not everything)."""
    tally, wrong = {}, []
    for i, (case, change, message) in enumerate(TRAIN_CASES):
        (tmp_path / str(i)).mkdir()
        kind, text = train_outcome(tiny_run, change, tmp_path / str(i))
        tally[kind] = tally.get(kind, 0) + 1
        if kind != "error" or message not in text:
            wrong.append((case, kind, text[-300:]))
    assert tally == {"error": len(TRAIN_CASES)} and not wrong, (tally, wrong)
    for i, change in enumerate([{}, {"manifest": _line(1, shard=OUTSIDE), "flags": ["--allow-external-shards"]},
                                {"flags": ["--checkpoint-blocks", "2", "--save-every", "0", "--num-workers", "0"]}]):
        (tmp_path / f"good{i}").mkdir()
        assert train_outcome(tiny_run, change, tmp_path / f"good{i}") == ("accepted", "")


def test_external_shards_are_read_only_when_allowed(tiny_run, tmp_path):
    """The loader reads a shard outside the manifest's folder with external_shards=True only, and the header check
    names a foreign file instead of handing it to the safetensors reader."""
    from ds_adaptiveload.data import latents
    from ds_adaptiveload.model import WanConfig
    from ds_adaptiveload.schedule.geometry import Geometry

    model = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))
    samples = load_manifest(tiny_run["manifest"])
    samples[0].extra["shard"] = OUTSIDE(tiny_run["root"])
    refused = latents.LatentDataset(samples, tiny_run["manifest"], Geometry(), model.text_len, model.text_dim)
    with pytest.raises(UserError, match=r"manifest.jsonl:1: sample 'tiny-0000000': shard '/.*' is outside"):
        refused.__getitems__([0])
    allowed = latents.LatentDataset(samples, tiny_run["manifest"], Geometry(), model.text_len, model.text_dim,
                                    external_shards=True)
    assert allowed.__getitems__([0])["ids"] == ["tiny-0000000"]
    samples[1].extra["shard"] = "/etc/passwd"
    with pytest.raises(UserError, match=r"^/etc/passwd: not a safetensors file \(\d+ bytes, no safetensors header\) "
                                        r"\(sample 'tiny-0000001'"):
        allowed.__getitems__([1])


# ----------------------------------------------------------------------------------------------------
# `python -m ds_adaptiveload` commands: a bad flag or an existing dataset is one `error:` line and exit 2


SYN = ["synthesize", "--out", "OUT", "--mix", "tiny"]  # OUT: a folder under tmp_path, which a refusal leaves absent
PLAN = ["plan", "--mix", "tiny:50", "--profile", os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml")]
CLI_CASES = [
    ("synthesize --shard-size -1", [*SYN, "--num", "4", "--shard-size", "-1"],
     "error: --shard-size must be a positive integer, got '-1'"),
    ("synthesize --shard-size 0", [*SYN, "--num", "4", "--shard-size", "0"],
     "error: --shard-size must be a positive integer, got '0'"),
    ("synthesize --num 0", [*SYN, "--num", "0"], "error: --num must be a positive integer, got '0'"),
    ("synthesize --seed -1", [*SYN, "--num", "4", "--seed", "-1"], "error: --seed must be an integer >= 0"),
    ("synthesize --text-dim x", [*SYN, "--num", "4", "--text-dim", "x"],
     "error: --text-dim must be an integer, got 'x'"),
    ("synthesize --mix unknown", ["synthesize", "--out", "OUT", "--num", "4", "--mix", "nope"],
     "error: --mix: invalid choice: 'nope'"),
    ("plan without --profile", ["plan", "--mix", "tiny:5", "--world-size", "2"],
     "error: the following arguments are required: --profile"),
    ("plan --world-size 0", [*PLAN, "--world-size", "0"], "error: --world-size must be a positive integer, got '0'"),
    ("plan --epoch -1", [*PLAN, "--world-size", "2", "--epoch", "-1"], "error: --epoch must be an integer >= 0"),
    ("plan --grad-accum huge", [*PLAN, "--world-size", "2", "--grad-accum", "1000000000"],
     "error: --grad-accum 1000000000 x 2 data-parallel rank(s) = 2000000000 micro-batches per step, more than the 50 "
     "samples in --mix tiny:50; give at most 25"),
    ("train --max-steps 0", ["train", "--deepspeed_config", "ds.json", "--model-config", "m.yaml", "--synthetic",
                             "--max-steps", "0"], "error: --max-steps must be a positive integer, got '0'"),
    ("train --output a file", ["train", "--deepspeed_config", "ds.json", "--model-config", "m.yaml", "--synthetic",
                               "--max-steps", "1", "--output", __file__], "error: --output must be a folder, but"),
    ("unknown command", ["trian"], "error: command: invalid choice: 'trian'"),
]


@pytest.mark.parametrize("case, argv, message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_flags_are_one_error_line(tmp_path, capsys, case, argv, message):
    from ds_adaptiveload.cli import main

    assert main([str(tmp_path / "d") if a == "OUT" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "usage:" not in err, err
    assert not (tmp_path / "d").exists()


def test_synthesize_refuses_to_overwrite_a_dataset(tmp_path, capsys):
    """A second synthesize into the same folder is refused (the old dataset is kept byte for byte) unless
    --overwrite; --out naming a file is refused too."""
    from ds_adaptiveload.cli import main

    out = tmp_path / "d"
    argv = ["synthesize", "--out", str(out), "--num", "4", "--mix", "tiny", "--text-dim", "8", "--text-len", "8"]
    assert main([*argv, "--seed", "1"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([*argv, "--seed", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: --out {out}: holds a dataset already ({out / 'manifest.jsonl'}); pass --overwrite "
                           f"to replace it, or choose another folder"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([*argv, "--seed", "2", "--overwrite"]) == 0
    assert (out / "manifest.jsonl").read_bytes() != before["manifest.jsonl"]
    capsys.readouterr()
    assert main(["synthesize", "--out", str(out / "manifest.jsonl"), "--num", "4", "--mix", "tiny"]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Two ranks: a bad input ends every rank with exit 2, one `error:` line over all ranks, no traceback


TWO_RANK_CASES = [("a bad flag, found before the process group exists", {"flags": ["--max-steps", "0"]},
                   "error: --max-steps must be a positive integer, got '0'"),
                  ("a manifest naming /etc/passwd", {"manifest": _line(5, shard="/etc/passwd")},
                   "error: {manifest}:6: sample 'tiny-0000005': shard '/etc/passwd' is outside the manifest's folder")]


@pytest.mark.slow
@pytest.mark.parametrize("case, change, message", TWO_RANK_CASES, ids=["flag", "manifest"])
def test_two_ranks_each_exit_2_with_one_error_line(tiny_run, tmp_path, case, change, message):
    """Both ranks started as the launcher starts them, so that each one's exit code is seen: both exit 2 (neither is
    killed or hangs), and the one error line is printed once (rank 0), without a traceback."""
    import subprocess
    import sys

    from tests.launcher import launcher_env, master_port

    argv = train_argv(tiny_run, change, tmp_path)
    env = launcher_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port()))
    procs = [subprocess.Popen([sys.executable, "launch/train_wan.py", *argv, "--num-workers", "0"], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(2)]
    results = []
    for p in procs:
        try:
            results.append((p.wait(timeout=300), p.stderr.read()))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            pytest.fail(f"{case}: a rank still runs after 300 s (a hang)")
    stderr = "".join(err for _, err in results)
    assert [code for code, _ in results] == [2, 2], stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    manifest = os.path.join(os.path.dirname(tiny_run["manifest"]), f"changed-{tmp_path.name}.jsonl")
    assert len(lines) == 1 and lines[0].startswith(message.format(manifest=manifest)), stderr[-3000:]
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_the_launcher_returns_2_for_a_bad_deepspeed_key(tiny_run, tmp_path):
    """Through the `deepspeed` launcher, as users run it: a misspelt top-level key is exit 2 and one line."""
    import subprocess

    from tests.launcher import DEEPSPEED, launcher_env, master_port

    if DEEPSPEED is None:
        pytest.skip("deepspeed launcher not installed")
    argv = train_argv(tiny_run, {"ds": _rename("zero_optimization", "zero_optimisation")}, tmp_path)
    proc = subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(master_port()), "launch/train_wan.py",
                           *argv, "--num-workers", "0"], cwd=ROOT, env=launcher_env(), capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == (f"error: {tmp_path / 'ds.json'}: unknown top-level key 'zero_optimisation' (did you mean "
                        f"zero_optimization?): DeepSpeed {__import__('deepspeed').__version__} does not read it, so it "
                        f"would have no effect; this project's keys live under adaptive_load"), lines
    assert "Traceback" not in proc.stderr


def test_a_key_given_twice_is_refused_in_every_config_file(tmp_path):
    """PyYAML and json keep the last of two equal keys without a word; each config reader refuses it, naming the file
    (and for YAML the line of each), in a mapping at any depth, in block or flow style."""
    from ds_adaptiveload.fileio import read_json_object
    from ds_adaptiveload.model import WanConfig

    profile = tmp_path / "p.yaml"
    profile.write_text("time_ms: {fixed: 1.0, per_token: 0.01, per_token_sq: 0.0}\nmemory:\n  budget_tokens: 1000\n"
                       "  budget_tokens: 2000\n")
    with pytest.raises(UserError, match=re.escape(f"{profile}:4: duplicate key 'budget_tokens' (first on line 3)")):
        CostProfile.load(str(profile))
    profile.write_text("time_ms: {fixed: 1.0, fixed: 2.0, per_token: 0.01, per_token_sq: 0.0}\n")
    with pytest.raises(UserError, match=re.escape(f"{profile}:1: duplicate key 'fixed' (first on line 1)")):
        CostProfile.load(str(profile))
    model = tmp_path / "m.yaml"
    model.write_text("model:\n  dim: 128\n  num_heads: 2\n  dim: 256\n")
    with pytest.raises(UserError, match=re.escape(f"{model}:4: duplicate key 'dim' (first on line 2)")):
        WanConfig.from_yaml(str(model))
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3, "stage": 0}, "adaptive_load": {"profile": "p.yaml"}}')
    with pytest.raises(UserError, match=re.escape(f"{ds}: key 'stage' is given twice in one object")):
        read_json_object(str(ds), "DeepSpeed config")
    ds.write_text('{"zero_optimization": {"stage": 3}, "adaptive_load": {"profile": "p.yaml"}}')
    assert read_json_object(str(ds), "DeepSpeed config")["zero_optimization"] == {"stage": 3}
