"""A layout, applied to a plain GPT: DP x PP x CP x TP, with or without SP, from the course's parts.

The training loop never looks inside the model (training/parallel_trainer.py): it asks this
file for this rank's share of the model, of the tokens and of the loss, and for the groups its
gradients are averaged over. That is TorchTitan's split between the trainer and its
`parallelize` step, written with the course's own scratch parts:

- TP or SP (tensor_parallel.py, sequence_parallel.py) split every block's matrices;
- CP (context_parallel_gpt.py) makes attention a ring over the sequence's chunks;
- PP (pipeline.py, pipeline_interleaved.py) keeps this rank's stage, or its v chunks;
- DP keeps nothing out: each replica takes its own rows of the batch.

The one rule to get right: average a gradient over exactly the ranks that hold the same
parameter and saw different tokens. Those are the DP replicas *and* the CP ranks (each saw
T/cp of every sequence), never the TP ranks (they hold different slices) nor other stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from snippets.models.gpt import GPT, ConfigError, GPTConfig
from snippets.scratch.context_parallel_gpt import apply_context_parallel, shard_batch
from snippets.scratch.pipeline import cross_entropy, split_into_stages
from snippets.scratch.pipeline_interleaved import chunks_of_rank
from snippets.scratch.sequence_parallel import parallelize_sequence
from snippets.scratch.tensor_parallel import (ColumnParallelLinear, LeaveTensorParallel,
                                              RowParallelLinear, TensorParallelCommStats,
                                              apply_tensor_parallel, check_tensor_parallel_sizes)
from snippets.scratch.three_d import Mesh


# --8<-- [start:layout]
@dataclass(frozen=True)
class Layout:
    """How many ways each axis splits the work. world size = dp * pp * cp * tp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False            # sequence parallelism inside the TP group (needs tp >= 2)
    virtual_stages: int = 1     # model chunks per pipeline rank (interleaved 1F1B when > 1)
    zero: int = 0               # 1: the optimizer's state sharded over the DP ranks (ZeRO-1)

    def __post_init__(self):
        for axis in ("dp", "tp", "pp", "cp", "virtual_stages"):
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise ConfigError(f"--{axis.replace('_', '-')} must be a whole number >= 1, "
                                  f"got {getattr(self, axis)!r}")
        if self.sp and self.tp < 2:
            raise ConfigError("--sp splits the sequence inside the tensor-parallel group: "
                              "it needs --tp 2 or more")
        if self.zero not in (0, 1):
            raise ConfigError(f"--zero {self.zero}: the scratch parts shard the optimizer state "
                              "(--zero 1) or nothing (--zero 0); for ZeRO-3, weights and "
                              "gradients sharded too, pass --library (FSDP2 over the DP ranks)")
        if self.virtual_stages > 1 and self.pp < 2:
            raise ConfigError("--virtual-stages interleaves chunks over pipeline ranks: it "
                              "needs --pp 2 or more")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def mesh(self) -> Mesh:
        """TP innermost (it talks every layer), CP next to it (a ring pass every layer), then
        PP, DP outermost (once a step)."""
        return Mesh(dp=self.dp, pp=self.pp, tp=self.tp, order=("dp", "pp", "cp", "tp"),
                    cp=self.cp)

    def check(self, config: GPTConfig, seq_len: int, world_size: int) -> None:
        """Every size rule, each a one-line error naming the fix, before any process talks."""
        if world_size != self.size:
            raise ConfigError(f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = "
                              f"{self.size} but {world_size} processes were started: start "
                              f"{self.size} (--nproc_per_node) or change the sizes")
        if self.tp > 1:
            check_tensor_parallel_sizes(config, self.tp)
        chunks = self.pp * self.virtual_stages
        if config.num_hidden_layers % chunks:
            raise ConfigError(f"num_hidden_layers={config.num_hidden_layers} does not divide "
                              f"into pp*virtual_stages = {chunks} chunks: choose sizes whose "
                              "product divides the layer count")
        pieces = 2 * self.cp * (self.tp if self.sp else 1)
        if seq_len % pieces:
            raise ConfigError(f"seq_len={seq_len} does not divide into {pieces} pieces (2 "
                              f"chunks per CP rank{', times tp for SP' if self.sp else ''}): "
                              f"use a --seq-len that is a multiple of {pieces}")
