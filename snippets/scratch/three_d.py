"""3-D parallelism from the course's own parts: data x tensor x pipeline (DP x TP x PP).

Each of the three cuts the work along its own axis: TP splits every matrix of a layer
(tensor_parallel.py), PP cuts the stack of layers into stages (pipeline.py), DP gives each copy
of the whole pipeline its own slice of the batch (ddp.py). With all three, a rank holds one TP
shard of one stage, of one replica, and talks to three groups of ranks:

- its TP group: the other shards of the same stage of the same replica (all-reduce per layer);
- its PP group: the same shard of the other stages of the same replica (send/recv);
- its DP group: the same shard of the same stage in the other replicas (gradient all-reduce).

The DP group is the subtle one. Averaging gradients over "every rank that holds this stage"
would add up different TP shards (other heads, other MLP columns) that happen to have the same
shape: no error, and a model that silently trains wrong. Only replicas of the same stage *and*
the same shard hold the same parameters.

Only torch.distributed primitives are used (new_group, all_reduce, isend, recv). Training
with it against one process, the bytes each group moves and the bound that rounding sets are in
three_d_check.py; tests/test_three_d.py checks them. To run DP x TP x PP = 2 x 2 x 2:
`python -m snippets.scratch.three_d_check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import product

import torch.distributed as dist

from snippets.dist import DEFAULT_TIMEOUT_S
from snippets.models.gpt import GPT, ConfigError
from snippets.scratch.ddp import make_buckets  # noqa: F401 - average_gradients takes its buckets
from snippets.scratch.pipeline import split_into_stages
from snippets.scratch.tensor_parallel import apply_tensor_parallel


# --8<-- [start:mesh]
@dataclass(frozen=True)
class Mesh:
    """How world_size = dp * pp * tp ranks are laid out: rank = ((d * pp) + p) * tp + t.

    `order` lists the axes from outermost (changes slowest with the rank) to innermost.
    TP is innermost because it talks most (two all-reduces of activations per layer, forward
    and backward, on the critical path): torchrun and SLURM put consecutive ranks on one node,
    so a TP group rides the fastest links (NVLink). PP sends one activation per micro-batch to
    a neighbour; DP all-reduces the gradients once per step, overlappable with backward.
    A fourth axis, context parallelism (cp, context_parallel_gpt.py), joins when it is named
    in `order`: its ring passes keys and values every layer, so it sits next to TP.
    """

    dp: int
    pp: int
    tp: int
    order: tuple = ("dp", "pp", "tp")
    cp: int = 1

    def __post_init__(self):
        axes = {"dp", "pp", "tp"} | ({"cp"} if self.cp > 1 else set())
        if not axes <= set(self.order) <= axes | {"cp"} or len(set(self.order)) != len(self.order):
            raise ConfigError(f"order={self.order} must name each of {sorted(axes)} once")
        for axis in self.order:
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise ConfigError(f"{axis}={getattr(self, axis)!r} must be a positive integer")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def coords(self, rank: int) -> dict:
        """{"dp": d, "pp": p, "tp": t} of a rank: its digits in the mixed base of `order`."""
        coords = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, getattr(self, axis))
        return coords

    def rank(self, **coords) -> int:  # the inverse of coords
        rank = 0
        for axis in self.order:
            rank = rank * getattr(self, axis) + coords[axis]
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks whose other coordinates are all equal."""
        others = [a for a in self.order if a != axis]
        return [[self.rank(**{axis: i}, **dict(zip(others, fixed)))
                 for i in range(getattr(self, axis))]
                for fixed in product(*(range(getattr(self, a)) for a in others))]

    def table(self) -> str:
        lines = ["rank  dp pp tp  TP group  PP group  DP group"]
        for r in range(self.size):
            c = self.coords(r)
            mine = [next(g for g in self.groups(a) if r in g) for a in ("tp", "pp", "dp")]
            lines.append(f"{r:>4}  {c['dp']:>2} {c['pp']:>2} {c['tp']:>2}  "
                         + "  ".join(f"{str(g):<8}" for g in mine).rstrip())
        return "\n".join(lines)


def build_groups(mesh: Mesh, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """This rank's {"dp", "pp", "tp"} process groups (and "cp"), all cut from the one mesh.

    new_group is itself a collective over the whole world: every rank must create every group,
    its own or not, in the same order, or the ranks wait for each other until the timeout.
    A group's timeout is not inherited from the world's (gloo's default is 30 minutes): pass it.
    """
    if dist.get_world_size() != mesh.size:
        sizes = "*".join(str(getattr(mesh, a)) for a in mesh.order)
        raise ConfigError(f"world size {dist.get_world_size()} is not {'*'.join(mesh.order)} = "
                          f"{sizes} = {mesh.size}; start {mesh.size} "
                          "processes, or choose sizes whose product is the world size")
    mine, rank = {}, dist.get_rank()
    for axis in [a for a in ("tp", "cp", "pp", "dp") if a in mesh.order]:
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                mine[axis] = group
    return mine
# --8<-- [end:mesh]


# --8<-- [start:parallelize]
def parallelize_3d(model: GPT, mesh: Mesh, groups: dict):
    """TP inside every block, then this rank's pipeline stage. The model is the plain GPT;
    the training loop below never looks inside it. Returns (stage, TensorParallelCommStats)."""
    tp_stats = apply_tensor_parallel(model, groups["tp"])
    stage = split_into_stages(model, mesh.pp)[mesh.coords(dist.get_rank())["pp"]]
    return stage, tp_stats


def average_gradients(buckets: list, group) -> int:
    """Mean of the gradients over `group`: ddp.py's buckets, all-reduced over a group instead
    of the world. Returns the payload in bytes."""
    size, sent = dist.get_world_size(group), 0
    for bucket in buckets:
        bucket.pack()
        dist.all_reduce(bucket.buffer, group=group)
        bucket.unpack(1 / size)
        sent += bucket.buffer.numel() * bucket.buffer.element_size()
    return sent
# --8<-- [end:parallelize]
