"""Errors name real options: every flag and config key that a UserError message of the trainer (`python -m
ds_adaptiveload train`, launch/train_wan.py) or of `plan` names exists in that command's parser, the adaptive_load
schema or the cost profile's schema."""
import argparse
import ast
import glob
import os
import re

import pytest

from ds_adaptiveload import plan_cli, train_cli
from ds_adaptiveload.schedule import profile as profile_mod
from ds_adaptiveload.train.config import AdaptiveLoadConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ds_adaptiveload")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)|\b((?:adaptive_load|memory|time_ms|geometry|dual)\.[a-z_]+)")
# The modules whose UserErrors each command can print, and which parsers their flags must be in.
TRAIN = ["train_cli.py", "loop.py", "shipped.py", "train/*.py"]
PLAN = ["plan_cli.py"]
BOTH = ["schedule/*.py"]  # the planner and the profile: reached from both commands


def flags(add_arguments) -> set:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return {s for a in p._actions for s in a.option_strings}


def other_command(before):
    """The command a message names in backticks before a flag ("... `encode` ... --out"): the flag is that command's.
    None where it names none (or only these two)."""
    import importlib

    from ds_adaptiveload.cli import COMMANDS

    named = [c for c in re.findall(r"`(?:python -m ds_adaptiveload )?([a-z]+)`", before) if c in COMMANDS]
    if not named or named[-1] in ("train", "plan"):
        return None
    return named[-1], flags(importlib.import_module(COMMANDS[named[-1]][0]).add_arguments)


def messages(patterns):
    """(file, line, text) of each UserError(...) call in the files: its string parts joined (an f-string's
    placeholders left out, so only literal option names are checked)."""
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(PKG, pattern))):
            for node in ast.walk(ast.parse(open(path).read())):
                func = getattr(node, "func", None)
                if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "UserError":
                    text = "".join(c.value for c in ast.walk(node)
                                   if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    yield os.path.relpath(path, ROOT), node.lineno, text


def named(patterns):
    """(where, the text before the option, the option) of every option the messages name."""
    return [(f"{f}:{line}", text[:m.start()], m.group(0)) for f, line, text in messages(patterns)
            for m in OPTION.finditer(text)]


def known_key(key) -> bool:
    section, _, name = key.partition(".")
    if section == "adaptive_load":
        return name in AdaptiveLoadConfig.model_fields
    return name in (profile_mod._SCHEMA.get(section) or ())


def test_the_collector_sees_the_messages_it_checks():
    """A test that finds nothing checks nothing: the messages of today name these options."""
    got = {opt for _, _, opt in named(TRAIN + PLAN + BOTH)}
    assert {"--deepspeed_config", "--resume", "--dump", "--device-memory-gib", "--on-oversize",
            "adaptive_load.on_oversize", "adaptive_load.on_oom", "memory.budget_tokens"} <= got


@pytest.mark.parametrize("patterns, commands", [(TRAIN, "train"), (PLAN, "plan"), (BOTH, "both")])
def test_every_option_an_error_names_exists_where_it_is_printed(patterns, commands):
    parsers = {"train": flags(train_cli.add_arguments), "plan": flags(plan_cli.add_arguments)}
    bad = []
    for where, before, opt in named(patterns):
        if not opt.startswith("--"):
            if not known_key(opt):
                bad.append(f"{where}: {opt} is no adaptive_load or profile key")
            continue
        other = other_command(before)
        if other is not None:  # e.g. "(re-run `encode` on this --out)"
            bad += [] if opt in other[1] else [f"{where}: {opt} is not a flag of {other[0]}"]
            continue
        # a shared module names a flag of one command only after "plan: " (e.g. "(plan: --on-oversize skip)")
        need = ["plan"] if commands == "plan" or before.endswith("plan: ") else \
            ["train"] if commands == "train" else ["train", "plan"]
        bad += [f"{where}: {opt} is not a flag of {c}" for c in need if opt not in parsers[c]]
    assert not bad, "\n".join(bad)


def test_the_oversize_error_names_the_key_and_the_plan_flag():
    from ds_adaptiveload.errors import UserError
    from ds_adaptiveload.schedule.manifest import Sample
    from ds_adaptiveload.schedule.planner import PlanConfig, make_plan

    prof = profile_mod.CostProfile.load(os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml"))
    with pytest.raises(UserError, match=r'set adaptive_load.on_oversize to "skip" \(plan: --on-oversize skip\)'):
        make_plan([Sample("huge", 401, 1024, 1024, {})], prof, PlanConfig())
