"""Context parallelism from scratch: ring attention over a causal sequence.

Sequence parallelism (snippets/scratch/sequence_parallel.py) shards the tokens between the
tensor-parallel regions, but attention still sees the whole sequence on every rank: its
(T x T) scores and its q, k, v grow with T. Context parallelism shards attention too. Each of
N ranks keeps the queries of its own T/N tokens for good, and the keys and values travel: at
each of N steps a rank scores its queries against the K/V block it holds, then passes that
block to the next rank in the ring. Softmax needs a whole row of scores, so the partial
outputs are merged with their log-sum-exps (online softmax) and come out exact.

Causal masking makes contiguous shards unfair: the last rank's queries see every key, the
first rank's only its own. So the sequence is cut into 2N chunks and rank r holds chunks r and
2N-1-r: one early, one late, the same amount of work on every rank.

Backward runs the ring again: K and V travel once more, and the gradients of each K/V block
travel with it, gathering every rank's contribution, until they arrive back at their owner.

Only torch.distributed send/recv is used, each wait bounded by a timeout;
tests/test_context_parallel.py checks forward and backward against F.scaled_dot_product_attention
on one process.

    python -m snippets.scratch.context_parallel_check    # 2 and 4 ranks against one process
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


# --8<-- [start:layout]
def chunks_of_rank(rank: int, world_size: int) -> tuple[int, int]:
    """The two of the sequence's 2N chunks that rank r holds: one early, one late."""
    return rank, 2 * world_size - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    """This rank's T/N tokens of x (sequence along `dim`): chunk r, then chunk 2N-1-r."""
    if x.shape[dim] % (2 * world_size):
        raise ValueError(f"sequence length {x.shape[dim]} does not divide into 2 x "
                         f"{world_size} chunks")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[i] for i in chunks_of_rank(rank, world_size)], dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The inverse: every rank's shard, in rank order, back into the whole sequence."""
    world_size = len(shards)
    chunks = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        early, late = chunks_of_rank(rank, world_size)
        chunks[early], chunks[late] = shard.chunk(2, dim)
    return torch.cat(chunks, dim)
# --8<-- [end:layout]


# --8<-- [start:ring]
@dataclass
class Ring:
    """Sends to the next rank and receives from the previous one; counts what it sends.

    Every wait has a timeout: a rank whose neighbour died raises within `timeout` instead of
    blocking forever.
    """

    group: dist.ProcessGroup | None = None
    timeout: timedelta = timedelta(seconds=60)
    bytes_sent: Counter = field(default_factory=Counter)  # phase -> bytes
    messages: Counter = field(default_factory=Counter)  # phase -> sends
    scores: Counter = field(default_factory=Counter)  # phase -> query-key scores computed
    overlapped: Counter = field(default_factory=Counter)  # phase -> passes with scores computed in flight

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def start_pass(self, tensor: torch.Tensor, phase: str):
        """Start sending `tensor` to rank+1 and receiving rank-1's (same shape); returns the
        receive buffer and the pass to wait on. The caller must not modify `tensor` until
        then."""
        received = torch.empty_like(tensor)
        self.bytes_sent[phase] += tensor.numel() * tensor.element_size()
        self.messages[phase] += 1
        handles = [dist.isend(tensor.contiguous(), group=self.group,
                              group_dst=(self.rank + 1) % self.size),
                   dist.irecv(received, group=self.group, group_src=(self.rank - 1) % self.size)]
        return received, Pass(handles, phase, self.scores[phase])

    def wait(self, transfer: "Pass") -> None:
        for handle in transfer.handles:
            handle.wait(self.timeout)
        if self.scores[transfer.phase] > transfer.scores_at_start:  # computed while it moved
            self.overlapped[transfer.phase] += 1


@dataclass
class Pass:
    """One send/receive in flight, and how much attention was computed when it started."""

    handles: list
    phase: str
    scores_at_start: int
# --8<-- [end:ring]


