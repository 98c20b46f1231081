"""The flat groups FSDP from scratch (snippets/scratch/fsdp.py) moves, and the mixed-precision
policy that sets their dtypes.

A group is one unit's parameters of one kind (sharded or replicated, param dtype or fp32) in one
flat buffer (FlatShard, snippets/scratch/flat_shard.py): gathered, computed and reduced together,
because one collective moves one dtype and only sharded buffers are cut into N pieces.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from snippets.scratch.flat_shard import CommStats, FlatShard


# --8<-- [start:policy]
@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32  # weights are gathered and computed in this dtype
    reduce_dtype: torch.dtype = torch.float32  # gradients are summed over ranks in this dtype
    fp32_modules: tuple[type, ...] = ()  # modules (norms) whose weights stay fp32, computed in fp32

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            if not getattr(self, name).is_floating_point:
                raise ValueError(f"{name}={getattr(self, name)} is not a floating-point dtype: "
                                 "use torch.float32, torch.bfloat16 or torch.float16")
# --8<-- [end:policy]


# --8<-- [start:flat-group]
class FlatGroup:
    """Parameters gathered, computed and reduced together through one flat buffer, either
    sharded (rank r keeps elements [rS, (r + 1)S) of it) or replicated (every rank keeps all).

    `master` (fp32) is the only persistent copy of the weights; `compute`, the full buffer in
    the compute dtype, holds memory only from gather() to free(). Each parameter is, in turn,
    a view of `compute` in its own shape (to_full) or its fp32 slice of `master` (to_shards)."""

    def __init__(self, params, dtype, reduce_dtype, sharded: bool, comm: CommStats):
        self.flat = FlatShard(params)  # padded; rank 0's initial weights on every rank
        self.dtype, self.reduce_dtype, self.sharded, self.comm = dtype, reduce_dtype, sharded, comm
        self.shapes = [p.shape for p in params]
        lo, hi = (self.flat.lo, self.flat.hi) if sharded else (0, self.flat.full.numel())
        self.master = self.flat.full[lo:hi].clone()
        self.compute = torch.empty_like(self.flat.full, dtype=dtype)
        self.views = self.flat.unflatten(self.compute)  # stay valid while the storage resizes
        self.nbytes = self.compute.untyped_storage().nbytes()
        self.flat.full.untyped_storage().resize_(0)  # the fp32 full copy is never used again
        # Where each parameter's elements lie inside this rank's [lo, hi), clipped to it.
        starts = itertools.accumulate(self.flat.sizes, initial=0)
        self.pieces = [(min(max(s - lo, 0), hi - lo), min(max(s + n - lo, 0), hi - lo))
                       for s, n in zip(starts, self.flat.sizes)]
        self.grad = None  # fp32 averaged gradient of `master`; each p.grad is a slice of it
        self.in_flight = None  # (work, input) of an all-gather not yet waited for
        self.gathered = True
        self.free()
        self.to_shards()

    def gather(self) -> None:
        """Start filling `compute` with the full weights; wait() before reading them."""
        if self.gathered:
            return
        self.compute.untyped_storage().resize_(self.nbytes)
        if self.sharded:
            self.comm.count("all_gather", self.compute)
            send = self.master.to(self.dtype)  # cast first: the all-gather moves param_dtype
            self.in_flight = dist.all_gather_single(self.compute, send, async_op=True), send
        else:
            self.compute.copy_(self.master)
        self.gathered = True

    def wait(self) -> None:
        if self.in_flight is not None:
            self.in_flight[0].wait()
            self.in_flight = None

    def free(self) -> None:
        self.wait()  # never release memory an all-gather is still writing into
        if self.gathered:
            self.compute.untyped_storage().resize_(0)
            self.gathered = False

    def to_full(self) -> None:
        if any(p.grad is None for p in self.flat.params):
            self.grad = None  # zero_grad() set them to None: start a fresh gradient
        for p, view in zip(self.flat.params, self.views):
            p.grad = None  # a shard-shaped .grad must not meet backward's full-shaped one
            p.data = view

    def to_shards(self) -> None:
        for p, (a, b) in zip(self.flat.params, self.pieces):
            p.data = self.master[a:b]
            p.grad = None if self.grad is None else self.grad[a:b]

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum the full gradients over ranks in reduce_dtype; keep this rank's part, averaged."""
        full = self.flat.flat_grad().to(self.reduce_dtype)
        if self.sharded:
            received = torch.empty(self.master.numel(), dtype=self.reduce_dtype)
            self.comm.reduce_scatter(received, full)
        else:
            self.comm.all_reduce(full)
            received = full
        received = (received / dist.get_world_size()).float()  # the mean, as one process sees
        self.grad = received if self.grad is None else self.grad.add_(received)  # accumulation
        for p in self.flat.params:
            p.grad = None  # the full gradients are freed
# --8<-- [end:flat-group]
