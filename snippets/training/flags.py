"""Command-line checks shared by the training scripts: every number is range-checked when the
command line is parsed, and a bad flag is one line naming the flag and what it accepts.

    p = Parser(description="...")
    p.add_argument("--steps", type=int_at_least(1), default=30)

    $ python script.py --steps 0
    script.py: error: argument --steps: must be a whole number >= 1, got 0
"""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`--help` still shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def checked(convert, ok, wanted: str):
    """An argparse type: ``convert(text)``, refused unless ``ok(value)``; ``wanted`` says what
    is accepted, in the error message."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):  # `not ok` also refuses nan
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value
    parse.__name__ = wanted  # argparse names the type in some messages
    return parse


def int_at_least(low: int):
    return checked(int, lambda v: v >= low, f"a whole number >= {low}")


def float_at_least(low: float):
    return checked(float, lambda v: v >= low, f"a number >= {low}")


positive_float = checked(float, lambda v: v > 0, "a number > 0")
fraction = checked(float, lambda v: 0 < v < 1, "a number between 0 and 1 (exclusive)")
