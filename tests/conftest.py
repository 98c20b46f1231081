"""Shared fixtures: the built site (built once per test session) and free loopback ports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from snippets.ports import free_port  # noqa: F401 (the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]


def mkdocs(*args, cwd=ROOT, timeout=600, **env) -> subprocess.CompletedProcess:
    """Run mkdocs with this interpreter; without the lesson cache unless the caller passes one (a
    test must see fresh output)."""
    full_env = {**os.environ, "LESSON_CACHE": "false", "NO_MKDOCS_2_WARNING": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def lesson_cache(tmp_path_factory, worker_id) -> Path:
    """A lesson cache that starts empty in every test run: the one site build executes every
    lesson (fresh output, as CI needs) and fills it; `mkdocs serve` then reuses those lessons."""
    base = tmp_path_factory.getbasetemp()
    return (base if worker_id == "master" else base.parent) / "lesson-cache"


@pytest.fixture(scope="session")
def built_site(tmp_path_factory, worker_id, lesson_cache) -> Path:
    """`mkdocs build --strict` of the real site, executing every lesson: once per test run, shared
    by the pytest-xdist workers (the first to need it builds; the others wait on the lock)."""
    shared = lesson_cache.parent
    site, failed = shared / "site", shared / "site-build-failed.txt"
    with FileLock(str(shared / "site.lock")):
        if not failed.exists() and not (site / "index.html").exists():
            result = mkdocs("build", "--strict", "--site-dir", str(site), LESSON_CACHE="true",
                            LESSON_CACHE_DIR=str(lesson_cache))
            if result.returncode != 0:
                failed.write_text(f"{result.stdout}\n{result.stderr}")
        if failed.exists():
            pytest.fail(f"mkdocs build --strict failed:\n{failed.read_text()}")
    return site


@pytest.fixture
def one_thread():
    """One intra-op thread for the test's own process: with small tensors on 2 shared cores, a
    second OpenMP thread mostly spins waiting for a core (measured 100x slower under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def pytest_configure(config):
    """With SUITE_PROC_LOG=file, every Python process started from here on (the workers, the
    blocks, their launchers and ranks) loads tests/proclog/sitecustomize.py and logs itself at
    exit; tests/proc_report.py sums the file."""
    if os.environ.get("SUITE_PROC_LOG") and not hasattr(config, "workerinput"):
        hook = str(ROOT / "tests" / "proclog")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (hook, os.environ.get("PYTHONPATH")) if p)


def pytest_collection_modifyitems(items):
    """Longest files first, so the last minutes are not one long file on one worker
    (tests/schedule.py; `make test` passes --no-loadscope-reorder to keep this order)."""
    from tests.schedule import longest_first

    longest_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With SUITE_CPU_LOG=dir, each worker appends every test's CPU seconds (its own and its
    finished child processes') and wall seconds to dir/<worker>.tsv: where the suite's CPU goes,
    which the wall-clock durations of a parallel run do not show. The child count misses
    processes nobody waits for (multiprocessing's forkserver and its workers), so a fifth column
    adds the whole machine's busy CPU seconds over the test, from /proc/stat: exact in a serial
    run (TEST_WORKERS=0) on an otherwise idle machine; in a parallel one it means nothing per test,
    but one worker's tests cover the whole run, so their sum is the run's busy CPU. The sixth is
    the worker's pid: tests/acct_report.py charges each process the kernel accounted to its test."""
    folder = os.environ.get("SUITE_CPU_LOG")
    if not folder:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, kids = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    def machine_busy() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # not idle, not iowait

    start_cpu, start_wall, start_busy = cpu(), time.monotonic(), machine_busy()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{worker}.tsv", "a") as log:
        log.write(f"{item.nodeid}\t{cpu() - start_cpu:.2f}\t{time.monotonic() - start_wall:.2f}\t"
                  f"{time.time():.1f}\t{machine_busy() - start_busy:.2f}\t{os.getpid()}\n")
