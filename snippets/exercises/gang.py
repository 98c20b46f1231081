"""Run a learner's code on several gloo processes, with a hard time limit and no leftovers.

`run_ranks(path, worker, world)` starts `world` processes, joins them in one gloo group, imports
the learner's file (by path) in each, and calls `worker(learner, rank, world, *args)`. It returns
each rank's value, or raises `Stuck` / `RankFailed` with a message the learner can act on:

- the parent watches each rank's CPU time. A deadlock is a gang in which nobody computes: when,
  for stuck_after_s seconds, no rank has used more than IDLE_SHARE of a core, and some have no
  result, the ranks are stuck. A slow rank on a busy machine still computes, and its peers wait
  for it: that is no deadlock, however long it takes (up to RUNNING_LIMIT_S, for a loop that
  never ends);
- a stuck rank is sent SIGUSR1, on which faulthandler writes where it is (its Python stack); it
  stays there;
- a rank that has finished writes its result and waits; so no rank leaves while a peer may still
  wait on it, and the peer stays stuck where it is instead of failing with "Connection closed";
- the parent then kills every process and waits for it, so none outlives the check;
- from the stacks, `Stuck` names each waiting rank, the torch.distributed call it is in, the line
  of the learner's file that made it, and the likely cause;
- a rank that raised while others wait is a `RankFailed`: its error and line first, then where
  the others were left waiting for it (never "finished", which would blame a collective).

What each rank printed is kept (per rank) and shown with a failure.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.util
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from types import ModuleType

import psutil
import torch
import torch.distributed as dist

from snippets.exercises.runner import CheckFailed, _describe
from snippets.ports import free_port

# Seconds in which no rank computes, while some have no result, before the gang is taken to be
# stuck. Read at each run: the tests of the deadlock messages lower it.
STUCK_AFTER_S = 5.0
# "Computes": more than this share of one core. A rank blocked in gloo, or finished and asleep,
# uses 0.2-0.6% (0.02-0.06 s of CPU in 10 s, mostly gloo's network thread waking every 10 ms; a
# 2-core AMD EPYC under a load of 7); a working rank on 2 cores shared by 16 processes gets
# about 12%.
IDLE_SHARE = 0.03
RUNNING_LIMIT_S = 60.0  # a rank still computing then is stopped: a loop that never ends
STARTUP_S = 30.0  # for imports and joining the group, on a slow or busy machine
GLOO_TIMEOUT_S = STARTUP_S + RUNNING_LIMIT_S + 10  # longer than ours: the watchdog reports first
_SAMPLE_S = 0.1  # how often the parent reads the ranks' CPU times
LAST_PIDS: list[int] = []  # the processes of the last run, for the test that none survives
LAST_PRINTED: list[str] = []  # what each rank of the last run printed
# Seconds from the last rank starting its worker to the parent having every result: how long
# the last run took to report a deadlock, without the start-up (imports, joining the group).
LAST_DETECTION_S: float | None = None
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


class RankFailed(Exception):
    """A rank raised; the message names the rank, the error and the learner's line."""


