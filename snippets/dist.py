"""Starting torch.distributed: from a launcher's environment, or by spawning processes here.

Every process group created here has a timeout, so a collective that waits for a dead or hung
rank fails after `timeout_s` seconds instead of blocking forever: under gloo it raises an error;
under NCCL the watchdog aborts the communicator and the process is killed.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from snippets.ports import free_port

DEFAULT_TIMEOUT_S = 60


class LaunchError(RuntimeError):
    """The process was started without the environment a distributed launcher provides."""


# --8<-- [start:init-from-env]
def read_launch_env() -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun sets them (under
    SLURM too: the course's batch scripts start torchrun with srun)."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if missing:
        raise LaunchError(
            f"{', '.join(missing)} not set: this script is a distributed worker. Start it with "
            f"a launcher, e.g. `torchrun --nproc_per_node=2 {os.path.basename(_main_script())}`, "
            "which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process."
        )
    env = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        value = os.environ.get(name, os.environ["RANK"] if name == "LOCAL_RANK" else None)
        try:
            env[name.lower()] = int(value)
        except ValueError:
            raise LaunchError(f"{name}={value!r} is not an integer") from None
    if not 0 <= env["rank"] < env["world_size"]:
        raise LaunchError(f"RANK={env['rank']} must be in [0, WORLD_SIZE={env['world_size']})")
    env["master_addr"] = os.environ["MASTER_ADDR"]
    return env


def default_backend() -> str:
    """NCCL when each process on this node can have a GPU of its own, else gloo on the CPU.
    NCCL runs one process per GPU: with two processes on a machine with one GPU, rank 1 would
    take cuda:1, which does not exist ("CUDA error: invalid device ordinal")."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= processes
    return "nccl" if enough_gpus else "gloo"


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Join the process group described by the launcher's environment variables."""
    env = read_launch_env()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"])  # one GPU per process, chosen by LOCAL_RANK
    store = connect_store(env, timeout_s)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart > 0:
        # After a restart, torchrun's store still holds the dead workers' addresses from the
        # previous attempt; a fresh key prefix keeps the new workers from connecting to them.
        store = dist.PrefixStore(f"restart{restart}", store)
    # device_id binds the group to this process's GPU, so NCCL creates its communicator at
    # init; without it, barrier() falls back to the current device with a warning, and the
    # last-resort guess, global rank mod GPUs per node, is wrong when nodes are uneven.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store),
                            rank=env["rank"], world_size=env["world_size"],
                            timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", env["local_rank"])
                            if backend == "nccl" else None)
    return env


def collective_device() -> torch.device:
    """Where a collective's tensors must live: NCCL moves only GPU tensors (this process's GPU,
    which init_from_env chose from LOCAL_RANK; a CPU tensor fails with "No backend type
    associated with device type cpu"); under gloo the course keeps them on the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
# --8<-- [end:init-from-env]


# --8<-- [start:connect-store]
def connect_store(env: dict, timeout_s: float) -> dist.TCPStore:
    """The job's key-value store at MASTER_ADDR:MASTER_PORT, which every rank must reach first.

    Rank 0 hosts it and waits up to timeout_s for the others, unless torchrun's agent hosts it.
    A rank that finds nobody listening would try for timeout_s, back off a few seconds, and
    try for timeout_s again (TCPStore's connect loop): 123 s for 60. A watchdog stops it at
    timeout_s instead, with a message that says what is missing.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_host = env["rank"] == 0 and not agent_hosts_store
    where = f"{env['master_addr']}:{env['master_port']}"
    watchdog = threading.Timer(timeout_s, _exit_with, args=(
        f"rank {env['rank']}: no store answered at {where} within {timeout_s:.0f} s. The node "
        "whose rank 0 hosts it was not started, or was given another --master-addr/"
        "--master-port (a port already in use makes it fail at start: read its output)",))
    watchdog.daemon = True
    if not is_host:
        watchdog.start()
    try:
        # A client's own connect timeout is far longer than the watchdog's, so that the watchdog
        # speaks first, instead of pages of C++ stack from the first failed try: with twice the
        # watchdog's, a fresh clone under a load of 5 on 2 cores saw the watchdog run more than
        # timeout_s late and the C++ warning come first.
        store = dist.TCPStore(env["master_addr"], env["master_port"], env["world_size"],
                              is_master=is_host, multi_tenant=is_host,
                              timeout=timedelta(seconds=timeout_s * (1 if is_host else 4)))
    finally:
        watchdog.cancel()
    store.set_timeout(timedelta(seconds=timeout_s))  # for every wait on the store from now on
    return store


def _exit_with(message: str) -> None:
    """End this process from a watchdog thread: the main thread is stuck inside C++."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)
# --8<-- [end:connect-store]


# --8<-- [start:run-main]
def run_main(main, *args) -> None:
    """Run a distributed script's main(*args) and exit with its return value. If it raises,
    print one line naming the rank and the error, and exit with status 1 (2 for a
    LaunchError: the script was started wrong).

    Left uncaught, the error would print a traceback on every failing rank, then torchrun's
    own ChildFailedError traceback: the line that says what went wrong is lost among 50 others.
    torchrun gives each worker a file to write its error to, TORCHELASTIC_ERROR_FILE; the
    traceback goes there (what torch's @record does), and torchrun's summary shows it under
    "Root Cause".
    """
    try:
        status = main(*args)
    except Exception as err:  # Ctrl-C (KeyboardInterrupt) and sys.exit() pass through
        print(f"error: rank {os.environ.get('RANK', '?')}: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        ErrorHandler().record_exception(err)  # writes the file only if torchrun named one
        status = 2 if isinstance(err, LaunchError) else 1
    sys.exit(status)  # main's return value, if it returns one; None is 0
# --8<-- [end:run-main]


# --8<-- [start:stop-signal]
class StopSignal:
    """SIGTERM as a request to save and stop at the end of the current step, not mid-step.

    SLURM sends SIGTERM at the time limit (then SIGKILL, KillWait seconds later, 30 by
    default), and on scancel or preemption; torchrun passes it on to its workers. Ranks receive
    it at slightly different moments, so `requested()` asks them all: every rank stops after
    the same step.
    """

    def __init__(self, signum: int = signal.SIGTERM):
        self.received = None
        signal.signal(signum, self._receive)

    def _receive(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        """True on every rank once any rank has received the signal (a collective: call it
        at the same point on every rank)."""
        flag = torch.tensor([self.received is not None], dtype=torch.int32,
                            device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
# --8<-- [end:stop-signal]


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
              timeout_s: float = DEFAULT_TIMEOUT_S):
    """init_device_mesh with the course's timeout on every group it creates. Left alone, a mesh
    dimension that spans less than the whole world gets a new group with torch's default
    timeout (30 min under gloo, 10 under NCCL), whatever the default group was given."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = dist.get_backend()
    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())
    options._timeout = timedelta(seconds=timeout_s)
    return init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override={name: (backend, options) for name in names})


