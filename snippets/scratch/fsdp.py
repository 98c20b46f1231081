"""FSDP from scratch: ZeRO-3 (snippets/scratch/zero.py) grown into what training needs.

- Mixed precision: each unit's weights are all-gathered and computed in a param dtype (bf16),
  its gradients reduce-scattered in a reduce dtype; the fp32 master shards are the only
  persistent copy of the weights, and the optimizer's state is fp32 like them. Modules of the
  types in `fp32_modules` (norms) keep fp32 weights and compute in fp32.
- The model's own parameters are the shards. Between steps every `nn.Parameter` of the model
  holds this rank's fp32 elements of it (a 1-D slice, empty on a rank that holds none), and
  after backward its `.grad` holds their averaged gradient. Any `torch.optim` optimizer, with
  parameter groups, built over `model.parameters()` therefore updates exactly this rank's shard;
  `FSDP.clip_grad_norm_` clips by the norm of the whole gradient, all ranks together.
- Parameters with fewer than `replicate_below` elements (norm gains, biases) are kept whole on
  every rank, their gradients all-reduced, as in DDP: sharding them saves almost no memory,
  and whole they need no all-gathers (one all-reduce a step instead of two all-gathers and a
  reduce-scatter).
- Prefetch: the all-gather of the next unit (in forward: the next block; in backward: the
  previous one) is issued, asynchronously, before the current unit computes, so the two overlap.

A unit's parameters lie in flat groups (snippets/scratch/fsdp_flat_group.py, with the
mixed-precision policy), one per kind: sharded or replicated, param dtype or fp32.
tests/test_fsdp_scratch.py checks the result against one process, and against PyTorch's own
implementation at the same dtypes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from snippets.scratch.flat_shard import CommStats
from snippets.scratch.fsdp_flat_group import FlatGroup, MixedPrecision
from snippets.scratch.zero import tensors_in


# --8<-- [start:unit]
class Unit:
    """One module's parameters (a block, or what the root has left), in one flat group per
    kind: sharded or replicated, param dtype or fp32."""

    def __init__(self, name, module, params, mp: MixedPrecision, replicate_below, fp32_ids,
                 comm):
        self.name, self.module, self.params, self.grads_in = name, module, params, 0
        kinds = {}
        for p in params:
            dtype = torch.float32 if id(p) in fp32_ids else mp.param_dtype
            kinds.setdefault((p.numel() >= replicate_below, dtype), []).append(p)
        self.groups = [FlatGroup(ps, dtype, mp.reduce_dtype, sharded, comm)
                       for (sharded, dtype), ps in kinds.items()]

    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    def waiting(self) -> bool:
        return any(g.in_flight is not None for g in self.groups)

    def apply(self, method: str) -> None:
        for group in self.groups:
            getattr(group, method)()
# --8<-- [end:unit]


# --8<-- [start:fsdp]
class FSDP:
    """Shards a plain model in place; call the model (or this object) as before:

        fsdp = FSDP(model, mp=MixedPrecision(param_dtype=torch.bfloat16))
        optimizer = torch.optim.AdamW(groups, lr=3e-4)  # any optimizer, parameter groups
        model(inputs, targets)[1].backward(); fsdp.clip_grad_norm_(1.0); optimizer.step()

    The parameters are 1-D shards once wrapped: build groups that depend on a parameter's
    shape before wrapping (they are the same Parameter objects), or by name.

    Each module in `units` (default: `model.layers`) becomes one unit, the model's remaining
    parameters the root unit. Units are assumed to run in the order given.
    """

    def __init__(self, model: nn.Module, units=None, mp: MixedPrecision = MixedPrecision(),
                 replicate_below: int = 0, prefetch: bool = True, comm: CommStats | None = None):
        if replicate_below < 0:
            raise ValueError(f"replicate_below={replicate_below} must be >= 0 (0: shard all)")
        self.module, self.prefetch, self.comm = model, prefetch, comm or CommStats()
        self.timeline = None  # set to a list to record (time, event, unit) on this rank
        self.param_names = {id(p): name for name, p in model.named_parameters()}
        self.unreduced = set()  # units that ran forward for a backward and are not reduced yet
        self.backward_check_queued = False
        blocks = list(units if units is not None else getattr(model, "layers", []))
        names = {id(m): name or "root" for name, m in model.named_modules()}
        fp32_ids = {id(p) for m in model.modules() if isinstance(m, mp.fp32_modules)
                    for p in m.parameters()}
        owner = {}
        for module in [*reversed(blocks), model]:  # blocks first: the root takes what is left
            for p in module.parameters():
                owner.setdefault(id(p), module)
        self.units = []
        for module in [model, *blocks]:  # forward order: the root runs first
            params = [p for p in module.parameters() if p.requires_grad and owner[id(p)] is module]
            if params:
                self.units.append(Unit(names[id(module)], module, params, mp, replicate_below,
                                       fp32_ids, self.comm))
        if not self.units:
            raise ValueError("got no parameters to shard: the model has no trainable parameters")
        self.next_forward = dict(zip(self.units, self.units[1:]))
        backward = ([u for u in self.units if u.module is model]
                    + [u for u in reversed(self.units) if u.module is not model])
        self.next_backward = dict(zip(backward, backward[1:]))
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda m, args, u=unit: self._before_forward(u))
            unit.module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
        for m in model.modules():
            if isinstance(m, mp.fp32_modules) and mp.param_dtype != torch.float32:
                m.register_forward_pre_hook(lambda m, args: tuple(
                    a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
                m.register_forward_hook(lambda m, args, out: out.to(mp.param_dtype))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _log(self, event: str, unit: Unit) -> None:
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), event, unit.name))

    def _gather(self, unit: Unit | None) -> None:
        if unit is not None and not unit.gathered():
            self._log("all-gather issued", unit)
            unit.apply("gather")

    def _ready(self, unit: Unit, next_unit: Unit | None) -> None:
        """Make `unit` whole, and start the next unit's all-gather before `unit` computes."""
        self._gather(unit)
        if self.prefetch:
            self._gather(next_unit)
        if unit.waiting():
            self._log("wait", unit)
            unit.apply("wait")
            self._log("ready", unit)

    def _before_forward(self, unit: Unit) -> None:
        self._ready(unit, self.next_forward.get(unit))
        unit.apply("to_full")
        self._log("forward", unit)

    def _after_forward(self, unit: Unit, output) -> None:
        unit.apply("free")
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if not outputs:  # no backward will come (evaluation, torch.no_grad)
            unit.apply("to_shards")
        else:
            self.unreduced.add(unit)
        for t in outputs:  # backward reaches this unit when its output's gradient is known
            t.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit: Unit) -> None:
        if not self.backward_check_queued:  # the first hook of this backward
            self.backward_check_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._check_all_reduced)
        if unit.gathered() and not unit.waiting():
            return  # a second output of the same unit (the loss and the logits)
        self._ready(unit, self.next_backward.get(unit))
        self._log("backward", unit)

    @torch.no_grad()
    def _grad_ready(self, unit: Unit) -> None:
        unit.grads_in += 1
        if unit.grads_in < len(unit.params):
            return
        unit.grads_in = 0
        self._log("reduce-scatter", unit)
        for method in ("reduce", "free", "to_shards"):
            unit.apply(method)
        self.unreduced.discard(unit)

    def _check_all_reduced(self) -> None:
        """At the end of backward: a unit is reduced when all its parameters' gradients are in,
        so one parameter without a gradient (unused this step, an expert no token chose) would
        leave the whole unit unreduced, its gradients missing on every rank, without a word."""
        self.backward_check_queued = False
        missing = [(unit, [self.param_names[id(p)] for p in unit.params if p.grad is None])
                   for unit in self.units if unit in self.unreduced]
        if missing:
            unit, names = missing[0]
            raise RuntimeError(
                f"FSDP unit {unit.name!r} was not reduced: backward gave no gradient to "
                f"{', '.join(names) or 'its parameters'}. Every parameter of a unit must take part "
                "in the loss each step; remove the unused ones, or freeze them (requires_grad=False) "
                "before wrapping")