class Stuck(Exception):
    """Some rank did not finish in time; the message says where each one waits, and why."""


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_learner_{os.getpid()}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rank_main(rank, world, port, path, worker, args, out):
    # Until its worker starts, a rank has nothing to report on the parent's SIGUSR1 (whose
    # default would end it): its start-up has a watchdog of its own, below.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    log = open(f"{out}/rank{rank}.out", "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)  # C++ writes too: gloo's "Received data size doesn't match"
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    stack = open(f"{out}/rank{rank}.stack", "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(STARTUP_S, exit=True, file=stack)
    path = Path(path)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        learner = _load(path)
        # The watch for a deadlock starts now: a slow start (imports, a busy machine) is none.
        Path(f"{out}/rank{rank}.start").write_text(repr(time.time()))
        faulthandler.cancel_dump_traceback_later()
        # On the parent's SIGUSR1 a stuck rank writes its stack and stays where it is stuck, so
        # a peer that waits on it goes on waiting and writes its own, instead of seeing
        # "Connection closed by peer" and looking finished; the parent kills both.
        faulthandler.register(signal.SIGUSR1, file=stack)
        result = ("ok", worker(learner, rank, world, *args))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, whatever it is
        result = ("error", _describe(err, path))
        # Where it was, as faulthandler writes it: a rank whose stuck peer exited gets
        # "Connection closed by peer" in the same call; the parent then reports it as stuck.
        frames = traceback.extract_tb(err.__traceback__)
        Path(f"{out}/rank{rank}.raised").write_text("".join(
            f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in reversed(frames)))
    faulthandler.cancel_dump_traceback_later()
    # Finished: nothing of it to report. Ignored, not unregistered: SIGUSR1's default would
    # end the process if the parent's signal crossed the result on its way.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    Path(f"{out}/rank{rank}.tmp").write_bytes(pickle.dumps(result))
    os.replace(f"{out}/rank{rank}.tmp", f"{out}/rank{rank}.pkl")
    # Stay alive until the parent has every rank's result and kills us: exiting now would
    # close our connections, and a peer stuck waiting for us would see "Connection closed"
    # instead of staying where it is stuck, for the watchdog to report.
    sys.stdout.flush()
    time.sleep(RUNNING_LIMIT_S + 10)  # past the parent's deadline: never an orphan for long
    os._exit(0)


def run_ranks(path: Path, worker, world: int, *args, stuck_after_s: float | None = None):
    """worker(learner, rank, world, *args) on `world` gloo processes; their values in rank
    order. worker must be a module-level function (it is pickled by name)."""
    stuck_after_s = STUCK_AFTER_S if stuck_after_s is None else stuck_after_s
    ctx = mp.get_context("forkserver")
    # As snippets.dist.spawn: the server imports these once, and each rank is forked from it
    # in milliseconds (the first backward imports symbolic_shapes, the first optimizer
    # torch._dynamo: a second or more of CPU each, per rank, inside its time limit).
    # And every check file: a worker is pickled by name, and each rank imports its module.
    checks = Path(__file__).resolve().parent / "checks"
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "torch.fx.experimental.symbolic_shapes",
                                *(f"snippets.exercises.checks.{p.stem}"
                                  for p in sorted(checks.glob("*.py")) if p.stem != "__init__")])
    forkserver.ensure_running()  # its seconds of imports come before the port is chosen
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world, port, str(path), worker, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        LAST_PIDS[:] = [p.pid for p in procs]
        results = [Path(out, f"rank{r}.pkl") for r in range(world)]
        dumps = [Path(out, f"rank{r}.stack") for r in range(world)]
        stuck = _wait_for_results_or_idle(procs, results, out, stuck_after_s)
        if stuck:
            for f, p in zip(results, procs):
                if not f.is_file() and p.is_alive():
                    os.kill(p.pid, signal.SIGUSR1)  # faulthandler writes its stack
        # Results arrive whole (written, then renamed). A stuck rank writes its stack line by
        # line, and on a loaded machine it can wait for a core midway: read the dumps once
        # their sizes have not changed for 0.2 s.
        sizes, settle = None, time.monotonic() + 3
        while stuck and time.monotonic() < settle:
            time.sleep(0.2)
            now = [d.stat().st_size if d.is_file() else 0 for d in dumps]
            if now == sizes and all(n or f.is_file() or not p.is_alive()
                                    for n, f, p in zip(now, results, procs)):
                break
            sizes = now
        collected = time.time()
        starts = [Path(out, f"rank{r}.start") for r in range(world)]
        global LAST_DETECTION_S
        LAST_DETECTION_S = (collected - max(float(f.read_text()) for f in starts)
                            if all(f.is_file() for f in starts) else None)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        files = {kind: [Path(out, f"rank{r}.{kind}") for r in range(world)]
                 for kind in ("pkl", "out", "stack")}
        results = [pickle.loads(f.read_bytes()) if f.is_file() else None
                   for f in files["pkl"]]  # written by our own child process
        printed = [f.read_text() if f.is_file() else "" for f in files["out"]]
        stacks = [f.read_text() if f.is_file() else "" for f in files["stack"]]
        raised = [Path(out, f"rank{r}.raised") for r in range(world)]
        raised = [f.read_text() if f.is_file() else "" for f in raised]

    LAST_PRINTED[:] = printed
    shown = printed_by_rank(printed)
    crashed = [r for r, res in enumerate(results)
               if res is None and not stacks[r].strip() and codes[r] not in (0, None, -9)]
    if crashed:
        rank = crashed[0]
        last = (printed[rank].strip().splitlines() or ["(nothing)"])[-1].strip()
        cause = ""
        if "size doesn't match" in last:
            cause = ("\n  Likely cause: a send and its recv have different sizes: the two "
                     "ranks disagree on which piece travels at this step")
        raise RankFailed(f"on {world} processes, rank {rank} crashed (exit code "
                         f"{codes[rank]}) saying: {last}{cause}{shown}")
    if stuck:
        for r, res in enumerate(results):
            if stacks[r].strip():
                results[r] = None  # stuck, whatever it did after its stack was written
            elif res and res[0] == "error" and "Connection closed by peer" in res[1]:
                results[r], stacks[r] = None, raised[r]  # a peer crashed while it waited
        # A rank that raised never makes the calls its peers wait in: its error is what went
        # wrong, and their wait follows from it. Report the error, not a rank that "finished".
        failed = {r: text for r, res in enumerate(results) if (text := _raised(res))}
        if failed:
            raise RankFailed(f"{_raised_message(world, failed)}\n  Left waiting for "
                             f"{'it' if len(failed) == 1 else 'them'}:\n  "
                             + "\n  ".join(_waiting(path, results, stacks)) + shown)
        raise Stuck(_stuck_message(path, results, stacks, stuck) + shown)
    # Nobody waits: a worker's own report of what it caught goes back to its check.
    failed = {r: res[1] for r, res in enumerate(results) if res and res[0] == "error"}
    if failed:
        raise RankFailed(_raised_message(world, failed) + shown)
    if any(res is None for res in results):
        raise Stuck(_stuck_message(path, results, stacks, "some ranks never finished") + shown)
    return [res[1] for res in results]