# --8<-- [start:leave-process-group]
def leave_process_group(timeout_s: float = 60.0) -> None:
    """End a job's process group with the rank that hosts the store leaving last.

    Every rank's connections hang off the TCP store at MASTER_ADDR:MASTER_PORT, which lives in
    rank 0's process (or, under torchrun, in node 0's agent, which exits with node 0's workers).
    If it exits while another rank is still tearing down, that rank can die with SIGABRT
    ("terminate called without an active exception") after all its work is done. So every rank
    signs out on the store after destroying its group, and rank 0 waits for all of them.
    """
    env = read_launch_env()
    dist.barrier()
    dist.destroy_process_group()
    store = dist.TCPStore(env["master_addr"], env["master_port"], is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    key = f"left/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.add(key, 1)
    if env["rank"] == 0:
        deadline = time.monotonic() + timeout_s
        while (left := store.add(key, 0)) < env["world_size"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {left} of {env['world_size']} ranks left the process "
                                   f"group within {timeout_s:.0f} s")
            time.sleep(0.01)
# --8<-- [end:leave-process-group]


def _main_script() -> str:
    import __main__

    return getattr(__main__, "__file__", "your_script.py")


# --8<-- [start:spawn]
def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
          threads_per_rank: int = 1) -> list:
    """Run fn(rank, world_size, *args) in world_size fresh processes joined in one process group;
    return each rank's return value, in rank order.

    What a launcher would do, inside Python: each process gets the environment torchrun would
    give it. If any rank raises, the others are stopped and the error names the rank; if the job
    is not done within about twice timeout_s, every process is killed.
    """
    # forkserver: a server process imports torch once; each rank is forked from it in
    # milliseconds instead of importing torch again (seconds per rank with plain "spawn").
    ctx = mp.get_context("forkserver")
    # The first backward pass in a process imports sympy (via symbolic_shapes), and the first
    # optimizer step imports torch._dynamo: about 2.5 and 3.5 s of CPU per rank unless the
    # server has imported them already.
    ctx.set_forkserver_preload(["torch", "torch.distributed",
                                "torch.fx.experimental.symbolic_shapes", "torch._dynamo"])
    forkserver.ensure_running()  # its seconds of imports come before the port is chosen
    results = ctx.Queue()
    port = free_port()  # free now; rank 0 binds it a moment later
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, rank, world_size, port, backend, timeout_s, threads_per_rank,
                          results, args))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    limit_s = 2 * timeout_s + 30
    done, deadline = {}, time.monotonic() + limit_s
    try:
        while len(done) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in done]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                       "before returning (killed, or crashed in C++)")
                if time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in done]
                    raise TimeoutError(f"ranks {waiting} did not finish within {limit_s:.0f} s")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            done[rank] = pickle.loads(value)  # written by our own child process
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == world_size else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(world_size)]


def _worker(fn, rank, world_size, port, backend, timeout_s, threads, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)  # N processes share the cores; oversubscribing slows all
    try:
        init_from_env(backend, timeout_s)
        # Gloo's init can return on one rank while a peer is still finishing its side of the
        # connection. A rank whose fn calls no collective could then return, exit and close the
        # connection under that peer ("Connection closed by peer" in its init). One barrier:
        # every rank has joined before any runs fn.
        dist.barrier()
        # Plain pickle bytes: torch.multiprocessing would pass tensors through shared memory
        # that disappears when this process exits, before the parent has read them.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, KeyboardInterrupt and SystemExit included
        results.put((rank, False, traceback.format_exc()))
    finally:
        # put() hands the result to a feeder thread: see it into the pipe before a teardown
        # that could end this process, or a peer's knock-on error could be read first.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
# --8<-- [end:spawn]
