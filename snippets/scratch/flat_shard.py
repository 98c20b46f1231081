"""What every ZeRO stage in snippets/scratch/zero.py is built from.

- CommStats runs the three collectives ZeRO needs (all_reduce, all_gather_single,
  reduce_scatter_single) and counts the bytes each rank sends, so the traffic can be compared
  with the paper's formulas (snippets/bench/zero_accounting.py has them).
- FlatShard lays a group of parameters end to end in one flat buffer, padded so that it splits
  into one equal contiguous shard per rank.

Only torch.distributed primitives are used.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn


# --8<-- [start:comm]
class CommStats:
    """Runs the collectives ZeRO needs and counts the bytes each rank sends.

    "Bytes" means payload bytes sent by one rank under the ring algorithm, for a tensor of
    `size` bytes (the full tensor: the all-reduced buffer, the gathered output, the
    reduce-scattered input) on N ranks:

    - all-reduce sends 2(N-1)/N * size (a reduce-scatter pass, then an all-gather pass);
    - all-gather and reduce-scatter each send (N-1)/N * size.

    gloo and NCCL may pick other algorithms (trees, direct exchange); these are the volumes the
    ZeRO paper's analysis uses, and the lower bounds for large messages.
    """

    def __init__(self, group=None):
        self.group = group  # the ranks that share the shards: None means every rank
        self.bytes = defaultdict(int)  # collective name -> bytes sent by this rank
        self.calls = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def count(self, kind: str, full: torch.Tensor) -> None:
        n = dist.get_world_size(self.group)
        share = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                 "reduce_scatter": (n - 1) / n}[kind]
        self.bytes[kind] += round(share * full.numel() * full.element_size())
        self.calls[kind] += 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.count("all_reduce", tensor)
        dist.all_reduce(tensor, group=self.group)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full <- every rank's shard, end to end (rank r's at offset r * shard.numel())."""
        self.count("all_gather", full)
        dist.all_gather_single(full, shard, group=self.group)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard <- the sum over ranks of this rank's slice of full."""
        self.count("reduce_scatter", full)
        dist.reduce_scatter_single(shard, full, group=self.group)

    def total(self) -> int:
        return sum(self.bytes.values())
# --8<-- [end:comm]


# --8<-- [start:flat-shard]
class FlatShard:
    """A group of parameters laid end to end in one flat buffer, padded with zeros to a multiple
    of the world size N, so that it splits into N equal contiguous shards; rank r owns
    flat[r * S:(r + 1) * S]. With a process group, N and r are the group's size and this rank's
    place in it (the parallel trainer shards over its DP ranks). Afterwards the parameters are views into `full`, so writing
    into `full` (an all-gather) writes the model's weights."""

    def __init__(self, params: list[nn.Parameter], group=None):
        if not dist.is_initialized():
            raise RuntimeError(
                "ZeRO shards across the ranks of a process group, and none is initialised: call "
                "torch.distributed.init_process_group(...) first (or start the script with "
                "torchrun and call snippets.dist.init_from_env())")
        if not params:
            raise ValueError("got no parameters to shard: pass model.parameters() of a model that "
                             "has trainable parameters (requires_grad=True)")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"parameters of one flat buffer must share a dtype, got {dtypes}: "
                             "convert the model with model.float() (or .bfloat16()) first")
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = math.ceil(self.numel / world)  # the last shard carries the padding
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.full = torch.zeros(self.shard_numel * world, dtype=params[0].dtype,
                                device=params[0].device)
        with torch.no_grad():
            torch.cat([p.reshape(-1) for p in params], out=self.full[:self.numel])
        # Replicas must start equal, as in DDP: everyone takes rank 0's initial weights (once,
        # at construction, so CommStats does not count it as per-step traffic).
        dist.broadcast(self.full, group=group, group_src=0)
        for p, view in zip(params, self.unflatten(self.full)):
            p.data = view  # the parameter now lives inside the flat buffer

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [t.view_as(p) for t, p in zip(flat[:self.numel].split(self.sizes), self.params)]

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a flat tensor laid out like `full` (a view, no copy)."""
        return flat[self.lo:self.hi]

    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients in one new padded flat tensor."""
        flat = torch.zeros_like(self.full)
        torch.cat([p.grad.reshape(-1) for p in self.params], out=flat[:self.numel])
        return flat
# --8<-- [end:flat-shard]
