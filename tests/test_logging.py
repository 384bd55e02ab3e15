"""Logging of the commands (ds_adaptiveload/log.py): info to stdout on rank 0, warnings to stderr, --log-level."""
import json
import logging

import pytest

from ds_adaptiveload import log
from ds_adaptiveload.cli import main

NOTE = "memory moved from ZeRO-2 on 1 rank(s) to this run's ZeRO-2 on 8"  # plan's info line for this profile
PLAN = ["plan", "--profile", "h100-wan1.3b-zero2", "--mix", "video-heavy:50", "--world-size", "8", "--json"]


@pytest.fixture(autouse=True)
def fresh_logger(monkeypatch):
    """Each test starts as a new process would: no RANK, the package logger not set up; and leaves it so."""
    monkeypatch.delenv("RANK", raising=False)
    yield
    logger = logging.getLogger(log.PACKAGE)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def test_rank_0_logs_info_to_stdout_before_the_primary_output(capsys):
    assert main(PLAN) == 0
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()
    assert any(NOTE in line for line in lines[:-1]) and json.loads(lines[-1])["samples_planned"] == 50
    assert cap.err == ""


def test_log_level_warning_silences_info(capsys):
    assert main([*PLAN, "--log-level", "warning"]) == 0
    cap = capsys.readouterr()
    assert NOTE not in cap.out + cap.err
    assert json.loads(cap.out.strip().splitlines()[-1])["samples_planned"] == 50  # the command's output stays


def test_other_ranks_log_warnings_only_unless_told(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(PLAN) == 0
    assert NOTE not in capsys.readouterr().out
    assert main([*PLAN, "--log-level", "info"]) == 0
    assert NOTE in capsys.readouterr().out


def test_warnings_go_to_stderr_and_debug_needs_the_flag(capsys):
    log.configure()
    logger = logging.getLogger("ds_adaptiveload.train.setup")
    logger.warning("[train_wan] warning: w")
    logger.debug("d")
    cap = capsys.readouterr()
    assert cap.err == "[train_wan] warning: w\n" and cap.out == ""
    log.configure("debug", rank=3)  # configured again: one handler, not two
    logger.debug("d")
    assert capsys.readouterr().out == "d\n"


def test_a_bad_level_is_one_error_line(capsys):
    assert main([*PLAN, "--log-level", "loud"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --log-level") and "'loud'" in err and "debug" in err and err.count("\n") == 1
