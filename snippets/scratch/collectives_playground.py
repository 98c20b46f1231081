"""The five collectives of distributed training, each rank's tensor before and after.

    torchrun --nproc_per_node=4 snippets/scratch/collectives_playground.py

Every rank starts from its own small tensor (rank r holds 10r, 10r+1, ...), runs one collective,
and reports what it held before and after. Rank 0 collects the reports and prints them in rank
order, so the output is the same on every run, whatever order the processes finish in.
"""

import argparse

import torch
import torch.distributed as dist

from snippets.dist import init_from_env, leave_process_group
from snippets.flags import Parser


def starting_tensor(rank: int, world: int) -> torch.Tensor:
    """One value per rank, so a collective that splits the tensor splits it into world pieces."""
    return torch.arange(world) + 10 * rank


# --8<-- [start:collectives]
def all_reduce(rank: int, world: int) -> tuple[list, list]:
    """Everyone ends with the element-wise sum of everyone's tensor (DDP's gradient average)."""
    x = starting_tensor(rank, world)
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # in place
    return before, x.tolist()


def broadcast(rank: int, world: int) -> tuple[list, list]:
    """Everyone ends with rank 0's tensor (the same initial weights on every rank)."""
    x = starting_tensor(rank, world)
    before = x.tolist()
    dist.broadcast(x, src=0)  # in place
    return before, x.tolist()


def all_gather(rank: int, world: int) -> tuple[list, list]:
    """Everyone ends with every rank's tensor, in rank order (ZeRO-3 gathering a layer's weights)."""
    x = starting_tensor(rank, world)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    return x.tolist(), [t.tolist() for t in gathered]


def reduce_scatter(rank: int, world: int) -> tuple[list, list]:
    """Sum like all_reduce, but rank r keeps only piece r of the sum (ZeRO-2's gradient shards)."""
    x = starting_tensor(rank, world)
    mine = torch.empty(len(x) // world, dtype=x.dtype)
    dist.reduce_scatter_single(mine, x, op=dist.ReduceOp.SUM)  # formerly reduce_scatter_tensor
    return x.tolist(), mine.tolist()


def all_to_all(rank: int, world: int) -> tuple[list, list]:
    """Rank r sends its piece j to rank j and receives everyone's piece r (MoE token routing)."""
    x = starting_tensor(rank, world)
    received = torch.empty_like(x)
    dist.all_to_all_single(received, x)  # equal splits: one piece per rank
    return x.tolist(), received.tolist()
# --8<-- [end:collectives]


COLLECTIVES = [all_reduce, broadcast, all_gather, reduce_scatter, all_to_all]


# --8<-- [start:report]
def report(collective, rank: int, world: int) -> None:
    """Run one collective everywhere; rank 0 prints every rank's before -> after, in rank order."""
    before, after = collective(rank, world)
    reports = [None] * world if rank == 0 else None
    dist.gather_object((before, after), reports, dst=0)  # a list of Python objects, to rank 0
    if rank == 0:
        print(f"{collective.__name__}: {collective.__doc__.split('(')[0].strip()}")
        for r, (b, a) in enumerate(reports):
            print(f"  rank {r}: {str(b):18} -> {a}")
# --8<-- [end:report]


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=[c.__name__ for c in COLLECTIVES],
                   help="run one collective instead of all five")
    args = p.parse_args(argv)
    env = init_from_env("gloo", timeout_s=30)  # CPU tensors: the same on a laptop or a GPU node
    rank, world = env["rank"], env["world_size"]
    for collective in COLLECTIVES:
        if args.only in (None, collective.__name__):
            report(collective, rank, world)
    leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
