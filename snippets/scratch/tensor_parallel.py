"""Tensor parallelism from scratch, Megatron-LM style: split each weight matrix across ranks.

Data parallelism copies the whole model to every rank; tensor parallelism (TP) gives each rank a
slice of every large matrix, so a layer too big for one device is computed by several at once.
Two ways to slice a linear layer y = x W^T:

- column-parallel: rank r keeps rows r of W (a block of output features), computes its block of
  y from the full x, and needs no communication in forward;
- row-parallel: rank r keeps columns r of W (a block of input features), multiplies its block
  of x, and the ranks' partial results are summed with one all-reduce.

Column-parallel followed by row-parallel (the MLP's up/gate then down; attention's q/k/v then o)
needs exactly one all-reduce in forward and one in backward, whatever sits in between, as long
as it works elementwise or per head. Two autograd functions mark the edges of that region:

- f (enter): identity in forward, all-reduce of the gradient in backward;
- g (leave): all-reduce in forward, identity in backward.

`apply_tensor_parallel(model)` converts a plain GPT (snippets/models/gpt.py) in place; the
training loop does not change. Only torch.distributed primitives are used (broadcast,
all_reduce); tests/test_tensor_parallel.py checks the result against the single-device model.

    python -m snippets.bench.tensor_parallel_check   # 2 ranks against one process, bytes sent
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from snippets.models.gpt import GPT, MLP, CausalSelfAttention, ConfigError, GPTConfig


# --8<-- [start:stats]
@dataclass
class TensorParallelCommStats:
    """All-reduces issued by the tensor-parallel layers, and the payload each rank put in them.

    Payload = the bytes of the tensor handed to all_reduce. A ring all-reduce over N ranks
    actually sends 2(N-1)/N times that per rank (Week 1, ring all-reduce).
    """

    forward_calls: int = 0
    forward_bytes: int = 0
    backward_calls: int = 0
    backward_bytes: int = 0

    def record(self, phase: str, tensor: torch.Tensor) -> None:
        setattr(self, f"{phase}_calls", getattr(self, f"{phase}_calls") + 1)
        setattr(self, f"{phase}_bytes",
                getattr(self, f"{phase}_bytes") + tensor.numel() * tensor.element_size())

    def reset(self) -> None:
        self.forward_calls = self.forward_bytes = self.backward_calls = self.backward_bytes = 0
# --8<-- [end:stats]


# --8<-- [start:f-and-g]
class EnterTensorParallel(torch.autograd.Function):
    """f: identity in forward; all-reduce of the gradient in backward.

    Every rank feeds the same (replicated) x into its own slice of the next matrices, so each
    rank's dL/dx covers only its slice: the true gradient is the sum over ranks.
    """

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return x.view_as(x)  # says what happens: returning x, autograd would make this view

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # autograd owns the incoming buffer; reduce a copy
        ctx.stats.record("backward", grad)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class LeaveTensorParallel(torch.autograd.Function):
    """g: all-reduce in forward; identity in backward.

    Each rank holds a partial sum of the layer's output; the all-reduce completes it. The sum's
    gradient with respect to each partial term is the gradient itself, on every rank.
    """

    @staticmethod
    def forward(ctx, partial, group, stats):
        total = partial.contiguous().clone()  # never modify a forward input in place
        stats.record("forward", total)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None
# --8<-- [end:f-and-g]


# --8<-- [start:linears]
def _tp_rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _no_bias(linear: nn.Linear) -> None:
    if linear.bias is not None:
        raise ValueError("these tensor-parallel linears are written for bias-free layers, as in "
                         "the course GPT; build the layer with bias=False")


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T, where W_r is rank r's block of rows of W (out_features/N output features).

    Input: the full x, identical on every rank. Output: this rank's slice of y's last dimension.
    No communication here: the gradient all-reduce for x belongs to f, applied once where the
    replicated x enters the region (several column-parallel layers may share one x).
    """

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        _no_bias(linear)
        rank, size = _tp_rank_and_size(group)
        if linear.out_features % size:
            raise ValueError(f"out_features={linear.out_features} does not divide by the "
                             f"tensor-parallel size {size}")
        self.weight = nn.Parameter(linear.weight.detach().chunk(size, dim=0)[rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T, where W_r is rank r's block of columns of W (in_features/N inputs).

    Input: this rank's slice of x's last dimension (what a column-parallel layer produced).
    Output: the full y on every rank, after g's all-reduce of the partial products.
    """

    def __init__(self, linear: nn.Linear, group=None, stats: TensorParallelCommStats | None = None):
        super().__init__()
        _no_bias(linear)
        rank, size = _tp_rank_and_size(group)
        if linear.in_features % size:
            raise ValueError(f"in_features={linear.in_features} does not divide by the "
                             f"tensor-parallel size {size}")
        self.weight = nn.Parameter(linear.weight.detach().chunk(size, dim=1)[rank].clone())
        self.group, self.stats = group, stats if stats is not None else TensorParallelCommStats()

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        return LeaveTensorParallel.apply(F.linear(x_shard, self.weight), self.group, self.stats)
# --8<-- [end:linears]


# --8<-- [start:enter-hook]
def enter_region_on_input(module: nn.Module, group, stats: TensorParallelCommStats) -> None:
    """Apply f to the module's input, once, before any of its column-parallel layers sees it.

    Three projections (q, k, v) or two (gate, up) read the same x. One f in front of all of them
    sums their gradient contributions first and all-reduces once, instead of once per layer
    (Megatron-LM gets the same by fusing q, k, v into one matrix and gate, up into another).
    """

    def hook(module, args):
        return (EnterTensorParallel.apply(args[0], group, stats), *args[1:])

    module.register_forward_pre_hook(hook)
# --8<-- [end:enter-hook]


# --8<-- [start:mlp]
def parallelize_mlp(mlp: MLP, group, stats: TensorParallelCommStats) -> None:
    """SwiGLU down(silu(gate(x)) * up(x)): gate and up column-parallel, down row-parallel.

    silu and the product act elementwise, so rank r's intermediate columns need only rank r's
    columns of gate and up: the whole MLP runs on local slices between one f and one g.
    MLP.forward itself is unchanged.
    """
    enter_region_on_input(mlp, group, stats)
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group, stats)
# --8<-- [end:mlp]


# --8<-- [start:attention]
def parallelize_attention(attention: CausalSelfAttention, group,
                          stats: TensorParallelCommStats) -> None:
    """Split the heads: rank r computes heads [r*H/N, (r+1)*H/N) from start to finish.

    q_proj's output features are the heads side by side, so a contiguous block of rows of W_q
    is a block of whole heads; the same for k and v. RoPE and softmax work within a head, so
    they need nothing from other ranks. o_proj's input features are the same heads, so its
    row-parallel slice lines up, and g sums the heads' contributions.
    CausalSelfAttention.forward views q as (B, T, -1, head_dim): -1 becomes the local H/N.
    """
    enter_region_on_input(attention, group, stats)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group))
    attention.o_proj = RowParallelLinear(attention.o_proj, group, stats)
# --8<-- [end:attention]


# --8<-- [start:check-sizes]
def check_tensor_parallel_sizes(config: GPTConfig, tp_size: int) -> None:
    """Raise a ConfigError, before anything is sliced, if the model cannot be split tp_size ways."""
    problems = []
    # k and v have as many heads as q in this model (no grouped-query attention); with GQA the
    # number of key/value heads would have to divide by tp_size too.
    if config.num_attention_heads % tp_size:
        problems.append(f"num_attention_heads={config.num_attention_heads} (each rank must hold "
                        f"whole heads of q, k and v)")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size={config.intermediate_size} (the MLP's columns)")
    if problems:
        fits = [n for n in range(1, config.num_attention_heads + 1)
                if config.num_attention_heads % n == 0 and config.intermediate_size % n == 0]
        raise ConfigError(
            f"tensor-parallel size {tp_size} does not divide {' and '.join(problems)}; use a "
            f"tensor-parallel size in {fits}, or change num_attention_heads / intermediate_size "
            f"to multiples of {tp_size}")
# --8<-- [end:check-sizes]


# --8<-- [start:apply]
def apply_tensor_parallel(model: GPT, group=None) -> TensorParallelCommStats:
    """Turn a plain GPT into its tensor-parallel version, in place, on every rank of `group`.

    Every block's attention and MLP are split across the group; the embedding, the norms and
    the (tied) output layer stay replicated. Returns the TensorParallelCommStats the layers
    count into.
    """
    check_tensor_parallel_sizes(model.config, dist.get_world_size(group))
    # Every rank must slice the same full matrices, and the replicated parts must start equal:
    # take the group's first rank's weights.
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=first, group=group)
    stats = TensorParallelCommStats()
    for block in model.layers:
        parallelize_attention(block.self_attn, group, stats)
        parallelize_mlp(block.mlp, group, stats)
    return stats
# --8<-- [end:apply]


# --8<-- [start:theory]
def all_reduce_bytes_per_step(config: GPTConfig, batch_size: int, seq_len: int,
                              bytes_per_value: int = 4) -> dict:
    """Megatron-style TP, per training step (forward + backward), payload per rank.

    Each block has two regions (attention, MLP); each region all-reduces one (B, T, hidden)
    activation in forward (g) and one in backward (f).
    """
    activation = batch_size * seq_len * config.hidden_size * bytes_per_value
    calls = 2 * config.num_hidden_layers
    return {"forward_calls": calls, "forward_bytes": calls * activation,
            "backward_calls": calls, "backward_bytes": calls * activation}
# --8<-- [end:theory]
