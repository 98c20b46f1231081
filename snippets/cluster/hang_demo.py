"""Reproduce the classic distributed hangs on purpose, on CPU (gloo), and read the errors.

    python -m snippets.cluster.hang_demo --bug mismatch              # all_reduce vs broadcast
    python -m snippets.cluster.hang_demo --bug skip                  # one rank skips a collective
    python -m snippets.cluster.hang_demo --bug shape                 # different tensor sizes
    python -m snippets.cluster.hang_demo --bug mismatch --debug OFF  # the same, without the checks

Every collective is a rendezvous: all ranks must call the same collectives, in the same order,
with the same shapes. When they do not, NCCL usually just waits (a hang, GPUs at 100% "busy"),
and only the process group's timeout ends it. With TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch wraps
the process group and first compares every collective's fingerprint (operation, shapes, dtypes)
across ranks, so the mistake is reported at once, naming both ranks and what each was calling.
The checks cost an extra round of communication per collective: use them to debug, not to train.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.distributed as dist

from snippets.dist import spawn

BUGS = ("mismatch", "skip", "shape")


# --8<-- [start:bugs]
def buggy_step(rank: int, bug: str, wait_s: float) -> None:
    """One step of a training loop with a rank-dependent mistake in it."""
    grad = torch.ones(4)
    if bug == "mismatch":  # e.g. rank 0 takes an `if rank == 0:` branch that broadcasts
        if rank == 0:
            dist.all_reduce(grad)
        else:
            dist.broadcast(grad, src=0)
    elif bug == "skip":  # e.g. rank 1 ran out of data one step early and left the loop
        if rank == 0:
            dist.all_reduce(grad)
        else:
            time.sleep(wait_s)  # still alive, but never calls the all_reduce
    elif bug == "shape":  # e.g. an uneven last batch, all-reduced without padding
        dist.all_reduce(torch.ones(4 + rank))
# --8<-- [end:bugs]


def run_rank(rank: int, world_size: int, bug: str, wait_s: float) -> str:
    """Run the buggy step; return what happened on this rank (the error's first lines)."""
    start = time.monotonic()
    try:
        buggy_step(rank, bug, wait_s)
        outcome = "returned normally"
    except Exception as err:  # DistBackendError, RuntimeError: whatever the backend raised
        text = re.sub(r"TensorOptions\((?:[^()]|\([^()]*\))*\)", "TensorOptions(...)", str(err))
        lines = [line for line in text.splitlines() if line.strip()]
        outcome = f"{type(err).__name__}: " + "\n    ".join(lines[:3])
    return f"rank {rank} after {time.monotonic() - start:4.1f} s: {outcome}"


def main(argv=None) -> None:
    from snippets.flags import Parser, positive_float

    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bug", choices=BUGS, default="mismatch")
    p.add_argument("--debug", choices=("OFF", "INFO", "DETAIL"), default="DETAIL",
                   help="TORCH_DISTRIBUTED_DEBUG for the ranks")
    p.add_argument("--timeout", type=positive_float, default=5,
                   help="the process group's timeout, s")
    args = p.parse_args(argv)
    # Read when the process group is created, so it must be set before the ranks start.
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = args.debug
    print(f"bug={args.bug}  TORCH_DISTRIBUTED_DEBUG={args.debug}  timeout={args.timeout:g} s")
    for line in spawn(run_rank, 2, args.bug, args.timeout + 2, timeout_s=args.timeout):
        print(line)


if __name__ == "__main__":
    main()
