"""Play a cluster's part on one machine: start N "nodes" x M processes of a training script.

    python -m snippets.cluster.fake_multi_node_launcher --nnodes 2 --nproc-per-node 2 \\
        snippets/cluster/multi_node_train.py --max-steps 3

This is a simulation of what SLURM plus torchrun do on a real cluster, nothing more: every
"node" is a group of processes on this machine, and the only thing that makes them a node is
the environment each process gets (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK,
LOCAL_WORLD_SIZE, LOCAL_RANK, RANK). The script cannot tell the difference.

--node-rank K (or NODE_RANK=K in the environment) starts only node K's processes, as one
machine of a real cluster would: run it once per "node", in two terminals, with the same
--master-port (`--free-port` prints one that is free now; a busy one fails node 0 at once). Every output line is prefixed with the node and rank that printed it. When a
process fails, the others are stopped (they would wait for it forever) and the launcher
reports every process's exit status, naming the one that failed first.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from snippets.cluster.node_ranks import RankError, global_ranks, worker_env
from snippets.ports import free_port


@dataclass
class Worker:
    node_rank: int
    local_rank: int
    rank: int
    process: subprocess.Popen
    exit_code: int | None = None
    exited_at: float = float("inf")  # time.monotonic() at exit: which failure came first
    stopped_by_launcher: bool = False


# --8<-- [start:start-workers]
def start_workers(command: list[str], nnodes: int, nproc_per_node: int, node_ranks: list[int],
                  master_addr: str, master_port: int, threads_per_rank: int = 1) -> list[Worker]:
    """One process per (node, local rank), each with the environment a cluster would give it."""
    workers = []
    for node_rank in node_ranks:
        for local_rank in range(nproc_per_node):
            env = {**os.environ,
                   **worker_env(node_rank, local_rank, nnodes, nproc_per_node, master_addr,
                                master_port),
                   # N processes share the cores: one thread each, or they slow each other down
                   "OMP_NUM_THREADS": str(threads_per_rank),
                   "PYTHONUNBUFFERED": "1"}
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True, preexec_fn=_die_with_parent)
            workers.append(Worker(node_rank, local_rank, int(env["RANK"]), process))
    return workers
# --8<-- [end:start-workers]


def _die_with_parent() -> None:
    """In the child, before it runs the script: on Linux, ask the kernel to SIGKILL it when
    the launcher dies, even by SIGKILL, so that no worker outlives its launcher."""
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def check_port_free(addr: str, port: int) -> None:
    """Fail now, in one line, if rank 0 could not host the store at addr:port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        try:
            s.bind((addr, port))
        except OSError as err:
            raise RankError(
                f"cannot host the rendezvous at {addr}:{port} ({err.strerror}): another "
                "program is using the port. Pick a free one, e.g. "
                "`python -m snippets.cluster.fake_multi_node_launcher --free-port`, and give "
                "every node the same --master-port") from None


def _follow(worker: Worker, lock: threading.Lock) -> None:
    """Copy a worker's output to ours, each line tagged with who wrote it (log aggregation),
    then record when and how it exited."""
    tag = f"[node {worker.node_rank} rank {worker.rank}]"
    for line in worker.process.stdout:
        with lock:
            sys.stdout.write(f"{tag} {line}")
            sys.stdout.flush()
    code = worker.process.wait()
    worker.exited_at, worker.exit_code = time.monotonic(), code


# --8<-- [start:wait]
def wait_for_workers(workers: list[Worker], poll_s: float = 0.1, grace_s: float = 2.0,
                     kill_after_s: float = 5.0) -> Worker | None:
    """Wait until every worker has exited; return the first that failed, or None.

    When one process fails, the others get grace_s seconds to fail with their own error
    messages (often the more useful ones), then they are stopped: in a data-parallel job they
    would otherwise block in their next collective, waiting for a peer that is gone.
    torchrun stops them too, without the grace.
    """
    stop_at, terminated = None, False
    while any(w.exit_code is None for w in workers):
        if stop_at is None and any(w.exit_code not in (None, 0) for w in workers):
            stop_at = time.monotonic() + grace_s
        if stop_at is not None and time.monotonic() > stop_at and not terminated:
            _signal_running(workers, signal.SIGTERM)
            terminated = True
        if stop_at is not None and time.monotonic() > stop_at + kill_after_s:
            _signal_running(workers, signal.SIGKILL)  # one that ignored SIGTERM
        time.sleep(poll_s)
    failed = [w for w in workers if w.exit_code != 0]
    return min(failed, key=lambda w: w.exited_at) if failed else None


def _signal_running(workers: list[Worker], sig: signal.Signals) -> None:
    for w in workers:
        if w.exit_code is None:  # set by its _follow thread when it exits
            w.stopped_by_launcher = True
            try:
                os.killpg(w.process.pid, sig)  # its process group: its children too
            except ProcessLookupError:  # it exited in between
                pass