def printed_by_rank(printed: list[str]) -> str:
    lines = [f"    rank {r}: {line}" for r, text in enumerate(printed)
             for line in text.strip().splitlines()[:5]]
    return "\n  your code printed:\n" + "\n".join(lines) if lines else ""


def run_learner(learner: ModuleType, worker, world: int, *args) -> list:
    """run_ranks on the learner's file, for a check: a failed or stuck rank is a CheckFailed."""
    try:
        return run_ranks(Path(learner.__file__), worker, world, *args)
    except (RankFailed, Stuck) as err:
        raise CheckFailed(str(err)) from None


def shows_prints(check):
    """check, with what each rank printed added to a failure judged from the ranks' values."""
    @functools.wraps(check)
    def wrapper(learner: ModuleType) -> list[str]:
        LAST_PRINTED.clear()
        try:
            return check(learner)
        except CheckFailed as err:
            if "your code printed:" in str(err):
                raise
            raise CheckFailed(str(err) + printed_by_rank(LAST_PRINTED)) from None
    return wrapper


def where_stuck(stack: str, path: Path) -> tuple[str, str]:
    """(the torch.distributed call, 'line N: code' in the learner's file) from a faulthandler
    dump of the main thread, most recent call first."""
    frames = [m for m in map(_FRAME.match, stack.splitlines()) if m]
    path = str(Path(path).resolve())
    mine = next((i for i, m in enumerate(frames) if str(Path(m["file"]).resolve()) == path), None)
    if mine is None:  # outside the learner's code: say where
        return (frames[0]["name"] if frames else ""), "not in your file"
    line = int(frames[mine]["line"])
    code = Path(path).read_text().splitlines()[line - 1].strip()
    calls = [m["name"] for m in frames[:mine]
             if "torch/distributed" in m["file"] and not m["name"].startswith("_")
             and m["name"] != "wrapper"]
    op = calls[-1] if calls else (re.findall(r"\.(\w+)\(", code) or [""])[-1]
    return op, f"line {line}: {code}"


def _raised(result) -> str | None:
    """The error a rank's learner code raised: the one that ended the worker, or the one the
    worker caught and returned under "error" (the checks do, to report it with its step)."""
    if not result:
        return None
    kind, value = result
    if kind == "error":
        return value
    caught = value.get("error") if isinstance(value, dict) else None
    return caught if isinstance(caught, str) else None


def _raised_message(world: int, failed: dict[int, str]) -> str:
    """'on W processes, rank R raised <error>', with each rank's own error and line: ranks
    that raised the same error at the same line are named together."""
    ranks_by_error: dict[str, list[int]] = {}
    for r, text in failed.items():
        ranks_by_error.setdefault(text, []).append(r)
    return f"on {world} processes, " + "\n  ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} raised {text}"
        for text, ranks in ranks_by_error.items())


