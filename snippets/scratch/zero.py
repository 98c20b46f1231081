"""ZeRO from scratch: shard the optimizer state, then the gradients, then the parameters.

Data parallelism (snippets/scratch/ddp.py) keeps a full copy of the model state on every rank:
fp32 weights (4 bytes per parameter), their gradients (4) and AdamW's two moments (8), so 16 bytes
per parameter on each of N ranks. ZeRO (Rajbhandari et al., 2020) keeps each piece on one rank
only, in three stages:

1. ZeRO1Optimizer: the parameters are laid end to end in one flat buffer and each rank owns a
   contiguous 1/N of it. AdamW's moments exist only for that shard. Gradients are all-reduced as
   in DDP, each rank updates its shard, and the updated shards are all-gathered into every rank's
   full buffer.
2. ZeRO2Optimizer: + gradients sharded. During backward, each bucket of gradients is
   reduce-scattered as soon as it is complete: a rank receives the averaged gradient of its own
   shard only, and the full gradients are freed.
3. ZeRO3: + parameters sharded. Applied to a plain model, it turns every transformer block (and the
   rest of the model) into a unit whose weights live only as shards. A unit's weights are
   all-gathered just before its forward and freed after; all-gathered again for its backward;
   its gradients are reduce-scattered and freed.

Every collective goes through a CommStats object that counts the bytes each rank sends, so the
traffic can be compared with the paper's formulas. Only torch.distributed primitives are used
(all_reduce, all_gather_single, reduce_scatter_single); tests/test_zero.py checks every stage
against single-process AdamW training.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from snippets.planner.memory import BYTES_PER_PARAM


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

    def __init__(self):
        self.bytes = defaultdict(int)  # collective name -> bytes sent by this rank
        self.calls = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def count(self, kind: str, full: torch.Tensor) -> None:
        n = dist.get_world_size()
        share = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
                 "reduce_scatter": (n - 1) / n}[kind]
        self.bytes[kind] += round(share * full.numel() * full.element_size())
        self.calls[kind] += 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.count("all_reduce", tensor)
        dist.all_reduce(tensor)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full <- every rank's shard, end to end (rank r's at offset r * shard.numel())."""
        self.count("all_gather", full)
        dist.all_gather_single(full, shard)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard <- the sum over ranks of this rank's slice of full."""
        self.count("reduce_scatter", full)
        dist.reduce_scatter_single(shard, full)

    def total(self) -> int:
        return sum(self.bytes.values())
# --8<-- [end:comm]


# --8<-- [start:flat-shard]
class FlatShard:
    """A group of parameters laid end to end in one flat buffer, padded with zeros to a multiple
    of the world size N, so that it splits into N equal contiguous shards; rank r owns
    flat[r * S:(r + 1) * S]. Afterwards the parameters are views into `full`, so writing
    into `full` (an all-gather) writes the model's weights."""

    def __init__(self, params: list[nn.Parameter]):
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
        world, rank = dist.get_world_size(), dist.get_rank()
        self.shard_numel = math.ceil(self.numel / world)  # the last shard carries the padding
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.full = torch.zeros(self.shard_numel * world, dtype=params[0].dtype,
                                device=params[0].device)
        with torch.no_grad():
            torch.cat([p.reshape(-1) for p in params], out=self.full[:self.numel])
        # Replicas must start equal, as in DDP: everyone takes rank 0's initial weights (once,
        # at construction, so CommStats does not count it as per-step traffic).
        dist.broadcast(self.full, src=0)
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


