"""Sequence parallelism from scratch, Megatron-LM style: shard what tensor parallelism replicates.

Tensor parallelism (snippets/scratch/tensor_parallel.py) splits the matmuls, but between its
regions every rank holds the same whole (B, T, hidden) tensors: the norms' inputs and outputs
and the residual stream. Those ops work token by token, so each rank can keep just T/N of the
tokens instead. The regions' edges change:

- enter (before the column-parallel layers): all-gather the sequence in forward, because
  attention and the matmuls need every token; its gradient is reduce-scattered in backward;
- leave (after the row-parallel layer): reduce-scatter in forward, summing the partial outputs
  and keeping only this rank's tokens; in backward, all-gather the gradients of those tokens.

A ring all-reduce is a reduce-scatter followed by an all-gather, so SP sends exactly the bytes
TP sends, and shards the tensors between the regions for free. One thing is new: a weight
outside the regions (the norms, the embedding) sees only this rank's tokens, so its gradient
is a partial sum, and must be all-reduced over the group.

`apply_sequence_parallel(model)` converts a plain GPT (snippets/models/gpt.py) in place, in two
steps: `parallelize_sequence` splits the blocks and hooks the gradients of the unsplit weights,
and `split_batch_by_sequence` lets every rank be given the whole batch and take its own tokens
(a caller that hands each rank its tokens itself, a pipeline stage, uses the first step alone).
Only torch.distributed primitives are used; tests/test_sequence_parallel.py checks the result
against the single-device model, and sequence_parallel_check.py runs it:

    python -m snippets.scratch.sequence_parallel_check    # 2 ranks against one process, bytes
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from snippets.models.gpt import GPT
from snippets.scratch.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallelCommStats,
    LeaveTensorParallel,
    RowParallelLinear,
    check_tensor_parallel_sizes,
)


# --8<-- [start:stats]
@dataclass
class SequenceCommStats:
    """Collectives issued, by (phase, collective): calls, and the payload of each.

    Payload = the bytes of the whole (B, T, hidden) tensor, what all_reduce would be handed in
    TP. On a ring of N ranks an all-gather or a reduce-scatter of it sends (N-1)/N of that per
    rank, an all-reduce 2(N-1)/N (Week 1, ring all-reduce).
    """

    calls: Counter = field(default_factory=Counter)
    payload: Counter = field(default_factory=Counter)

    def record(self, phase: str, collective: str, tensor: torch.Tensor) -> None:
        self.calls[phase, collective] += 1
        self.payload[phase, collective] += tensor.numel() * tensor.element_size()
# --8<-- [end:stats]


# --8<-- [start:collectives]
def all_gather_sequence(shard: torch.Tensor, group) -> torch.Tensor:
    """(B, T/N, h) on each rank -> (B, T, h), the ranks' tokens in rank order."""
    # all_gather_single stacks along dimension 0, so move the sequence there and back.
    mine = shard.movedim(1, 0).contiguous()
    full = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
    dist.all_gather_single(full, mine, group=group)
    # Contiguous: the matmuls would otherwise each save a contiguous copy of their own.
    return full.movedim(0, 1).contiguous()


def reduce_scatter_sequence(full: torch.Tensor, group) -> torch.Tensor:
    """(B, T, h) partial sums on each rank -> (B, T/N, h): the sum over ranks, my tokens only."""
    everything = full.movedim(1, 0).contiguous()
    mine = everything.new_empty((everything.shape[0] // dist.get_world_size(group),
                                 *everything.shape[1:]))
    dist.reduce_scatter_single(mine, everything, group=group)
    return mine.movedim(0, 1).contiguous()
# --8<-- [end:collectives]


# --8<-- [start:enter-and-leave]
class GatherSequence(torch.autograd.Function):
    """Enter a TP region: all-gather the tokens in forward, reduce-scatter in backward.

    Every rank's column-parallel slice uses every token, so each rank's gradient for a token
    is a partial sum (TP's f all-reduces it); only the token's owner needs the total.
    """

    @staticmethod
    def forward(ctx, shard, group, stats):
        ctx.group, ctx.stats = group, stats
        full = all_gather_sequence(shard, group)
        stats.record("forward", "all_gather", full)
        return full

    @staticmethod
    def backward(ctx, grad):
        ctx.stats.record("backward", "reduce_scatter", grad)
        return reduce_scatter_sequence(grad, ctx.group), None, None


class ScatterSequence(torch.autograd.Function):
    """Leave a TP region: reduce-scatter the partial outputs in forward, all-gather in backward.

    The sum's gradient with respect to each partial term is the gradient itself (TP's g passes
    it through); here each rank holds it only for its own tokens, so gather it first.
    """

    @staticmethod
    def forward(ctx, partial, group, stats):
        ctx.group, ctx.stats = group, stats
        stats.record("forward", "reduce_scatter", partial)
        return reduce_scatter_sequence(partial, group)

    @staticmethod
    def backward(ctx, grad):
        full = all_gather_sequence(grad.contiguous(), ctx.group)
        ctx.stats.record("backward", "all_gather", full)
        return full, None, None
# --8<-- [end:enter-and-leave]


# --8<-- [start:layers]
class RowParallelToSequence(RowParallelLinear):
    """TP's row-parallel layer, the same weight slice, ending in a reduce-scatter."""

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        return ScatterSequence.apply(F.linear(x_shard, self.weight), self.group, self.stats)


