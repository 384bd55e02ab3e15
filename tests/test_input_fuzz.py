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

AL_KEYS = ["profile", "policy", "seed", "on_oversize", "window", "fill", "replicate", "pack_tokens", "on_bad_sample",
           "on_oom", "loss_weighting", "lr_scaling_method", "lr_reference_batch_size", "other"]


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
