"""Loaded by every Python process the suite starts when SUITE_PROC_LOG=file is set (the conftest
puts this folder first on PYTHONPATH): at exit, the process appends one line to the file with
its own CPU seconds, whether it imported torch and torch._dynamo, the test that started it and
its command line. It answers what SUITE_CPU_LOG cannot: how many processes the suite starts and
how much of its CPU is only their start-up (tests/proc_report.py sums the file).

A process that ends in os._exit (multiprocessing's forked workers, a watchdog) is not counted.
"""

import atexit
import os
import sys
import time


def _write(path: str, started: float) -> None:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
    command = " ".join(sys.argv).replace("\t", " ").replace("\n", " ")[:300]
    with open(path, "a") as log:
        log.write(f"{os.getpid()}\t{own.ru_utime + own.ru_stime:.2f}\t{time.time() - started:.2f}\t"
                  f"{int('torch' in sys.modules)}\t{int('torch._dynamo' in sys.modules)}\t"
                  f"{test}\t{command}\n")


def _load_the_one_this_shadows() -> None:
    """Being first on PYTHONPATH hides the interpreter's own sitecustomize (Debian and Ubuntu
    ship one): run it too, so logging changes nothing else."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("SUITE_PROC_LOG"):
    atexit.register(_write, os.environ["SUITE_PROC_LOG"], time.time())
_load_the_one_this_shadows()
