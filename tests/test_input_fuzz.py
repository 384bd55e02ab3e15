"""Bad input files give a UserError naming file and line (or the YAML key), never a traceback: the
manifest and profile loaders fuzzed with arbitrary bytes and arbitrary JSON / YAML values for each field
(hypothesis), plus the cases of issue #16 item 6 and `plan --dump` into a folder."""
import json
import math
import os

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
