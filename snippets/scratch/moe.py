"""A small mixture of experts (MoE), and expert parallelism from scratch.

An MoE layer replaces a transformer block's one feed-forward network (FFN) by E of them, the
experts, and a router that sends each token to only k of them. Parameters grow with E; the
compute per token grows only with k. Four parts, top to bottom:

1. Routing: a linear router scores the experts, softmax turns scores into probabilities, each
   token goes to its top-k experts, weighted by their probabilities.
2. Capacity: an expert takes at most `capacity` tokens per batch. Assignments beyond that are
   dropped: the token gets nothing from that expert, and a token dropped by all of its experts
   leaves the layer as zeros, so the block's residual connection carries it through unchanged.
3. The load-balancing loss (Switch Transformer / GShard): E * sum_i f_i * P_i, where f_i is the
   fraction of assignments the router gave expert i and P_i its mean router probability. It is
   1.0 for a perfectly balanced router and pushes probability away from overloaded experts.
4. Expert parallelism: the experts are split across ranks. Each rank routes its own tokens, sends
   each token to the rank that holds its expert with one all_to_all, the experts run, and a second
   all_to_all brings the results back to be combined with the router weights.

Only torch.distributed primitives (all_to_all_single) are used; tests/test_moe.py checks the
expert-parallel layer against the single-process one, forward and backward, on 2 and 4 ranks.

    python -m snippets.bench.moe_check   # the tiny GPT with MoE layers, then one layer on 2 ranks
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from snippets.models.gpt import GPT, MLP, GPTConfig


# --8<-- [start:routing]
@dataclass
class Routing:
    """Where this batch's tokens go. An *assignment* is one (token, expert) pair; a token has
    top_k of them. Kept assignments are listed sorted by expert, so each expert's tokens are
    one contiguous slice."""
    token_index: torch.Tensor  # (kept,) which token each kept assignment carries
    weight: torch.Tensor  # (kept,) its router probability: the expert's output is scaled by it
    tokens_per_expert: torch.Tensor  # (E,) int64, kept assignments per expert (slice lengths)
    aux_loss: torch.Tensor  # scalar load-balancing loss (see load_balancing_loss)
    assignments: int  # tokens * top_k
    dropped: int  # assignments over capacity
    tokens_fully_dropped: int  # tokens with every assignment dropped: pass through unchanged


# --8<-- [start:aux-loss]
def load_balancing_loss(probs: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_i f_i * P_i, generalised to top-k.

    probs: (tokens, E) router probabilities. expert_index: (tokens, k) the chosen experts.
    f_i, the fraction of the tokens * k assignments that chose expert i, is a count and has no
    gradient; P_i, the mean probability of expert i, carries it. So the gradient lowers the
    probability of experts in proportion to how often they are chosen."""
    num_experts = probs.shape[-1]
    counts = torch.bincount(expert_index.reshape(-1), minlength=num_experts)
    f = counts.to(probs.dtype) / expert_index.numel()
    P = probs.mean(dim=0)
    return num_experts * (f * P).sum()
# --8<-- [end:aux-loss]