def _waiting(path, results, stacks) -> list[str]:
    """'rank R is stuck in <call> (your file line N: code)' for each rank with no result."""
    lines = []
    for r in (r for r, res in enumerate(results) if res is None):
        op, where = where_stuck(stacks[r], path)
        lines.append(f"rank {r} is stuck in {op or 'your code'}"
                     + (f" ({where})" if where == "not in your file" else
                        f" (your {Path(path).name} {where})" if where else ""))
    return lines


def _wait_for_results_or_idle(procs, results, out, stuck_after_s) -> str | None:
    """Wait until every rank has a result or has exited (None), or until the ranks are stuck:
    then say how, for the report. Stuck: once every rank has started its worker, no rank has
    computed (IDLE_SHARE of a core) for stuck_after_s seconds while some have no result, or
    one still computes RUNNING_LIMIT_S after the start."""
    starts = [Path(out, f"rank{r}.start") for r in range(len(procs))]
    watched = [_CpuTime(p.pid) for p in procs]
    samples: list[tuple[float, list[float]]] = []  # (time, each rank's CPU seconds)
    began, all_started = time.monotonic(), None
    while True:
        time.sleep(_SAMPLE_S)
        now = time.monotonic()
        busy = [r for r, (f, p) in enumerate(zip(results, procs))
                if not f.is_file() and p.is_alive()]
        if not busy:
            return None
        if all_started is None:
            if all(s.is_file() for s in starts) or not all(p.is_alive() for p in procs):
                all_started = now
            elif now - began > STARTUP_S + 3:  # a rank that cannot start exits by then
                return f"not every rank had joined the group after {STARTUP_S:.0f} s"
            continue
        if now - all_started > RUNNING_LIMIT_S:
            return f"still running after {RUNNING_LIMIT_S:.0f} s"
        samples.append((now, [w.seconds() for w in watched]))
        while len(samples) > 1 and now - samples[1][0] >= stuck_after_s:
            samples.pop(0)  # the window slides: its start is the newest sample old enough
        then, cpu_then = samples[0]
        cpu_now = samples[-1][1]
        # Every rank, finished ones too: a rank that computed, finished and woke its waiting
        # peer a moment ago was progress, though the peer has not yet had a core to go on.
        if now - then >= stuck_after_s and all(
                cpu_now[r] - cpu_then[r] < IDLE_SHARE * (now - then) for r in range(len(procs))):
            return f"for {stuck_after_s:.0f} s no rank has computed"


class _CpuTime:
    """The CPU seconds of a process, every thread's (psutil); the last value once it has gone."""

    def __init__(self, pid: int):
        self.pid, self.last = pid, 0.0

    def seconds(self) -> float:
        try:
            times = psutil.Process(self.pid).cpu_times()
            self.last = times.user + times.system
        except psutil.Error:
            pass
        return self.last


def _stuck_message(path, results, stacks, how) -> str:
    done = [r for r, res in enumerate(results) if res is not None]
    ops = {where_stuck(stacks[r], path)[0] for r, res in enumerate(results) if res is None}
    if how.startswith("still running"):  # computing, not waiting
        return (f"{how}\n  " + "\n  ".join(_waiting(path, results, stacks)).replace(
            " is stuck in ", " is in ") + ".\n  Likely cause: a loop that never ends")
    head = (f"a deadlock: {how}, and these ranks are waiting\n  "
            + "\n  ".join(_waiting(path, results, stacks)))
    if done:
        cause = (f"rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} finished "
                 "while the others wait: a collective or a send/recv that only some ranks "
                 "call. Every rank must call every collective, in the same order, and every "
                 "send needs the matching recv on the peer")
    elif ops <= {"recv", "irecv", "wait"}:
        cause = ("every rank waits to receive and none is sending: a blocking dist.recv "
                 "before the send on every rank. Post the send first with dist.isend, then "
                 "recv, then wait on the send's request")
    elif ops <= {"send"}:
        cause = ("every rank is blocked sending and none is receiving: send with dist.isend, "
                 "then recv, then wait on the send's request")
    else:
        cause = ("the ranks wait for each other: check that every send has its recv on the "
                 "peer and that every rank calls the same collectives in the same order")
    return f"{head}.\n  Likely cause: {cause}"