# --8<-- [start:zero1]
class ZeRO1Optimizer:
    """Stage 1: AdamW state for 1/N of the parameters on each rank.

    Usage is an optimizer's: loss.backward(); optimizer.step(); optimizer.zero_grad().
    """

    def __init__(self, params, comm: CommStats | None = None, **adamw_kwargs):
        params = [p for p in params if p.requires_grad]
        self.flat = FlatShard(params)
        self.comm = comm or CommStats()
        # One flat gradient buffer; each p.grad is a view into it, so backward accumulates
        # straight into the buffer and the all-reduce needs no packing copy.
        self.flat_grads = torch.zeros_like(self.flat.full)
        for p, g in zip(params, self.flat.unflatten(self.flat_grads)):
            p.grad = g
        # The shard is a view of the weights too: AdamW updates this rank's slice in place.
        self.shard = nn.Parameter(self.flat.local(self.flat.full))
        self.shard.grad = self.flat.local(self.flat_grads)
        self.optimizer = torch.optim.AdamW([self.shard], **adamw_kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for p, g in zip(self.flat.params, self.flat.unflatten(self.flat_grads)):
            if p.grad is None or p.grad.data_ptr() != g.data_ptr():
                # .grad was set to None or replaced (model.zero_grad()): back into the buffer
                g.copy_(p.grad if p.grad is not None else torch.zeros_like(g))
                p.grad = g
        # --8<-- [start:zero1-step]
        self.comm.all_reduce(self.flat_grads)  # every rank gets the summed gradient...
        self.flat_grads /= dist.get_world_size()  # ...then the mean, as in DDP
        self.optimizer.step()  # AdamW on this rank's shard only: 1/N of the moments exist here
        shard = self.flat.local(self.flat.full)
        self.comm.all_gather(self.flat.full, shard)  # every rank gets every updated shard
        # --8<-- [end:zero1-step]

    def zero_grad(self) -> None:
        self.flat_grads.zero_()  # in place: the parameters' .grad stay views into it
# --8<-- [end:zero1]


# --8<-- [start:zero2]
class ZeRO2Optimizer:
    """Stage 2: + each rank keeps only its shard of the averaged gradients.

    Parameters are grouped into buckets of about bucket_cap_mb, each its own FlatShard. When
    backward has produced every gradient of a bucket, a hook reduce-scatters the bucket (this
    rank receives the summed gradient of its shard only) and frees the full gradients, so at most
    one bucket of full gradients exists at a time.
    """

    def __init__(self, params, comm: CommStats | None = None, bucket_cap_mb: float = 25,
                 **adamw_kwargs):
        params = [p for p in params if p.requires_grad]
        self.comm = comm or CommStats()
        self.buckets = [FlatShard(group) for group in buckets_by_size(params, bucket_cap_mb)]
        self.shards = [nn.Parameter(b.local(b.full)) for b in self.buckets]
        self.optimizer = torch.optim.AdamW(self.shards, **adamw_kwargs)
        self.ready = [0] * len(self.buckets)  # gradients of each bucket produced in this backward
        self.reduced = [False] * len(self.buckets)  # reduced since the last step?
        for i, bucket in enumerate(self.buckets):
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    @torch.no_grad()
    def _grad_ready(self, i: int) -> None:
        self.ready[i] += 1
        bucket, shard = self.buckets[i], self.shards[i]
        if self.ready[i] < len(bucket.params):
            return
        received = torch.empty_like(shard)
        self.comm.reduce_scatter(received, bucket.flat_grad())
        received /= dist.get_world_size()
        if shard.grad is None:
            shard.grad = received
        else:  # gradient accumulation: add this micro-batch's averaged gradient
            shard.grad += received
        for p in bucket.params:
            p.grad = None  # the full gradient is gone; only this rank's shard remains
        self.ready[i], self.reduced[i] = 0, True

    @torch.no_grad()
    def step(self) -> None:
        if not all(self.reduced):
            raise RuntimeError("some buckets were not reduced since the last step: every "
                               "parameter must receive a gradient in each backward pass")
        self.optimizer.step()
        for bucket in self.buckets:
            self.comm.all_gather(bucket.full, bucket.local(bucket.full))
        self.reduced = [False] * len(self.buckets)

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None


def buckets_by_size(params: list[nn.Parameter], cap_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive groups of about cap_mb, in reverse order: backward produces the last
    layers' gradients first, so those buckets complete first."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() * p.element_size() > cap_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    return buckets + [current] if current else buckets
# --8<-- [end:zero2]


# --8<-- [start:zero3-unit]
class ShardedUnit:
    """The parameters of one module (a transformer block, or the model's remaining weights),
    held as this rank's shard only. `gather()` materialises the full weights, `free()` releases
    them again."""

    def __init__(self, params: list[nn.Parameter], comm: CommStats):
        self.flat = FlatShard(params)
        self.comm = comm
        # The shard is the only persistent copy of these weights: a tensor of its own.
        self.shard = nn.Parameter(self.flat.local(self.flat.full).clone())
        self.full_bytes = self.flat.full.untyped_storage().nbytes()
        self.gathered = True
        self.ready = 0
        self.free()

    def gather(self) -> None:
        if not self.gathered:
            # Re-grow the storage the parameters (and autograd's saved views of them) point to,
            # then fill it: the views see the weights again, without being re-created.
            self.flat.full.untyped_storage().resize_(self.full_bytes)
            self.comm.all_gather(self.flat.full, self.shard.detach())
            self.gathered = True

    def free(self) -> None:
        if self.gathered:
            self.flat.full.untyped_storage().resize_(0)  # the bytes are released now
            self.gathered = False

    @torch.no_grad()
    def grad_ready(self) -> None:
        """Post-accumulate hook of each parameter: once all are in, reduce-scatter and free."""
        self.ready += 1
        if self.ready < len(self.flat.params):
            return
        self.ready = 0
        received = torch.empty_like(self.shard)
        self.comm.reduce_scatter(received, self.flat.flat_grad())
        received /= dist.get_world_size()
        if self.shard.grad is None:
            self.shard.grad = received
        else:  # gradient accumulation
            self.shard.grad += received
        for p in self.flat.params:
            p.grad = None
        self.free()
# --8<-- [end:zero3-unit]


# --8<-- [start:zero3]
class ZeRO3:
    """Stage 3: + parameters sharded. Wraps a plain model; call it like the model, and give
    `parameters()` (this rank's shards) to any optimizer:

        model = ZeRO3(GPT(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    Each module in `units` (default: `model.layers`, the transformer blocks) becomes one unit;
    the model's remaining parameters (embeddings, final norm) form the root unit.
    """

    def __init__(self, model: nn.Module, units=None, comm: CommStats | None = None):
        self.module = model
        self.comm = comm or CommStats()
        modules = list(units if units is not None else getattr(model, "layers", []))
        claimed, self.units = set(), []
        for module in [*modules, model]:  # blocks first: the root takes what is left
            params = [p for p in module.parameters()
                      if p.requires_grad and id(p) not in claimed]
            claimed.update(id(p) for p in params)
            unit = ShardedUnit(params, self.comm)
            self.units.append(unit)
            module.register_forward_pre_hook(lambda m, args, unit=unit: unit.gather())
            module.register_forward_hook(
                lambda m, args, out, unit=unit: self._after_forward(unit, out))
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: unit.grad_ready())

    def _after_forward(self, unit: ShardedUnit, output) -> None:
        unit.free()
        # Backward reaches this unit when the gradient of its output has been computed: gather
        # the weights again at that moment (a hook on the output tensors), just in time.
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, unit=unit: (unit.gather(), grad)[1])

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered unit by unit (every rank must call this)."""
        for unit in self.units:
            unit.gather()
        state = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        for unit in self.units:
            unit.free()
        return state


def tensors_in(output) -> list[torch.Tensor]:
    """The tensors in a module's output: a tensor, or tuples/lists/dicts of them."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in tensors_in(item)]
    return []
