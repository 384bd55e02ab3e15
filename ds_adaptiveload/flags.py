"""Command-line flags: value types that refuse a bad value while parsing, and a parser whose errors are one line."""
import argparse
import math
import os

from ds_adaptiveload.errors import UserError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UserError ("--max-steps must be a positive integer, got '0'") instead of
    printing usage and exiting: the caller prints one `error:` line and exits 2, and a multi-rank run agrees on it
    first (launch/train_wan.py), so that every rank ends the same way. Subparsers are of this class too."""

    def error(self, message):
        raise UserError(flag_message(message))


def flag_message(message: str) -> str:
    """argparse's "argument --max-steps: must be ..." as "--max-steps must be ..."; other messages as they are."""
    if message.startswith("argument "):
        flag, _, rest = message[len("argument "):].partition(": ")
        flag = flag.split("/")[-1]  # "-o/--output" names the long form
        return f"{flag} {rest}" if rest.startswith("must ") else f"{flag}: {rest}"
    return message


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def folder(text: str) -> str:
    """A folder to write into: it may not exist yet, but it may not be a file (found while parsing, not after the
    model is built)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"must be a folder, but {text} is a file")
    return text
