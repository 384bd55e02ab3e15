"""Logging for the commands: the package's loggers write through one handler, set up once per command."""
import logging
import os
import sys

LEVELS = ("debug", "info", "warning", "error")
PACKAGE = "ds_adaptiveload"


class _Console(logging.Handler):
    """Progress (info, debug) to stdout, warnings and errors to stderr, as the trainer and DeepSpeed's own logger
    write them. The streams are looked up per record, so a redirected or captured sys.stdout gets the lines."""

    def emit(self, record):
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def add_argument(parser) -> None:
    """--log-level: one level for every rank; without it rank 0 logs info, the other ranks warnings."""
    parser.add_argument("--log-level", choices=LEVELS, default=None,
                        help="log level on every rank (default: info on rank 0, warning on the others); the command's "
                             "own output and its `error:` line are printed at any level")


def configure(level=None, rank=None) -> None:
    """Set up the package's logger once for a command; calling it again replaces the earlier setup. `rank` defaults
    to the launcher's RANK (0 outside a launcher)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    level = level or ("info" if rank == 0 else "warning")
    logger = logging.getLogger(PACKAGE)
    for h in [h for h in logger.handlers if isinstance(h, _Console)]:
        logger.removeHandler(h)
    handler = _Console()
    handler.setFormatter(logging.Formatter("%(message)s"))  # messages carry their own [train_wan] / warning: prefix
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # a root handler an application set up would print every line twice