# --8<-- [end:fsdp]

    # --8<-- [start:clip]
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (total + 1e-6)), where total is the norm
        of the whole model's gradient (all ranks' shards together); return total, as
        torch.nn.utils.clip_grad_norm_ does for one process."""
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm} must be > 0")
        groups = [g for unit in self.units for g in unit.groups]
        sharded, replicated = ([p.grad for g in groups if g.sharded is kind for p in g.flat.params]
                               for kind in (True, False))
        squares = sum((grad.pow(2).sum() for grad in sharded), torch.zeros(()))
        # Each sharded element lives on one rank: sum the squares over ranks. A replicated
        # element lives on every rank with the same value, and is counted once.
        self.comm.all_reduce(squares)
        total = (squares + sum((grad.pow(2).sum() for grad in replicated), torch.zeros(()))).sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in sharded + replicated:
            grad.mul_(scale)
        return total
    # --8<-- [end:clip]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 weights, by name (every rank must call this)."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        state = {}
        for g in (g for unit in self.units for g in unit.groups):
            full = g.master
            if g.sharded:
                full = torch.empty(g.master.numel() * dist.get_world_size())
                self.comm.all_gather(full, g.master)
            for p, t, shape in zip(g.flat.params, full[:g.flat.numel].split(g.flat.sizes),
                                   g.shapes):
                state[names[id(p)]] = t.view(shape).clone()
        return state