# --8<-- [end:layout]


# --8<-- [start:parallelize]
def parallelize(model: GPT, layout: Layout, groups: dict, coords: dict) -> dict:
    """Apply the layout to the plain model, in place; return this rank's chunks {index: stage}
    (one stage, or virtual_stages chunks when interleaved). Order matters: CP replaces the
    attention's forward, then TP/SP split its projections and hook its input."""
    if layout.cp > 1:
        apply_context_parallel(model, groups["cp"])
    if layout.sp:
        parallelize_sequence(model, groups["tp"])
    elif layout.tp > 1:
        apply_tensor_parallel(model, groups["tp"])
    p = coords["pp"]
    if layout.virtual_stages > 1:
        return chunks_of_rank(model, p, layout.pp, layout.virtual_stages)
    return {p: split_into_stages(model, layout.pp)[p]}


def shard_dims(chunks: dict) -> dict:
    """{parameter name: the dimension TP cut it along}; the others are whole on every rank."""
    return {f"{name}.weight": 0 if isinstance(module, ColumnParallelLinear) else 1
            for stage in chunks.values() for name, module in stage.named_modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear))}
# --8<-- [end:parallelize]


# --8<-- [start:tokens]
def local_tokens(inputs: torch.Tensor, targets: torch.Tensor, layout: Layout, coords: dict):
    """This rank's share of a (B, T) batch: CP's two chunks of every sequence, then, under SP,
    this TP rank's contiguous piece of those. Without SP every TP rank takes them all."""
    if layout.cp > 1:
        inputs, targets = shard_batch(inputs, targets, coords["cp"], layout.cp)
    if layout.sp:
        inputs = inputs.chunk(layout.tp, dim=1)[coords["tp"]]
        targets = targets.chunk(layout.tp, dim=1)[coords["tp"]]
    return inputs, targets


def loss_function(layout: Layout, tp_group):
    """The loss the last stage computes on its tokens. Without SP: the mean over them. Under
    SP each TP rank holds 1/tp of the tokens: its sum over the group's count, all-reduced
    (sequence_parallel.py's global mean), so every TP rank holds the mean over all of them."""
    if not layout.sp:
        return cross_entropy

    def sequence_parallel_loss(logits, targets):
        total = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                reduction="sum")
        return LeaveTensorParallel.apply(total / (targets.numel() * layout.tp), tp_group,
                                         TensorParallelCommStats())
    return sequence_parallel_loss
# --8<-- [end:tokens]


# --8<-- [start:gradients]
def gradient_groups(layout: Layout, groups: dict) -> list:
    """Where a gradient is averaged: over DP, then over CP. Each rank's loss is the mean over
    its own, equal, share of the tokens, so the mean over the dp*cp ranks is the gradient of
    the global mean. Two all-reduces of means make one mean over the product (picotron builds
    one cp_dp group instead: fewer messages, the same numbers)."""
    return [groups[axis] for axis in ("dp", "cp") if getattr(layout, axis) > 1]


def counted_in_norm(name: str, dims: dict, chunks: dict, coords: dict, tied: bool) -> bool:
    """Whether this rank adds this parameter's gradient into the global norm, so that each
    number is counted once: a TP shard by every TP rank (each holds another slice), a whole
    parameter by TP rank 0 only, and the tied embedding on the rank that holds the embedding
    (the last stage's output head is a copy of it)."""
    if name not in dims and coords["tp"] != 0:
        return False
    holds_embedding = any(stage.embed_tokens is not None for stage in chunks.values())
    return not (tied and name == "lm_head.weight" and not holds_embedding)
# --8<-- [end:gradients]


def local_parameters(chunks: dict) -> list[tuple[str, nn.Parameter]]:
    """(model name, parameter) of every parameter this rank holds, each once."""
    seen, named = set(), []
    for stage in chunks.values():
        for name, param in stage.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
    return named
