"""Rank arithmetic of a multi-node job: which global ranks live on which node.

    python -m snippets.cluster.node_ranks --node-rank 2 --nnodes 4 --gpus-per-node 8
    python -m snippets.cluster.node_ranks --answer 16-23      # check your answer to Lab 3's question

Every count here starts at 0, as the launchers count: NODE_RANK 0 is the first node, RANK 0 the
first process. "Node 3 of 4" in words is the third node, NODE_RANK=2; NODE_RANK=3 is the fourth.
"""

from __future__ import annotations

import argparse
import sys

from snippets.flags import Parser, int_at_least


class RankError(ValueError):
    """A node or process index outside the job; the message says which and the valid range."""


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RankError(f"{name}={value!r} must be a positive whole number (a count, at least 1)")


# --8<-- [start:global-ranks]
def global_ranks(node_rank: int, num_nodes: int, gpus_per_node: int) -> range:
    """The global ranks of the processes on node `node_rank` (counted from 0).

    Launchers number processes node by node: node 0 holds ranks 0..g-1, node 1 the next g,
    and so on, so RANK = NODE_RANK * gpus_per_node + LOCAL_RANK.
    """
    _check_count("num_nodes", num_nodes)
    _check_count("gpus_per_node", gpus_per_node)
    if not isinstance(node_rank, int) or isinstance(node_rank, bool):
        raise RankError(f"node_rank={node_rank!r} must be a whole number")
    if not 0 <= node_rank < num_nodes:
        raise RankError(
            f"node_rank={node_rank} is outside a job of num_nodes={num_nodes}: node ranks count "
            f"from 0, so they run from 0 to {num_nodes - 1} (the {_ordinal(num_nodes)} node of "
            f"{num_nodes} is node_rank={num_nodes - 1})")
    first = node_rank * gpus_per_node
    return range(first, first + gpus_per_node)
# --8<-- [end:global-ranks]


# --8<-- [start:worker-env]
def worker_env(node_rank: int, local_rank: int, num_nodes: int, procs_per_node: int,
               master_addr: str, master_port: int) -> dict[str, str]:
    """The variables a cluster launcher sets for one process (all values are strings)."""
    ranks = global_ranks(node_rank, num_nodes, procs_per_node)
    if not 0 <= local_rank < procs_per_node:
        raise RankError(f"local_rank={local_rank} must be in [0, procs_per_node={procs_per_node})")
    return {
        "MASTER_ADDR": master_addr,             # where rank 0's rendezvous store listens
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(num_nodes * procs_per_node),  # processes in the whole job
        "NODE_RANK": str(node_rank),            # which machine (torchrun calls it GROUP_RANK)
        "LOCAL_WORLD_SIZE": str(procs_per_node),
        "LOCAL_RANK": str(local_rank),          # which GPU on this machine
        "RANK": str(ranks[local_rank]),         # which process in the whole job
    }
# --8<-- [end:worker-env]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _span(ranks: range) -> str:
    return f"{ranks[0]}-{ranks[-1]}"


# --8<-- [start:check-answer]
def check_answer(answer: str, node: int = 3, of: int = 4, gpus_per_node: int = 8) -> tuple[bool, str]:
    """Check an answer like "16-23" to: you are node `node` of `of` (counted in words, from 1),
    with `gpus_per_node` GPUs each; which global ranks are yours? Returns (right, explanation)."""
    node_rank = node - 1  # "node 3" in words is the third node: NODE_RANK counts from 0
    right = global_ranks(node_rank, of, gpus_per_node)
    try:
        first, last = (int(x) for x in answer.replace(" ", "").split("-"))
    except ValueError:
        raise RankError(f"answer={answer!r}: write the range as FIRST-LAST, e.g. 0-7") from None
    given = range(first, last + 1)
    why = (f"node {node} of {of} is NODE_RANK={node_rank}; its ranks are {node_rank} x "
           f"{gpus_per_node} + LOCAL_RANK (0..{gpus_per_node - 1}) = {_span(right)}")
    if given == right:
        return True, f"right: {why}"
    if node_rank + 1 < of and given == global_ranks(node_rank + 1, of, gpus_per_node):
        return False, (f"off by one node: {_span(given)} belongs to NODE_RANK={node_rank + 1}, "
                       f"the {_ordinal(node + 1)} node. {why}")
    if given == range(right.start + 1, right.stop + 1):
        return False, f"off by one rank: ranks count from 0 too. {why}"
    if len(given) != gpus_per_node:
        return False, f"a node holds {gpus_per_node} ranks, your range has {len(given)}. {why}"
    return False, f"not quite. {why}"
# --8<-- [end:check-answer]


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--node-rank", type=int_at_least(0), default=2, help="NODE_RANK, counted from 0")
    p.add_argument("--nnodes", type=int_at_least(1), default=4)
    p.add_argument("--gpus-per-node", type=int_at_least(1), default=8)
    p.add_argument("--answer", help="check an answer FIRST-LAST to 'node 3 of 4, 8 GPUs each'")
    args = p.parse_args(argv)
    try:
        if args.answer is not None:
            right, explanation = check_answer(args.answer)
            print(explanation)
            return 0 if right else 1
        ranks = global_ranks(args.node_rank, args.nnodes, args.gpus_per_node)
    except RankError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"NODE_RANK={args.node_rank} of {args.nnodes} nodes x {args.gpus_per_node} GPUs: "
          f"global ranks {_span(ranks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