# --8<-- [start:blocks]
def block_scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q k^T / sqrt(d); with `causal`, q and k are the same tokens and a query sees only keys
    at or before it."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def attention_block(q, k, v, causal: bool):
    """Attention of q over one K/V block, and each query's log-sum-exp over that block."""
    scores = block_scores(q, k, causal)
    lse = scores.logsumexp(-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two softmax-weighted averages over disjoint key sets -> the one over their union.

    out = sum_j e^{s_j} v_j / e^{lse}: reweight each by its share of the new total."""
    new_lse = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out, new_lse


def blocks_at_step(rank: int, source: int, length: int):
    """Which of my queries (rows) meet which of the visiting keys (columns) from `source`'s
    K/V, and whether the causal mask applies. Rank r holds chunks (r, 2N-1-r)."""
    half = length // 2
    if source == rank:  # my own tokens: in order, so the plain causal mask is right
        return slice(None), slice(None), True
    if source < rank:  # its chunk `source` precedes both of mine; its late chunk follows both
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # only my late chunk follows both of its
# --8<-- [end:blocks]


# --8<-- [start:forward]
class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys and values.

    q, k, v: (B, heads, T/N, head_dim), this rank's tokens in the 2N-chunk layout.
    Saves q, k, v, the output and one log-sum-exp per query, what flash attention saves.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        kv = torch.stack([k, v])  # one message per step
        out = lse = None
        for step in range(ring.size):
            if step < ring.size - 1:  # pass the block on while computing with it
                next_kv, transfer = ring.start_pass(kv, "forward")
            rows, cols, causal = blocks_at_step(ring.rank, (ring.rank - step) % ring.size,
                                                q.shape[2])
            block_out, block_lse = attention_block(q[:, :, rows], kv[0][:, :, cols],
                                                   kv[1][:, :, cols], causal)
            ring.scores["forward"] += block_out.shape[:-1].numel() * kv[0][:, :, cols].shape[2]
            if step == 0:  # the diagonal block: every query has at least itself
                out, lse = block_out, block_lse
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                         block_out, block_lse)
            if step < ring.size - 1:
                ring.wait(transfer)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse.squeeze(-1))
        ctx.ring = ring
        return out
# --8<-- [end:forward]

    # --8<-- [start:backward]
    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, lse = ctx.ring, lse.unsqueeze(-1)
        # sum_j P_ij dP_ij for each query: the softmax backward's correction term, which needs
        # the whole row; from the output it is one dot product per query.
        delta = (d_out * out).sum(-1, keepdim=True)
        d_q = torch.zeros_like(q)
        kv, d_kv_mine, travelling = torch.stack([k, v]), None, None
        for step in range(ring.size):
            if step < ring.size - 1:
                next_kv, transfer = ring.start_pass(kv, "backward")
            rows, cols, causal = blocks_at_step(ring.rank, (ring.rank - step) % ring.size,
                                                q.shape[2])
            k_block, v_block = kv[0][:, :, cols], kv[1][:, :, cols]
            # The block's probabilities under the *final* normaliser: P = exp(S - lse).
            p = torch.exp(block_scores(q[:, :, rows], k_block, causal) - lse[:, :, rows])
            ring.scores["backward"] += p.numel()
            d_v = p.transpose(-2, -1) @ d_out[:, :, rows]
            d_s = p * (d_out[:, :, rows] @ v_block.transpose(-2, -1) - delta[:, :, rows])
            d_s = d_s * q.shape[-1] ** -0.5
            d_q[:, :, rows] += d_s @ k_block
            d_kv = torch.zeros_like(kv)
            d_kv[0][:, :, cols], d_kv[1][:, :, cols] = d_s.transpose(-2, -1) @ q[:, :, rows], d_v
            if step == 0:  # my own K/V: keep its gradient here
                d_kv_mine = d_kv
            else:  # add to the gradient travelling with this K/V block, and pass it on
                travelling = d_kv if step == 1 else travelling + d_kv
                travelling, d_transfer = ring.start_pass(travelling, "backward")
                ring.wait(d_transfer)
            if step < ring.size - 1:
                ring.wait(transfer)
                kv = next_kv
        if travelling is not None:  # after N-1 hops it arrived back from rank-1: mine
            d_kv_mine = d_kv_mine + travelling
        return d_q, d_kv_mine[0], d_kv_mine[1], None
    # --8<-- [end:backward]


# --8<-- [start:theory]
def ring_bytes_per_rank(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int,
                        bytes_per_value: int = 4) -> dict:
    """phase -> (sends, bytes) per rank for one attention call.

    One message is this rank's K and V: 2 x B x heads x T/N x head_dim values. Forward passes
    it N-1 times. Backward passes it N-1 times again, and the gradient of each K/V block makes
    N-1 hops too: it starts at the rank after its owner and ends back at the owner.
    """
    message = 2 * batch * heads * (seq_len // world_size) * head_dim * bytes_per_value
    hops = world_size - 1
    return {"forward": (hops, hops * message), "backward": (2 * hops, 2 * hops * message)}


def saved_bytes_per_rank(batch: int, heads: int, seq_len: int, head_dim: int, world_size: int,
                         bytes_per_value: int = 4) -> int:
    """What one attention call saves for backward on a rank: q, k, v and the output for its
    T/N tokens, and one fp32 log-sum-exp per token and head. No T x T scores."""
    tokens = batch * seq_len // world_size
    return tokens * heads * (4 * head_dim * bytes_per_value + 4)


def causal_scores_per_rank(seq_len: int, world_size: int, balanced: bool) -> list[int]:
    """Query-key pairs causal attention needs, per rank and per (batch, head): contiguous
    shards of T/N tokens, or the balanced layout's chunks r and 2N-1-r."""
    def pairs(chunk: int, size: int) -> int:  # queries at chunk*size.., each sees keys <= it
        first = chunk * size + 1
        return size * first + size * (size - 1) // 2

    if balanced:
        size = seq_len // (2 * world_size)
        return [sum(pairs(c, size) for c in chunks_of_rank(r, world_size))
                for r in range(world_size)]
    return [pairs(r, seq_len // world_size) for r in range(world_size)]
# --8<-- [end:theory]
