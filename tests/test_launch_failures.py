"""What a learner sees when a multi-process job goes wrong, and that nothing is left behind.

- Under torchrun, the course's one-line error comes first, once per failing rank, and torchrun's
  summary names the real cause (the worker wrote it to TORCHELASTIC_ERROR_FILE), last on screen:
  a bad flag's line itself, an exception's traceback ending in the error.
- A rank killed with SIGKILL prints nothing: every error line is a survivor's ("Connection reset
  by peer"), and torchrun's summary names the killed rank by its signal.
- A port already in use fails the node that would host the store at once, in one line.
- A node whose peer never comes fails within the --timeout it was given (not 2 x timeout plus a
  back-off, TCPStore's own connect loop), and says where its output is.
- No worker outlives its launcher, however the launcher ends.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("what a failing launch prints, and that nothing is left running")

LAUNCHER = [sys.executable, "-m", "snippets.cluster.fake_multi_node_launcher"]
TRAIN = "snippets/cluster/multi_node_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def processes_matching(marker: str) -> list[str]:
    """Command lines of live processes that contain marker (a path unique to one test)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except OSError:  # it exited while we looked
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline}")
    return found


def assert_none_left(marker: str, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := processes_matching(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"orphaned processes: {left}"


# --8<-- [start:first-line]
def test_under_torchrun_the_course_error_comes_first_and_names_the_rank(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", TRAIN,
         "--steps", "1", "--config", "nope", "--ckpt", str(tmp_path / "ckpt.pt")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert lines[0] == ("error: rank 0: ConfigError: unknown config 'nope'; use one of tiny, "
                        "small, medium, gpt2-small or a path to a .json file"), result.stderr
    assert result.stderr.count("error: rank 0:") == 1  # once, not once per traceback
    # torchrun's summary shows the worker's own traceback, read from its error file.
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert "error_file: <N/A>" not in root_cause, root_cause
    assert "ConfigError: unknown config 'nope'" in root_cause, root_cause
    # ... whose last line, the error, is the last on screen before the summary's closing rule.
    assert lines[-1] == "=" * 60, result.stderr
    assert lines[-2].endswith("ConfigError: unknown config 'nope'; use one of tiny, small, "
                              "medium, gpt2-small or a path to a .json file"), result.stderr
# --8<-- [end:first-line]


# --8<-- [start:bad-flag]
def test_under_torchrun_a_bad_flag_is_the_last_line_on_screen(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", TRAIN,
         "--max-steps", "0", "--ckpt", str(tmp_path / "ckpt.pt")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    flag = ("multi_node_train.py: error: argument --max-steps: '0' is not a whole number of "
            "at least 1")
    assert lines[0] == flag, result.stderr  # a worker's own line, before torchrun's
    # Last on screen: torchrun's summary ends with the Root Cause, the line itself, and a rule.
    assert lines[-1] == "=" * 60, result.stderr
    assert lines[-2] == f"  traceback : {flag}", result.stderr
# --8<-- [end:bad-flag]


def worker_pid(marker: str, rank: int) -> int:
    """The live process whose command line contains marker and whose RANK is rank."""
    for line in processes_matching(marker):
        pid = int(line.split(":")[0])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} among {processes_matching(marker)}")


# --8<-- [start:killed-rank]
def test_a_killed_rank_prints_nothing_and_torchruns_summary_names_its_signal(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")  # unique to this test: finds its processes
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", TRAIN,
         "--steps", "100000", "--timeout", "20", "--ckpt", ckpt],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    # Bounds every read below: a job that never reaches step 2 is ended, and the test fails.
    guard = threading.Timer(180, os.killpg, (torchrun.pid, signal.SIGKILL))
    guard.start()
    try:
        screen = []
        for line in torchrun.stdout:
            screen.append(line)
            if line.startswith("step 2 |"):
                break
        killed = worker_pid(ckpt, rank=1)
        os.kill(killed, signal.SIGKILL)  # as the out-of-memory killer would
        screen.append(torchrun.stdout.read())
        assert torchrun.wait() == 1, "".join(screen)
    finally:
        guard.cancel()
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    screen = "".join(screen)
    errors = [l for l in screen.splitlines() if l.startswith("error: ")]
    # Every error line is a survivor's: rank 1 never ran again to print one.
    assert errors and all(l.startswith("error: rank 0: ") for l in errors), screen
    assert re.search(r"Connection (reset|closed) by peer", errors[0]), screen
    # torchrun's summary names the killed rank by its signal, under Failures or Root Cause.
    assert (f"  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: {killed})  (SIGKILL)\n"
            f"  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID {killed}\n"
            ) in screen, screen
    assert_none_left(ckpt)
# --8<-- [end:killed-rank]


def test_torchrun_checks_its_workers_every_tenth_of_a_second():
    """Lab 3 contrasts --monitor-interval 2 with torchrun's default, 0.1 s."""
    from torch.distributed.run import get_args_parser

    assert get_args_parser().parse_args(["train.py"]).monitor_interval == 0.1


# --8<-- [start:no-hangs]
def test_a_busy_port_fails_node_0_at_once_and_node_1_within_its_timeout(tmp_path):
    with socket.socket() as other_program:  # holds the port, never answers
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
        port = other_program.getsockname()[1]
        ckpt = str(tmp_path / "ckpt.pt")  # unique to this test: finds its processes
        job = ["--nnodes", "2", "--nproc-per-node", "1", "--master-port", str(port), TRAIN,
               "--timeout", "5", "--ckpt", ckpt]

        node0 = subprocess.run([*LAUNCHER, "--node-rank", "0", *job], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=60)
        assert node0.returncode == 2
        assert node0.stdout == ""  # before any worker started (a worker's lines are prefixed)
        assert node0.stderr == (
            f"launcher: error: cannot host the rendezvous at 127.0.0.1:{port} (Address "
            "already in use): another program is using the port. Pick a free one, e.g. "
            "`python -m snippets.cluster.fake_multi_node_launcher --free-port`, and give every "
            "node the same --master-port\n")

        log = tmp_path / "node1.log"
        start = time.monotonic()
        with open(log, "w") as out:
            node1 = subprocess.run([*LAUNCHER, "--node-rank", "1", *job], cwd=ROOT, env=ENV,
                                   stdout=out, stderr=subprocess.STDOUT, timeout=60)
        took = time.monotonic() - start
    output = log.read_text()
    assert node1.returncode == 1, output
    # The line below is printed only by the course's watchdog, at --timeout: without it,
    # TCPStore's own loop fails later (2 x timeout plus a back-off) with another message. So the
    # wall clock is only a loose bound: 5 s of waiting plus starting Python and torch, which a
    # loaded 2-core machine can stretch to tens of seconds.
    assert took < 5 + 40, f"{took:.0f} s\n{output}"
    assert (f"[node 1 rank 1] error: rank 1: no store answered at 127.0.0.1:{port} within "
            "5 s.") in output
    assert f"Their output in {log} says why." in output  # where its logs are
    assert_none_left(ckpt)


def test_a_node_whose_peer_never_comes_fails_within_its_timeout(tmp_path):
    port = subprocess.run([*LAUNCHER, "--free-port"], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout.strip()
    ckpt = str(tmp_path / "ckpt.pt")
    start = time.monotonic()
    node1 = subprocess.run([*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "1",
                            "--node-rank", "1", "--master-port", port, TRAIN,
                            "--timeout", "5", "--ckpt", ckpt],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert node1.returncode == 1
    assert took < 5 + 40, f"{took:.0f} s\n{node1.stdout}"  # loose: the line below is the proof
    assert f"error: rank 1: no store answered at 127.0.0.1:{port} within 5 s." in node1.stdout
    assert "socket.cpp" not in node1.stdout  # the one line, not pages of C++ stack
    assert "Their output above says why." in node1.stdout
    assert_none_left(ckpt)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_its_launcher(tmp_path, how):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen([*LAUNCHER, "--nnodes", "1", "--nproc-per-node", "2",
                                 str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        started = [launcher.stdout.readline() for _ in range(3)]  # banner, then two "up"
        assert sum("up" in line for line in started) == 2, started
        assert len(processes_matching(str(script))) == 3  # the launcher and two workers
        launcher.send_signal(how)
        code = launcher.wait(timeout=30)
    finally:
        launcher.kill()
        launcher.wait()
    assert_none_left(str(script))
    if how == signal.SIGTERM:  # it stopped them itself, and said so
        assert code == 130
        assert "launcher: interrupted (SIGTERM): every worker was stopped" in launcher.stderr.read()
# --8<-- [end:no-hangs]
