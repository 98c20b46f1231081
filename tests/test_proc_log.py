"""SUITE_PROC_LOG: a process started with the hook on PYTHONPATH logs itself at exit, and
tests/proc_report.py sums the log."""

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_a_process_logs_itself_and_the_report_counts_it(tmp_path):
    log, other = tmp_path / "procs.tsv", tmp_path / "other"
    other.mkdir()  # the interpreter's own sitecustomize, which the hook shadows, still runs
    (other / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {**os.environ, "SUITE_PROC_LOG": str(log), "PYTEST_CURRENT_TEST": "t.py::x (call)",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "proclog"), str(other)])}
    for code in ("import json", "import json; raise SystemExit(3)"):
        subprocess.run([sys.executable, "-c", code], env=env, check=False, timeout=60)
    lines = log.read_text().splitlines()
    assert len(lines) == 2  # a normal exit and a SystemExit both log
    assert (tmp_path / "ran").exists()
    fields = lines[0].split("\t")
    assert fields[3:6] == ["0", "0", "t.py::x"] and fields[6] == "-c"  # no torch imported
    report = subprocess.run([sys.executable, str(ROOT / "tests" / "proc_report.py"), str(log)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("2 processes,") and "0 imported torch" in report.stdout
    assert "        2     0" in report.stdout and "t.py::x" in report.stdout
