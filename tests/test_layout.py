"""The package layout: modules moved into schedule/ and data/ still import under their old paths, as the
same module objects, and the scheduler subpackage stays torch-free."""
import importlib
import subprocess
import sys

from ds_adaptiveload import _moved


def test_old_paths_are_the_moved_modules():
    for old, new in _moved.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_old_from_import_works():
    from ds_adaptiveload.planner import make_plan
    from ds_adaptiveload.schedule.planner import make_plan as moved

    assert make_plan is moved


def test_schedule_imports_without_torch():
    code = ("import sys, ds_adaptiveload.schedule.planner, ds_adaptiveload.schedule.sampler, "
            "ds_adaptiveload.schedule.profile, ds_adaptiveload.schedule.manifest, ds_adaptiveload.schedule.mixes; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]; "
            "sys.exit(f'imported {bad[:3]}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)