# --8<-- [end:wait]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _where_output_goes() -> str:
    """Where a learner finds the workers' output: above, or the file this output goes to."""
    try:
        if stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            path = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")
            relative = os.path.relpath(path)
            return f"in {path if relative.startswith('..') else relative}"
    except OSError:  # no /proc (macOS): say it the general way
        pass
    return "above"


def _status(w: Worker) -> str:
    if w.exit_code == 0:
        return "exit 0"
    if w.stopped_by_launcher:
        return f"stopped by the launcher ({_signal_name(w.exit_code)})"
    return f"FAILED, {_signal_name(w.exit_code)}"


def _signal_name(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


# --8<-- [start:launch]
def launch(command: list[str], nnodes: int, nproc_per_node: int, node_rank: int | None = None,
           master_addr: str = "127.0.0.1", master_port: int | None = None,
           threads_per_rank: int = 1) -> int:
    """Run `command` as nnodes x nproc_per_node processes (or one node's share); return 0 if
    every process succeeded, else 1, after printing each process's exit status."""
    node_ranks = list(range(nnodes)) if node_rank is None else [node_rank]
    for n in node_ranks:
        global_ranks(n, nnodes, nproc_per_node)  # clear error for a node outside the job
    if master_port is None:
        if node_rank is not None:
            raise RankError("--node-rank starts one node of several: give every node the same "
                            "--master-port, or they cannot find each other")
        master_port = free_port()
    elif 0 in node_ranks:  # rank 0, on node 0, hosts the store
        check_port_free(master_addr, master_port)
    print(f"launcher: {nnodes} node(s) x {nproc_per_node} process(es), world size "
          f"{nnodes * nproc_per_node}, rendezvous at {master_addr}:{master_port}, starting "
          f"node(s) {node_ranks}", flush=True)
    # kill or Ctrl-C, or the terminal closing: take every worker down with us. The handlers go
    # in before the first worker starts: a SIGTERM that came after the workers had started but
    # before the handlers would have killed the launcher alone (its workers then die with it,
    # by _die_with_parent, but unannounced).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    workers = start_workers(command, nnodes, nproc_per_node, node_ranks, master_addr,
                            master_port, threads_per_rank)
    lock = threading.Lock()
    readers = [threading.Thread(target=_follow, args=(w, lock)) for w in workers]
    try:
        for t in readers:
            t.start()
        failed = wait_for_workers(workers)
    except KeyboardInterrupt:
        _signal_running(workers, signal.SIGKILL)
        raise
    finally:
        for t in readers:
            if t.ident is not None:  # started: it ends when its worker's output does
                t.join()
    print("launcher: node  local_rank  rank  status")
    for w in workers:
        print(f"launcher: {w.node_rank:4d}  {w.local_rank:10d}  {w.rank:4d}  {_status(w)}")
    if failed is not None:
        others = [w.rank for w in workers
                  if w.exit_code != 0 and not w.stopped_by_launcher and w is not failed]
        print(f"launcher: job FAILED: node {failed.node_rank}, rank {failed.rank} (local rank "
              f"{failed.local_rank}) failed first with {_signal_name(failed.exit_code)}"
              + (f"; ranks {others} failed too" if others else "")
              + f". Their output {_where_output_goes()} says why.", flush=True)
        return 1
    print("launcher: job succeeded: every process exited with 0", flush=True)
    return 0
# --8<-- [end:launch]


def parse_args(argv=None):
    from snippets.flags import Parser, checked, int_at_least

    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nnodes", type=int_at_least(1), default=2, help="how many simulated machines")
    p.add_argument("--nproc-per-node", type=int_at_least(1), default=2,
                   help="processes (GPUs) per machine")
    p.add_argument("--node-rank", type=int_at_least(0),
                   default=int(os.environ["NODE_RANK"]) if "NODE_RANK" in os.environ else None,
                   help="start only this node's processes (default: $NODE_RANK, else all nodes)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=checked(int, lambda v: 1 <= v <= 65535, "a port from 1 "
                   "to 65535 (leave it out for a free one)"), default=None,
                   help="default: a free port")
    p.add_argument("--threads-per-rank", type=int_at_least(1), default=1,
                   help="OMP_NUM_THREADS per process")
    p.add_argument("--free-port", action="store_true",
                   help="print a TCP port that is free now, for --master-port, and exit")
    p.add_argument("script", nargs="?", help="a Python script, run as `python SCRIPT ARGS...`")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.free_port:
        print(free_port())
        return 0
    if args.script is None:
        print("launcher: error: name the script to run", file=sys.stderr)
        return 2
    try:
        return launch([sys.executable, args.script, *args.script_args], args.nnodes,
                      args.nproc_per_node, args.node_rank, args.master_addr, args.master_port,
                      args.threads_per_rank)
    except RankError as err:
        print(f"launcher: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as why:
        print(f"launcher: interrupted ({why or 'Ctrl-C'}): every worker was stopped",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