# --8<-- [end:zero3]


# --8<-- [start:measure]
def model_state_bytes(model: nn.Module, optimizer, local=lambda tensor: tensor) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from the
    storages of the tensors it can reach (each storage once; a freed storage has 0 bytes).
    `local` maps a library's sharded tensor to this rank's piece (the benchmark's FSDP2 row)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO1/2Optimizer wrap an AdamW
    params = [*model.parameters(), *(p for group in inner.param_groups for p in group["params"])]
    held, seen = {"params": 0, "grads": 0, "optimizer": 0}, set()

    def count(kind: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = local(tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    for p in params:
        count("params", p)
    for p in params:
        count("grads", p.grad)
    for state in inner.state.values():
        for value in state.values():
            count("optimizer", value)
    held["total"] = sum(held.values())
    return held


def expected_model_state_bytes(stage: int, num_params: int, world_size: int,
                               precision: str = "fp32") -> dict[str, float]:
    """The paper's per-rank model-state memory. stage 0 is plain data parallelism."""
    per_param = BYTES_PER_PARAM[precision]
    table_name = {"params": "weights", "grads": "gradients", "optimizer": "optimizer"}
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    out = {kind: per_param[table_name[kind]] * num_params / (world_size if sharded[kind] else 1)
           for kind in table_name}
    out["total"] = sum(out.values())
    return out


def expected_traffic_bytes(stage: int, num_params: int, world_size: int,
                           bytes_per_elem: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step (ring volumes, see CommStats) for this file's stages."""
    size, f = num_params * bytes_per_elem, (world_size - 1) / world_size
    return {
        0: {"all_reduce": 2 * f * size},  # DDP
        1: {"all_reduce": 2 * f * size, "all_gather": f * size},  # as built here: 1.5x DDP
        2: {"reduce_scatter": f * size, "all_gather": f * size},  # = DDP's volume
        3: {"reduce_scatter": f * size, "all_gather": 2 * f * size},  # 1.5x DDP
    }[stage]
# --8<-- [end:measure]


if __name__ == "__main__":
    from snippets.scratch.zero_check import main

    main()
