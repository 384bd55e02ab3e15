"""Old import paths of modules that moved into ds_adaptiveload.schedule / ds_adaptiveload.data (2026-12-01).

`import ds_adaptiveload.planner` keeps working for users' code: a meta-path finder answers the old name
with the module at its new home (the same module object, so monkeypatching either name patches both).
No module file stays at the old path, so nothing can drift from the real one."""
import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    **{f"ds_adaptiveload.{m}": f"ds_adaptiveload.schedule.{m}"
       for m in ("geometry", "manifest", "profile", "planner", "sampler", "mixes")},
    "ds_adaptiveload.train.data": "ds_adaptiveload.data.latents",
    "ds_adaptiveload.dataset": "ds_adaptiveload.data",
    "ds_adaptiveload.dataset.scan": "ds_adaptiveload.data.scan",
    "ds_adaptiveload.dataset.report": "ds_adaptiveload.data.report",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass  # already executed under its new name


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # first: an aliased package's __path__ would load copies