def gather_sequence_on_input(module: nn.Module, group, stats: SequenceCommStats) -> None:
    """All-gather the module's input once, before any of its column-parallel layers sees it."""

    def hook(module, args):
        return (GatherSequence.apply(args[0], group, stats), *args[1:])

    module.register_forward_pre_hook(hook)


def parallelize_block(block: nn.Module, group, stats: SequenceCommStats) -> None:
    """Attention heads and MLP columns split as in TP; the norms and residual see T/N tokens."""
    attention, mlp = block.self_attn, block.mlp
    gather_sequence_on_input(attention, group, stats)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))
    attention.o_proj = RowParallelToSequence(attention.o_proj, group, stats)
    gather_sequence_on_input(mlp, group, stats)
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
    mlp.down_proj = RowParallelToSequence(mlp.down_proj, group, stats)
# --8<-- [end:layers]


# --8<-- [start:replicated-grads]
def all_reduce_gradient_of(param: nn.Parameter, group, stats: SequenceCommStats) -> None:
    """A weight outside the TP regions saw only this rank's tokens: sum its gradient over the
    group as it arrives (before it is added to .grad, so gradient accumulation stays right)."""

    def hook(grad):
        grad = grad.clone()  # autograd owns the incoming buffer; reduce a copy
        stats.record("backward", "all_reduce", grad)
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)
# --8<-- [end:replicated-grads]


# --8<-- [start:split-batch]
def split_batch_by_sequence(model: GPT, group, stats: SequenceCommStats) -> None:
    """The caller passes the whole batch, as to the plain model; each rank keeps T/N tokens.

    The embedding, the blocks' norms, the final norm and the output layer run on those tokens
    only. The loss is the global mean: this rank's sum of token losses over the group's count
    of targets, and TP's g (all-reduce forward, identity backward) adds the ranks' terms.
    Logits come back for this rank's tokens: (B, T/N, vocab).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    this_call = {}

    def take_my_tokens(module, args, kwargs):
        input_ids, *rest = args
        targets = rest[0] if rest else kwargs.get("targets")
        if input_ids.shape[1] % size:
            raise ValueError(f"sequence length {input_ids.shape[1]} does not divide by the "
                             f"sequence-parallel size {size}")
        this_call["targets"] = None if targets is None else targets.chunk(size, dim=1)[rank]
        if targets is not None:  # every rank has the whole batch: no need to ask the others
            this_call["counted"] = (targets != -100).sum().item()
        return (input_ids.chunk(size, dim=1)[rank],), {}  # targets=None: loss computed below

    def global_mean_loss(module, args, kwargs, output):
        logits, _ = output
        targets = this_call.pop("targets")
        if targets is None:
            return logits, None
        local = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                ignore_index=-100, reduction="sum") / this_call.pop("counted")
        stats.record("forward", "all_reduce", local)
        # counted above, so into a throwaway counter here
        return logits, LeaveTensorParallel.apply(local, group, TensorParallelCommStats())

    model.register_forward_pre_hook(take_my_tokens, with_kwargs=True)
    model.register_forward_hook(global_mean_loss, with_kwargs=True)
# --8<-- [end:split-batch]


# --8<-- [start:apply]
def parallelize_sequence(model: GPT, group=None) -> SequenceCommStats:
    """Split every block of a plain GPT, in place, and sum the gradients of what stays whole.

    The model then runs on this rank's T/N tokens: the caller hands each rank its own, and
    makes the loss the mean over all ranks' tokens (split_batch_by_sequence does both for a
    caller that passes the whole batch). Returns the SequenceCommStats the collectives count into.
    """
    check_tensor_parallel_sizes(model.config, dist.get_world_size(group))
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in [*model.parameters(), *model.buffers()]:  # slice the same weights everywhere
        dist.broadcast(tensor.data, src=first, group=group)
    stats = SequenceCommStats()
    for block in model.layers:
        parallelize_block(block, group, stats)
    # What is left unsplit: the (tied) embedding and every norm. parameters() lists each once.
    sharded = {id(p) for block in model.layers for m in (block.self_attn, block.mlp)
               for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in sharded:
            all_reduce_gradient_of(p, group, stats)
    return stats


def apply_sequence_parallel(model: GPT, group=None) -> SequenceCommStats:
    """Turn a plain GPT into its tensor- and sequence-parallel version, in place: the blocks
    split, and every rank given the whole batch keeps its own tokens.

    Returns the SequenceCommStats the collectives count into.
    """
    stats = parallelize_sequence(model, group)
    split_batch_by_sequence(model, group, stats)
    return stats
# --8<-- [end:apply]


# --8<-- [start:theory]
def collective_payloads_per_step(config, batch_size: int, seq_len: int,
                                 bytes_per_value: int = 4) -> dict:
    """(phase, collective) -> (calls, payload bytes) per step, for the TP regions' collectives.

    Each block has two regions (attention, MLP). Where TP all-reduces one (B, T, hidden)
    tensor, forward and backward, SP all-gathers it at the region's entry and reduce-scatters
    it at the exit: on a ring, (N-1)/N + (N-1)/N of it sent per rank, TP's all-reduce's 2(N-1)/N.
    """
    activation = batch_size * seq_len * config.hidden_size * bytes_per_value
    regions = 2 * config.num_hidden_layers
    return {(phase, collective): (regions, regions * activation)
            for phase in ("forward", "backward") for collective in ("all_gather", "reduce_scatter")}
# --8<-- [end:theory]

