"""The package's public names: `ds_adaptiveload.__all__` resolves, and the scheduler stays torch-free."""
import subprocess
import sys

import ds_adaptiveload

NO_TORCH = ("bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]; "
            "sys.exit(f'imported {bad[:3]}' if bad else 0)")


def test_every_public_name_resolves():
    assert 10 <= len(ds_adaptiveload.__all__) <= 20
    for name in ds_adaptiveload.__all__:
        assert getattr(ds_adaptiveload, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    try:
        ds_adaptiveload.planner  # an old path, removed before the first release
    except AttributeError as e:
        assert "planner" in str(e)
    else:
        raise AssertionError("ds_adaptiveload.planner resolved")


def test_make_plan_does_not_import_torch():
    code = ("import sys, ds_adaptiveload; ds_adaptiveload.make_plan; ds_adaptiveload.PlanConfig; "
            "ds_adaptiveload.CostProfile; ds_adaptiveload.load_manifest; ds_adaptiveload.AdaptiveSampler; " + NO_TORCH)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_schedule_imports_without_torch():
    code = ("import sys, ds_adaptiveload.schedule.planner, ds_adaptiveload.schedule.sampler, "
            "ds_adaptiveload.schedule.profile, ds_adaptiveload.schedule.manifest, ds_adaptiveload.schedule.mixes; "
            + NO_TORCH)
    subprocess.run([sys.executable, "-c", code], check=True)
