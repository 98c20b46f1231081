"""Session C demo: how the processes of a multi-node job find each other and wait for each other.

    python -m snippets.cluster.fake_multi_node_launcher --nnodes 2 --nproc-per-node 2 \\
        snippets/cluster/coordination.py
    python -m snippets.cluster.fake_multi_node_launcher --nnodes 2 --nproc-per-node 2 \\
        snippets/cluster/coordination.py --missing-ranks 1 3 --timeout 5

1. Rendezvous: rank 0 opens a key-value store (a TCPStore) on MASTER_ADDR:MASTER_PORT; every
   other process, on every node, connects to it. That is the only address anyone needs to know
   in advance: inside init_process_group, gloo publishes each rank's own address in the store
   and reads everyone else's, which is how the process group learns every peer's address. The
   demo's roll call then does the same by hand (who/0, who/1, ...) to show the store at work.
2. A barrier: each rank "works" for a different time, then waits until all have arrived. Every
   line is timestamped: everyone leaves together, when the slowest arrives.
3. --missing-ranks R [R ...]: these ranks never arrive. A plain barrier would wait until the
   process group's timeout; monitored_barrier (gloo) fails after --timeout seconds and names
   the ranks that did not arrive.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import datetime, timedelta

import torch.distributed as dist

from snippets.dist import leave_process_group, read_launch_env
from snippets.flags import Parser, float_at_least, int_at_least, positive_float


def stamp() -> str:
    """Wall-clock time to the millisecond: every process on this machine shares the clock."""
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


# --8<-- [start:rendezvous]
def join(rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Meet the other processes at MASTER_ADDR:MASTER_PORT, then form the process group there.

    init_process_group("gloo") with no store does exactly this itself; doing it by hand
    shows the store that it otherwise hides.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Rank 0 listens and waits until all the others have connected; they retry until rank 0 is
    # up. Start-up gets at least a minute, whatever `timeout` says: processes that import torch
    # on a busy machine arrive seconds apart, and a short timeout is meant for the waits below.
    startup = max(timeout, timedelta(seconds=60))
    store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0), timeout=startup)
    store.set_timeout(timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return store


def roll_call(store: dist.TCPStore, rank: int, world_size: int, node_rank: int) -> None:
    """Every rank publishes where it runs; rank 0 reads the whole directory back."""
    store.set(f"who/{rank}", f"node {node_rank}, host {socket.gethostname()}, pid {os.getpid()}")
    if rank == 0:
        keys = [f"who/{r}" for r in range(world_size)]
        store.wait(keys)  # blocks until every rank has written its key (or the timeout)
        for r, key in enumerate(keys):
            print(f"{stamp()} store entry {key}: {store.get(key).decode()}", flush=True)
# --8<-- [end:rendezvous]


# --8<-- [start:barrier]
def staggered_barrier(store: dist.TCPStore, rank: int, world_size: int, work_s: float) -> None:
    """Rank r works r * work_s seconds, then waits at the barrier for everyone else."""
    time.sleep(rank * work_s)  # stands for this rank's share of the work: a slow data shard
    store.set(f"arrived/{rank}", str(time.time()))
    print(f"{stamp()} rank {rank}: at the barrier after {rank * work_s:.1f} s of work",
          flush=True)
    waited = time.perf_counter()
    dist.barrier()  # nobody passes until all world_size ranks have called it
    waited = time.perf_counter() - waited
    arrivals = {r: float(store.get(f"arrived/{r}")) for r in range(world_size)}
    last = max(arrivals, key=arrivals.get)
    print(f"{stamp()} rank {rank}: released after waiting {waited:.2f} s "
          f"(for rank {last}, the last to arrive)", flush=True)
# --8<-- [end:barrier]


# --8<-- [start:missing-rank]
def barrier_with_missing_ranks(rank: int, missing: list[int], timeout_s: float) -> None:
    """The ranks in `missing` hang (a stuck data loader, a dead GPU); the others go to the
    barrier."""
    if rank in missing:
        print(f"{stamp()} rank {rank}: stuck, never reaching the barrier", flush=True)
        time.sleep(3600)  # the launcher stops this process once another rank has failed
    print(f"{stamp()} rank {rank}: at the barrier, waiting at most {timeout_s:.0f} s", flush=True)
    # Rank 0 collects an acknowledgement from every rank; wait_all_ranks=True makes it wait
    # for all of them and name every missing one, not just the first it finds.
    dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
# --8<-- [end:missing-rank]


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work-s", type=float_at_least(0), default=0.5,
                   help="rank r works r x this before the barrier")
    p.add_argument("--missing-ranks", type=int_at_least(0), nargs="+", default=[],
                   help="these ranks never arrive")
    p.add_argument("--timeout", type=positive_float, default=60, help="seconds any wait may take")
    args = p.parse_args(argv)
    env = read_launch_env()  # a LaunchError naming what is missing, without a launcher
    rank, world = env["rank"], env["world_size"]
    node_rank = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    wrong = [r for r in args.missing_ranks if not 0 < r < world]
    if wrong:  # rank 0 runs the monitored barrier, so it cannot be the missing one
        raise SystemExit(f"--missing-ranks {wrong}: choose ranks from 1 to {world - 1} (rank 0 "
                         "is the one that checks on the others)")
    store = join(rank, world, timedelta(seconds=args.timeout))
    if args.missing_ranks:
        barrier_with_missing_ranks(rank, args.missing_ranks, args.timeout)
    else:
        roll_call(store, rank, world, node_rank)
        staggered_barrier(store, rank, world, args.work_s)
    leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
