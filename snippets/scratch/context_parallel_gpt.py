"""Context parallelism for the course GPT: the model trains with every rank holding T/cp tokens.

snippets/scratch/context_parallel.py is the attention op: ring attention over the 2N-chunk
layout, rank r holding chunks r and 2N-1-r. This file puts it inside the model:

- `positions_of_rank`: RoPE rotates q and k by each token's position in the *whole* sequence,
  so a rank needs the global positions of its two chunks, not 0 .. T/cp-1;
- `apply_context_parallel`: every CausalSelfAttention computes its q, k, v and o projections
  on the rank's own tokens, as before, and its attention with RingAttention over the CP group.
  The attention modules themselves are converted, so the change goes wherever they go: into a
  GPT, into pipeline stages, into tensor-parallel blocks (TP applied before or after);
- `shard_batch`: the (B, T) inputs and targets to this rank's (B, T/cp) tokens, same layout.

Attention was the one place a token needed the others; the embedding, the norms, the MLP and
the loss work token by token. So the rest of the model is unchanged, and so is every weight:
each CP rank holds all of them. What changes is what a weight's gradient covers. Backward on a
rank sums a weight's gradient over that rank's T/cp tokens only, and the loss it starts from is
the mean over those tokens. The gradient of the mean over the whole batch is the mean of the
ranks' gradients, because every rank holds the same number of tokens. So before the optimizer
step, the trainer must average every weight's gradient over the CP ranks, and with data
parallelism over the DP x CP ranks in one go: each of the dp*cp ranks holds an equal share of
the global batch's tokens. Skip it and nothing fails: each rank follows the gradient of its own
slice of the sequence, and the copies drift apart. This is the sequence-parallel page's classic
mistake one level up: there only the weights outside the TP regions saw part of the tokens,
here every weight does. (picotron all-reduces over its cp_dp group; TorchTitan shards FSDP over
the dp_shard and cp dimensions flattened into one.) With ignored targets (-100) the shares are
no longer equal, and each rank's loss must be a sum divided by the global count instead.

Only torch.distributed send/recv (in the Ring) and broadcast are used;
tests/test_context_parallel_gpt.py trains under cp=2, DP x CP = 2 x 2 and CP x TP = 2 x 2
against one process.

    python -m snippets.scratch.context_parallel_gpt_check
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from snippets.models.gpt import CausalSelfAttention, ConfigError, apply_rotary_pos_emb
from snippets.scratch.context_parallel import Ring, RingAttention, shard_sequence


# --8<-- [start:positions]
def positions_of_rank(local_len: int, rank: int, size: int) -> torch.Tensor:
    """Where this rank's local_len tokens sit in the whole sequence of local_len * size: chunk
    `rank` then chunk 2*size-1-rank, each local_len/2 long (the layout of shard_sequence)."""
    if local_len % 2:
        raise ValueError(f"a rank holds two equal chunks, so its {local_len} tokens must be "
                         f"an even number; use a sequence length that divides by 2 x {size}")
    return shard_sequence(torch.arange(local_len * size), rank, size, dim=0)
# --8<-- [end:positions]


# --8<-- [start:attention]
class ContextParallelAttention(CausalSelfAttention):
    """CausalSelfAttention on this rank's T/cp tokens: the same projections (whatever they
    are: plain, or tensor-parallel slices of the heads), RoPE at the tokens' global positions,
    and ring attention over the CP group for the rest of the sequence's keys and values."""

    ring: Ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # T: this rank's tokens
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, heads, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        positions = positions_of_rank(T, self.ring.rank, self.ring.size)
        if T * self.ring.size > len(self.rope_cos):
            raise ValueError(f"the whole sequence has {T} x {self.ring.size} tokens but "
                             f"max_position_embeddings={len(self.rope_cos)}; use a shorter "
                             "sequence or a config with more positions")
        positions = positions.to(self.rope_cos.device)
        cos = self.rope_cos[positions].to(q.dtype)
        sin = self.rope_sin[positions].to(q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        y = RingAttention.apply(q, k, v, self.ring)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads back side by side
        return self.o_proj(y)
# --8<-- [end:attention]


# --8<-- [start:apply]
def apply_context_parallel(module: nn.Module, group=None) -> Ring:
    """Make every CausalSelfAttention inside `module` (a GPT, its layers, a pipeline stage)
    context-parallel over `group`, in place; returns the Ring they share, whose counters show
    the bytes moved. Every rank of the group must call it: it broadcasts the group's first
    rank's weights, so the CP replicas start equal.

    The modules keep their parameters, buffers and hooks (a tensor-parallel input hook
    included); only their class, and so their forward, changes. The gradients are not touched:
    the trainer averages them over the DP x CP ranks (see the module's docstring).
    """
    attentions = [m for m in module.modules() if isinstance(m, CausalSelfAttention)]
    if not attentions:
        raise ValueError(f"no CausalSelfAttention inside {type(module).__name__}; pass the GPT, "
                         "its layers or a pipeline stage that holds blocks")
    first = dist.get_global_rank(group or dist.group.WORLD, 0)
    for param in module.parameters():
        dist.broadcast(param.data, src=first, group=group)
    ring = Ring(group=group)
    for attention in attentions:
        attention.__class__ = ContextParallelAttention
        attention.ring = ring
    return ring
# --8<-- [end:apply]


# --8<-- [start:shard-batch]
def shard_batch(inputs: torch.Tensor, targets: torch.Tensor | None, rank: int, size: int):
    """This rank's (B, T/size) inputs and targets: chunks `rank` and 2*size-1-rank of the
    sequence, the layout ContextParallelAttention's positions assume. Every rank is given the
    same (B, T) batch, its DP replica's share of the global one."""
    seq_len = inputs.shape[1]
    if seq_len % (2 * size):
        step = 2 * size
        nearby = " or ".join(str(n) for n in (seq_len // step * step, seq_len // step * step
                                              + step) if n > 0)
        raise ConfigError(f"sequence length {seq_len} does not divide into 2 x cp = {step} "
                          f"chunks (each CP rank holds two); use a sequence length that is a "
                          f"multiple of {step}, e.g. {nearby}")
    mine = shard_sequence(inputs, rank, size, dim=1)
    return mine, None if targets is None else shard_sequence(targets, rank, size, dim=1)
# --8<-- [end:shard-batch]
