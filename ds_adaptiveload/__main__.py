"""`python -m ds_adaptiveload <command>` (cli.py). A command that ran under torch.distributed (calibrate or encode on
several ranks) ends as train_wan does: its group destroyed, then failures.leave, because a rank's interpreter
teardown now and then aborted after a finished run ("terminate called without an active exception", exit -6: the
2-rank calibrate test, 2026-12-01). Commands that never imported torch.distributed (plan) exit as usual."""
import sys

from ds_adaptiveload.cli import main

code = main()
if "torch.distributed" in sys.modules:
    from ds_adaptiveload.train.failures import leave, teardown

    teardown()
    leave(code)
raise SystemExit(code)
