"""Starting torch.distributed: from a launcher's environment, or by spawning processes here.

Every process group created here has a timeout, so a collective that waits for a dead or hung
rank raises an error after `timeout_s` seconds instead of blocking forever.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60


class LaunchError(RuntimeError):
    """The process was started without the environment a distributed launcher provides."""


# --8<-- [start:init-from-env]
def read_launch_env() -> dict:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun or SLURM set them."""
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


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Join the process group described by the launcher's environment variables."""
    env = read_launch_env()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"])  # one GPU per process, chosen by LOCAL_RANK
    timeout = timedelta(seconds=timeout_s)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
    else:
        # After a restart, torchrun's store still holds the dead workers' addresses from the
        # previous attempt; a fresh key prefix keeps the new workers from connecting to them.
        store = dist.TCPStore(env["master_addr"], env["master_port"], env["world_size"],
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"restart{restart}", store),
                                rank=env["rank"], world_size=env["world_size"], timeout=timeout)
    return env
# --8<-- [end:init-from-env]


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


def free_port() -> int:
    """A TCP port no one is listening on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    # The first backward pass in a process imports sympy (via symbolic_shapes): about 2.5 s of
    # CPU per rank unless the server has imported it already.
    ctx.set_forkserver_preload(["torch", "torch.distributed",
                                "torch.fx.experimental.symbolic_shapes"])
    results = ctx.Queue()
    port = free_port()
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
        # Plain pickle bytes: torch.multiprocessing would pass tensors through shared memory
        # that disappears when this process exits, before the parent has read them.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, KeyboardInterrupt and SystemExit included
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
# --8<-- [end:spawn]
