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

The flat buffer (FlatShard) and the collectives that count the bytes each rank sends (CommStats)
are in snippets/scratch/flat_shard.py. Only torch.distributed primitives are used (all_reduce,
all_gather_single, reduce_scatter_single); tests/test_zero.py checks every stage against
single-process AdamW training, and `python -m snippets.bench.zero_check` shows it on 2 ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from snippets.scratch.flat_shard import CommStats, FlatShard


# --8<-- [start:zero1]
class ZeRO1Optimizer:
    """Stage 1: AdamW state for 1/N of the parameters on each rank.

    Usage is an optimizer's: loss.backward(); optimizer.step(); optimizer.zero_grad().
    """

    def __init__(self, params, comm: CommStats | None = None, **adamw_kwargs):
        """params: the model's parameters (those that do not require grad are left alone);
        comm runs and counts the collectives (a new CommStats when None); adamw_kwargs (lr,
        betas, weight_decay, ...) go to torch.optim.AdamW. Every rank constructs it at once:
        the FlatShard that lays the parameters end to end starts every rank from rank 0's
        weights, and this rank's AdamW covers its own 1/N of them only."""
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
        """Average the gradients over the ranks, update this rank's shard with AdamW, and
        all-gather the updated shards: every rank then holds the weights single-process AdamW
        gives on the global batch, and each p.grad the gradient's mean over the ranks. One
        all-reduce and one all-gather per step, made through self.comm, which counts them."""
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
        """Zero every gradient, ready for the next backward to accumulate into."""
        self.flat_grads.zero_()  # in place: the parameters' .grad stay views into it
# --8<-- [end:zero1]


# --8<-- [start:sharded-optimizer]
class ShardedOptimizer:
    """ZeRO-1 inside a trainer (training/parallel_trainer.py --zero 1): any torch optimizer,
    each of its param groups laid end to end in a FlatShard over `group` (the DP ranks), and
    stepped on this rank's slice only.

    ZeRO1Optimizer above averages the gradients itself. A trainer averages them earlier, in its
    forward_backward, and clips their global norm before it steps; what ZeRO-1 adds after that
    is its own part: the update of one shard, with the optimizer's state for that shard only,
    and the all-gather of the updated shards."""

    def __init__(self, optimizer: torch.optim.Optimizer, group=None,
                 comm: CommStats | None = None):
        self.comm = comm or CommStats(group)
        self.flats, groups = [], []
        for options in optimizer.param_groups:
            flat = FlatShard(options["params"], group)
            grads = torch.zeros_like(flat.full)  # each p.grad a view into it, as in ZeRO1
            for p, g in zip(flat.params, flat.unflatten(grads)):
                p.grad = g
            shard = nn.Parameter(flat.local(flat.full))
            shard.grad = flat.local(grads)
            self.flats.append((flat, grads, shard))
            groups.append({**options, "params": [shard]})
        self.optimizer = type(optimizer)(groups)  # the same optimizer, settings and groups
        self.param_groups = self.optimizer.param_groups  # the trainer sets the lr here

    @torch.no_grad()
    def step(self) -> None:
        for flat, grads, _ in self.flats:
            for p, g in zip(flat.params, flat.unflatten(grads)):
                if p.grad is not None and p.grad.data_ptr() != g.data_ptr():
                    g.copy_(p.grad)  # backward replaced the view: back into the buffer
                    p.grad = g
        self.optimizer.step()  # this rank's slice of every group, its state for it only
        for flat, _, _ in self.flats:
            self.comm.all_gather(flat.full, flat.local(flat.full))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero in place whatever set_to_none says: the gradients stay views into the flat
        buffers that the shards' gradients are slices of."""
        for _, grads, _ in self.flats:
            grads.zero_()

    def full_state(self) -> dict:
        """{parameter: its optimizer state} as a one-process optimizer would hold it: every
        per-element tensor (AdamW's two moments, SGD's momentum) all-gathered over the group
        and cut back into the parameters' shapes; scalars (AdamW's step) as they are. Every
        rank of the group calls it."""
        out = {}
        for flat, _, shard in self.flats:
            per_param = [{} for _ in flat.params]
            for key, value in self.optimizer.state.get(shard, {}).items():
                if value.shape != shard.shape:
                    full_pieces = [value.clone() for _ in flat.params]
                else:
                    full = torch.empty_like(flat.full)
                    self.comm.all_gather(full, value.contiguous())
                    full_pieces = [t.clone() for t in flat.unflatten(full)]
                for state, piece in zip(per_param, full_pieces):
                    state[key] = piece
            out.update(zip(flat.params, per_param))
        return out

    def load_full_state(self, states: dict) -> None:
        """The inverse of full_state: {parameter: its optimizer state} -> this rank's slices.
        Parameters missing from `states` leave their group's state empty (a fresh start)."""
        for flat, _, shard in self.flats:
            if not all(p in states for p in flat.params):
                continue
            shard_state = {}
            for key, value in states[flat.params[0]].items():
                if value.dim() == 0:
                    shard_state[key] = value.clone()
                    continue
                full = torch.zeros_like(flat.full)
                torch.cat([states[p][key].reshape(-1) for p in flat.params],
                          out=full[:flat.numel])
                shard_state[key] = flat.local(full).clone()
            self.optimizer.state[shard] = shard_state
# --8<-- [end:sharded-optimizer]


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