def capacity_mask(expert_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments fit: (tokens, k) bools. Each expert takes at most `capacity`.

    Priority as in GShard: every token's first choice before any second choice, and within a
    choice, earlier tokens first. A token then loses its second expert before anyone loses a
    first one."""
    tokens, k = expert_index.shape
    in_priority_order = expert_index.t().reshape(-1)  # all first choices, then all second...
    one_hot = F.one_hot(in_priority_order, num_experts)
    # Position of each assignment in its expert's queue: 0 for the first to arrive, 1, 2, ...
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1
    return (position < capacity).view(k, tokens).t()


def route(x: torch.Tensor, router: nn.Linear, top_k: int,
          capacity_factor: float | None) -> Routing:
    """Route the (tokens, hidden) batch x: top-k experts per token, capacity applied."""
    num_experts = router.out_features
    # Softmax in fp32: under bf16 autocast the router's logits are bf16, and small differences
    # between experts' scores would round away.
    probs = torch.softmax(router(x).float(), dim=-1)  # (tokens, E)
    top_probs, expert_index = probs.topk(top_k, dim=-1)  # (tokens, k) each
    aux_loss = load_balancing_loss(probs, expert_index)

    tokens = x.shape[0]
    if capacity_factor is None:
        keep = torch.ones_like(expert_index, dtype=torch.bool)
    else:
        # The fair share of one expert is tokens * k / E assignments; the factor is headroom.
        capacity = math.ceil(capacity_factor * tokens * top_k / num_experts)
        keep = capacity_mask(expert_index, num_experts, capacity)

    token_index = torch.arange(tokens, device=x.device).unsqueeze(1).expand(-1, top_k)
    kept_expert = expert_index[keep]  # token-major order: token 0's choices, token 1's, ...
    order = torch.argsort(kept_expert, stable=True)  # group by expert, token order within
    return Routing(
        token_index=token_index[keep][order],
        weight=top_probs[keep][order],
        tokens_per_expert=torch.bincount(kept_expert, minlength=num_experts),
        aux_loss=aux_loss,
        assignments=expert_index.numel(),
        dropped=int((~keep).sum()),
        tokens_fully_dropped=int((~keep).all(dim=1).sum()),
    )
# --8<-- [end:routing]


# --8<-- [start:moe]
class MoE(nn.Module):
    """Drop-in for the GPT's SwiGLU MLP: E SwiGLU experts behind a top-k router.

    Each expert is the model's own MLP class. The router's probabilities are used as they are
    (Switch Transformer), not renormalised over the top k: with k = 1 a renormalised weight
    would always be 1.0, and the router would get no gradient from the language-model loss.
    """

    def __init__(self, config: GPTConfig, num_experts: int, top_k: int = 2,
                 capacity_factor: float | None = 1.25, expert_intermediate_size: int | None = None):
        super().__init__()
        check_moe_args(num_experts, top_k, capacity_factor)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        expert_config = replace(config, intermediate_size=expert_intermediate_size
                                or config.intermediate_size)
        self.router = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(expert_config) for _ in range(num_experts))
        self.first_expert = 0  # global id of experts[0]; changes under expert parallelism
        self.ep_group = None  # a process group once apply_expert_parallel has split the experts
        self.aux_loss = None  # the last forward's load-balancing loss, for the training loop
        self.last_routing = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, hidden): routing is per token
        routing = route(x, self.router, self.top_k, self.capacity_factor)
        self.aux_loss, self.last_routing = routing.aux_loss, routing
        expert_inputs = x[routing.token_index]  # one row per kept assignment, by expert
        if self.ep_group is None:
            expert_outputs = self.run_local_experts(expert_inputs, routing.tokens_per_expert)
        else:
            expert_outputs = dispatch_to_experts(self, expert_inputs, routing.tokens_per_expert)
        # Combine: each token's output is the router-weighted sum over its kept experts; a
        # token with none stays zero, and the residual connection carries it through.
        weighted = expert_outputs * routing.weight.unsqueeze(1).to(expert_outputs.dtype)
        out = weighted.new_zeros(x.shape[0], x.shape[1])
        out.index_add_(0, routing.token_index, weighted)
        return out.view(shape)

    def run_local_experts(self, inputs: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        """inputs: rows grouped by local expert, tokens_per_expert[j] rows for experts[j]."""
        chunks = inputs.split(list(map(int, tokens_per_expert)))
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)])


def check_moe_args(num_experts: int, top_k: int, capacity_factor: float | None) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be at least 1")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}: a "
                         f"token cannot go to more experts than there are; lower top_k or add "
                         f"experts")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be positive (1.0 = each "
                         f"expert takes exactly its fair share), or None for no limit")
# --8<-- [end:moe]


# --8<-- [start:swap]
def swap_mlps_for_moe(model: GPT, num_experts: int, top_k: int = 2,
                      capacity_factor: float | None = 1.25,
                      expert_intermediate_size: int | None = None) -> GPT:
    """Replace every block's MLP of a plain GPT by a freshly initialised MoE layer, in place.
    gpt.py is untouched: Block.forward calls self.mlp(...), whatever it is."""
    for block in model.layers:
        block.mlp = MoE(model.config, num_experts, top_k, capacity_factor,
                        expert_intermediate_size)
        block.mlp.apply(model._init_weights)  # the GPT's own init: std 0.02, scaled residuals
    return model


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of every MoE layer's load-balancing loss from the last forward pass."""
    return sum(layer.aux_loss for layer in moe_layers(model))
# --8<-- [end:swap]


# --8<-- [start:all-to-all]
class AllToAll(torch.autograd.Function):
    """all_to_all_single that autograd can pass through.

    Rank r sends rows [offset_d, offset_d + send_splits[d]) to rank d and receives
    recv_splits[s] rows from each rank s, in rank order. The gradient of a row travels the
    reverse path: the backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty(sum(ctx.send_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.send_splits,
                               ctx.recv_splits, group=ctx.group)
        return grad_in, None, None, None
# --8<-- [end:all-to-all]


# --8<-- [start:dispatch]
def dispatch_to_experts(moe: MoE, inputs: torch.Tensor,
                        tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Expert parallelism: the experts live on different ranks.

    inputs holds this rank's kept assignments grouped by global expert id, tokens_per_expert[e]
    rows for expert e. Rank d holds experts [d * E_local, (d + 1) * E_local), so the rows for
    rank d are one contiguous slice. Returns the experts' outputs in the same row order."""
    group, world = moe.ep_group, dist.get_world_size(moe.ep_group)
    local = len(moe.experts)
    # 1. Exchange counts first: every rank must know how many rows it will receive, and for
    #    which of its experts, before the rows themselves can move.
    recv_per_expert = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=group)
    # recv_per_expert.view(world, local)[s, j]: rows rank s sends to my expert j
    send_splits = tokens_per_expert.view(world, local).sum(dim=1).tolist()
    recv_splits = recv_per_expert.view(world, local).sum(dim=1).tolist()

    # 2. Send each row to the rank that holds its expert.
    received = AllToAll.apply(inputs, send_splits, recv_splits, group)

    # 3. Received rows are ordered by source rank, then expert; regroup them by expert, run
    #    each local expert once on all its rows, and restore the (source, expert) order.
    counts = recv_per_expert.view(world, local)
    pieces = received.split(recv_per_expert.tolist())  # pieces[s * local + j]
    by_expert = [torch.cat([pieces[s * local + j] for s in range(world)]) for j in range(local)]
    outputs = moe.run_local_experts(torch.cat(by_expert), counts.sum(dim=0))
    out_pieces = outputs.split(counts.t().reshape(-1).tolist())  # out_pieces[j * world + s]
    back = torch.cat([out_pieces[j * world + s] for s in range(world) for j in range(local)])

    # 4. Send each result back to the rank its token came from.
    return AllToAll.apply(back, recv_splits, send_splits, group)
# --8<-- [end:dispatch]


# --8<-- [start:apply-ep]
def apply_expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Split the experts of every MoE layer in `model` across the ranks of `group`, in place:
    rank r keeps experts [r * E / world, (r + 1) * E / world) and drops the others.

    Every rank must have built the same model (same seed): the router and the rest of the
    model stay replicated, and their gradients are averaged as in data parallelism."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers; call swap_mlps_for_moe(model, ...) first")
    for moe in layers:
        if moe.num_experts % world:
            raise ValueError(
                f"num_experts={moe.num_experts} is not divisible by the expert-parallel world "
                f"size {world}: each rank must hold the same number of experts; use a "
                f"multiple of {world} experts or a group whose size divides {moe.num_experts}")
        local = moe.num_experts // world
        moe.first_expert = rank * local
        moe.experts = nn.ModuleList(moe.experts[rank * local:(rank + 1) * local])
        moe.ep_group = group if group is not None else dist.group.WORLD  # None means "local"
    return model


def is_expert_parameter(name: str) -> bool:
    """Expert weights exist on one rank only: never average their gradients across ranks."""
    return ".experts." in name or name.startswith("experts.")
# --8<-- [end:apply-ep]
