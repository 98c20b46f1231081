"""Importing `snippets` makes each printed line one write (snippets/__init__.py), so the lines of
ranks that share a terminal or a log file never run together. CI once read two ranks' error
lines as one (accelerate.md's trap block): under PYTHONUNBUFFERED=1, print() writes the text
and its newline in two system calls, and another rank's line can land between them."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("how printed lines reach a shared stream")

LINES, WIDTH = 3000, 150
PRINTER = ("import os, sys, time\n"
           "if sys.argv[2] == 'course':\n"
           "    import snippets\n"
           "while not os.path.exists(sys.argv[4]):\n"  # both start printing at the same moment
           "    time.sleep(0.001)\n"
           f"for i in range({LINES}):\n"
           f"    print(f'{{sys.argv[1]}} {{i}} ' + 'x' * {WIDTH}, file=getattr(sys, sys.argv[3]))\n")


def broken_lines(tmp_path, imports: str, stream: str, unbuffered: bool) -> int:
    """Two processes print LINES lines each, at once, into one open file (as a launcher's ranks
    write into its log); the number of lines that came out broken or merged."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=str(ROOT), **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    log, go = tmp_path / "shared.log", tmp_path / "go"
    with open(log, "w") as shared:  # one open file, one offset: what `cmd > log` gives N ranks
        procs = [subprocess.Popen([sys.executable, "-c", PRINTER, tag, imports, stream, str(go)],
                                  stdout=shared, stderr=shared, env=env) for tag in "AB"]
        time.sleep(0.5)
        go.touch()
        assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = log.read_text().splitlines()
    whole = re.compile(rf"[AB] \d+ x{{{WIDTH}}}")
    return sum(not whole.fullmatch(line) for line in lines) + abs(len(lines) - 2 * LINES)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
def test_two_processes_printing_into_one_log_keep_their_lines_whole(tmp_path, stream, unbuffered):
    assert broken_lines(tmp_path, "course", stream, unbuffered) == 0



def test_the_interpreters_own_streams_are_line_buffered():
    """The mechanism, checked directly, since the race above is not certain to show in one run
    (without the package, 2,446 of the 6,000 lines broke here under PYTHONUNBUFFERED=1, and
    1,608 with stdout block-buffered into the file)."""
    probe = ("import sys, snippets; print(*(getattr(s, a) for s in (sys.stdout, sys.stderr) "
             "for a in ('line_buffering', 'write_through')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.split() == ["True", "False", "True", "False"]
