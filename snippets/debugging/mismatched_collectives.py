"""A hang from mismatched collectives, made to fail fast: a timeout, then a named mismatch.

    python -m snippets.debugging.mismatched_collectives      # 2 processes on gloo, a few seconds

Rank 0 calls all_reduce while rank 1 calls broadcast: a classic hang, usually hidden behind
an `if rank == 0:` or a data-dependent branch. Each rank waits for messages the other never
sends. With a timeout on the process group both ranks raise after `timeout_s` instead of
waiting forever; with TORCH_DISTRIBUTED_DEBUG=DETAIL every collective is first checked against
the other ranks', and the mismatch is reported at once, naming both operations.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from snippets.dist import spawn


# --8<-- [start:mismatch]
def mismatched_step(rank: int, group=None) -> None:
    """The bug: the ranks disagree on which collective comes next."""
    tensor = torch.ones(4)
    if rank == 0:
        dist.all_reduce(tensor, group=group)
    else:
        dist.broadcast(tensor, src=0, group=group)


def run_mismatch(rank: int, world_size: int, detail: bool, timeout_s: float) -> dict:
    """Run the bug on a process group with a `timeout_s` timeout; return how it ended.

    `detail` does in code what TORCH_DISTRIBUTED_DEBUG=DETAIL does from the environment at
    init_process_group: groups created afterwards check each collective's type and shapes
    across ranks before running it."""
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    start = time.monotonic()
    try:
        mismatched_step(rank, group)
    except RuntimeError as err:
        return {"rank": rank, "seconds": time.monotonic() - start, "error": short(str(err))}
    return {"rank": rank, "seconds": time.monotonic() - start, "error": None}
# --8<-- [end:mismatch]


def short(message: str) -> str:
    """The first line of a c10d error, without source paths and tensor-option dumps."""
    first = message.strip().splitlines()[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # "[/path/to/gloo/file.cc:78] "
    first = re.sub(r", TensorDeviceTypes=TensorOptions\(.*?memory_format=\([^)]*\)\)", "", first)
    return re.sub(r"SequenceNumber=\d+, ", "", first)


def main(timeout_s: float = 1.0) -> None:
    for detail, label in ((False, "plain, timeout"), (True, "TORCH_DISTRIBUTED_DEBUG=DETAIL")):
        print(f"== {label} {timeout_s:g} s ==")
        for r in spawn(run_mismatch, 2, detail, timeout_s, timeout_s=60):
            print(f"rank {r['rank']} raised after {r['seconds']:.2f} s: {r['error']}")


if __name__ == "__main__":
    main()
