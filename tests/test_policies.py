"""The policy registry is the one list of policy names, and the scheduler's modules import without cycles or torch."""
import ast
import os
import subprocess
import sys
from typing import get_args

import pytest

import ds_adaptiveload.schedule as schedule
from ds_adaptiveload.data import report
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.schedule.planner import PlanConfig, make_plan
from ds_adaptiveload.schedule.policies import POLICIES, REGISTRY, Policy, buckets
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.train.config import AdaptiveLoadConfig

SCHEDULE = os.path.dirname(schedule.__file__)


def schedule_modules() -> dict:
    """Dotted module name -> parsed source, for every module of ds_adaptiveload.schedule."""
    out = {}
    for folder, _, files in os.walk(SCHEDULE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(os.path.dirname(SCHEDULE)))[:-3].replace(os.sep, ".")
                with open(path) as fh:
                    out[rel.removesuffix(".__init__")] = ast.parse(fh.read(), path)
    return out


def imported(tree) -> list:
    """(module, lineno, at top level) of every ds_adaptiveload import in the tree."""
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ds_adaptiveload"):
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(n, node.lineno, id(node) in top) for n in [node.module] + names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names if a.name.startswith("ds_adaptiveload")]
    return out


def test_the_scheduler_has_no_hidden_or_circular_imports():
    mods = schedule_modules()
    assert {"ds_adaptiveload.schedule.policies", "ds_adaptiveload.schedule.policies.common"} <= set(mods)
    graph = {}
    for name, tree in mods.items():
        deps = imported(tree)
        late = [(m, line) for m, line, top in deps if not top]
        assert not late, f"{name} imports inside a function (a hidden cycle?): {late}"
        graph[name] = {m for m, _, _ in deps if m in mods and m != name}
        if ".policies" in name:
            assert not {m for m in graph[name] if m.endswith((".planner", ".sampler"))}, f"{name} imports the planner"
    state = {}

    def visit(n, path):
        assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [n])}"
        if n not in state:
            state[n] = "open"
            for m in sorted(graph[n]):
                visit(m, path + [n])
            state[n] = "done"
    for n in sorted(graph):
        visit(n, [])


def test_every_scheduler_module_imports_alone_without_torch():
    """Each module imported first, in a fresh table of modules: a cycle shows as a partly initialised import."""
    names = sorted(schedule_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    for m in [m for m in sys.modules if m.startswith('ds_adaptiveload')]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            "    bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]\n"
            "    assert not bad, (name, bad[:3])\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_list_of_policy_names_is_the_registry():
    assert POLICIES == tuple(REGISTRY) and "packed" in POLICIES
    assert set(get_args(AdaptiveLoadConfig.model_fields["policy"].annotation)) == set(POLICIES)
    assert sorted(report.POLICIES) == sorted(POLICIES)
    with pytest.raises(UserError, match="policy must be one of balanced, dual, equal-tokens, packed, got 'lpt'"):
        PlanConfig("lpt")


def test_a_registry_line_makes_a_policy(monkeypatch):
    """A new policy is a steps function and one REGISTRY line: PlanConfig accepts it and make_plan plans with it."""
    calls = []

    def reversed_buckets(keep, ctx, rng):
        calls.append(len(keep))
        return [step[::-1] for step in buckets.bucket_steps(keep, ctx, rng)]

    monkeypatch.setitem(REGISTRY, "reversed", Policy(reversed_buckets))
    samples = [Sample(f"s{i}", *sh) for i, sh in enumerate([(1, 64, 64), (5, 64, 64), (9, 64, 96)] * 20)]
    profile = CostProfile(fixed_ms=5.0, per_token_ms=0.01, per_token_sq_ms=1e-6, budget_tokens=300)
    ours = make_plan(samples, profile, PlanConfig("reversed", world_size=2, grad_accum=2))
    base = make_plan(samples, profile, PlanConfig("equal-tokens", world_size=2, grad_accum=2))
    assert calls == [len(samples)] and ours.config.policy == "reversed"
    assert sorted(i for step in ours.steps for mbs in step for mb in mbs for i in mb) == list(range(len(samples)))
    assert len(ours.steps) == len(base.steps) > 2  # the rows of every step but the epoch's tail swapped
    assert ours.steps[:-1] == [step[::-1] for step in base.steps[:-1]] != base.steps[:-1]
