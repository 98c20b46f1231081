"""Command-line checks shared by the training scripts: every number is range-checked when the
command line is parsed, and a bad flag is one line naming the flag and what it accepts.

    p = Parser(description="...")
    p.add_argument("--steps", type=int_at_least(1), default=30)

    $ python script.py --steps 0
    script.py: error: argument --steps: must be a whole number >= 1, got 0

Under torchrun the same line also ends torchrun's failure summary, the last thing on screen.

One flag vocabulary: a concept the trainers share (--max-steps, --batch-size, --seq-len, ...)
is added with Parser.add_flag, which spells it with dashes and also accepts the underscore
spelling (and any older name), so every command already printed keeps working:

    p.add_flag("max-steps", "--steps", type=int_at_least(1), default=30)  # dest: max_steps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


# --8<-- [start:parser]
class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`--help` still shows the usage)."""

    def error(self, message: str):
        line = f"{self.prog}: error: {message}"
        write_torchrun_error_file(line)
        self.exit(2, line + "\n")

    # --8<-- [start:add-flag]
    def add_flag(self, name: str, *aliases: str, **kwargs) -> argparse.Action:
        """Add the flag --NAME, spelt with dashes (argparse's convention, and torchrun's newer
        flags'), that also accepts the underscore spelling and ``aliases`` (a concept's older
        name, e.g. --steps for --max-steps). ``dest`` is NAME with underscores unless given.
        --help, the usage line and every error name only the dashed spelling."""
        words = name.removeprefix("--").replace("_", "-")
        spellings = dict.fromkeys([f"--{words}", "--" + words.replace("-", "_"), *aliases])
        kwargs.setdefault("dest", words.replace("-", "_"))
        action = self.add_argument(*spellings, **kwargs)
        # The parser matches a command line against its own table of every spelling added
        # above; the action's list is only what help, usage and error messages print.
        action.option_strings = [f"--{words}"]
        return action
    # --8<-- [end:add-flag]


def write_torchrun_error_file(line: str) -> None:
    """Under torchrun, put `line` where torchrun's summary will show it: at the end.

    A worker cannot print after torchrun: the agent prints its ChildFailedError traceback and
    summary once the workers have exited, and the summary ends with the first failure's Root
    Cause. The agent fills that from the file it names in TORCHELASTIC_ERROR_FILE, and shows
    `error_file: <N/A>` and a link to the docs where a worker wrote none (an argparse exit
    writes none). So the line goes into that file, laid out as torch's own
    ErrorHandler.record_exception lays it out (torch/distributed/elastic/multiprocessing/
    errors/error_handler.py), with the line where it puts a traceback: the summary prints it.
    Re-printing the line after the summary would take a wrapper around torchrun, a command
    other than the one learners type and a cluster's batch script runs.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:  # not under torchrun
        return
    error = {"message": {"message": line, "extraInfo": {
        "py_callstack": line, "timestamp": str(int(time.time()))}}}
    # Whole or not at all: when another rank fails first, the agent SIGTERMs this one at any
    # moment, and a half-written file would make the agent itself fail to parse it.
    with open(f"{path}.partial", "w") as f:
        json.dump(error, f)
    os.replace(f"{path}.partial", path)
# --8<-- [end:parser]


def error_exit(err: Exception | str) -> int:
    """A trainer's input error after parsing (a layout that does not fit the world, a run
    that exists): one line on stderr, and under torchrun the same line at the end of its
    summary. Returns the exit status, 2, as argparse's own errors."""
    line = f"error: {err}"
    print(line, file=sys.stderr, flush=True)
    write_torchrun_error_file(line)
    return 2


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
