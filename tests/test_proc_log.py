"""SUITE_PROC_LOG: a process started with the hook on PYTHONPATH logs itself at exit, and
tests/proc_report.py sums the log."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("process accounting")


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


def test_acct_report_charges_forked_and_orphaned_processes(tmp_path):
    """tests/acct_report.py on a real SUITE_CPU_LOG (a pytest run with two tests) and accounting
    lines written to match it: a grandchild started during the second test is charged to that
    test's file; a forkserver's rank (its parent's parent is pid 1) is listed apart."""
    (tmp_path / "test_two.py").write_text(
        "import time\ndef test_a():\n    time.sleep(1.2)\ndef test_b():\n    time.sleep(1.2)\n")
    cpu_log = tmp_path / "cpu"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "tests.conftest", str(tmp_path / "test_two.py")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SUITE_CPU_LOG": str(cpu_log)})
    assert run.returncode == 0, run.stdout + run.stderr
    [tsv] = cpu_log.glob("*.tsv")  # main.tsv, or gw0.tsv when this test runs in an xdist worker
    rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    assert [r[0].rsplit("::", 1)[1] for r in rows] == ["test_a", "test_b"]
    worker = int(rows[0][5])
    b_start = float(rows[1][3]) - float(rows[1][2]) + 0.5

    def line(comm, cpu_s, pid, ppid, started):
        when = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(started))
        return (f"{comm}|v3|{cpu_s * 100:.2f}|0.00|0.00|0|0|0|0|{pid}|{ppid}| |0|__|{when}")

    acct = tmp_path / "pacct.txt"
    acct.write_text("\n".join([
        line("python", 2.0, worker, 1, b_start - 10),       # the worker itself
        line("bash", 0.5, 9001, worker, b_start),            # the test's shell
        line("python", 3.0, 9002, 9001, b_start),            # ... and what the shell forked
        line("python", 0.25, 9100, 1, b_start),              # a forkserver, orphaned at exit
        line("python", 4.0, 9101, 9100, b_start),            # ... and its rank
    ]) + "\n")
    report = subprocess.run([sys.executable, str(ROOT / "tests" / "acct_report.py"), str(acct),
                             str(cpu_log)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert out.startswith("5 processes, 10 CPU s; under a pytest worker 6, apart 4"), out
    by_file = out.split("by test file")[1].split("\n\n")[0]
    assert "     3.5  " in by_file and "test_two.py" in by_file, out  # the shell and its child
    apart = out.split("apart from the workers")[1]
    assert "     4.2  python 9100: " in apart and apart.rstrip().endswith("test_two.py::test_b"), out
