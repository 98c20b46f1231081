"""Interleaved 1F1B (snippets/scratch/pipeline_interleaved.py) at work on 2 processes:

    python -m snippets.scratch.pipeline_interleaved_check

It prints each rank's schedule, trains the tiny GPT (a layer per chunk) with and without zero
bubble and compares every weight with one process trained on the same batches (reference.py),
counts the point-to-point messages, and measures the bubble of plain 1F1B, interleaved and zero
bubble in counted time units, beside the formula. tests/test_pipeline_interleaved.py runs the
same functions and holds them to their bounds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from snippets.models.gpt import GPT, get_config
from snippets.scratch.pipeline import one_f_one_b_schedule, run_schedule
from snippets.scratch.pipeline_interleaved import (bubble_over_compute, chunks_of_rank,
                                                   interleaved_schedule, interleaved_train_step,
                                                   run_interleaved)
from snippets.scratch.reference import SGD, single_process, token_batches


# --8<-- [start:counted-bubble]
class CountedTime(torch.autograd.Function):
    """A chunk's compute, counted in time units instead of spent: its output holds the time its
    forward ended, its input gradient the time its backward ended (a clock per rank), so the
    clock ends at the span of the step as the processes ran it, without a shared CPU's noise."""

    @staticmethod
    def forward(ctx, x, weight, clock, forward_units, backward_units):
        ctx.clock = clock
        ctx.backward_units = backward_units
        clock[0] = max(clock[0], x.max().item()) + forward_units
        return torch.full_like(x, clock[0])

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] = max(ctx.clock[0], grad.max().item()) + ctx.backward_units
        return torch.full_like(grad, ctx.clock[0]), torch.zeros(1), None, None, None


class CountedTimeChunk(nn.Module):
    """A stand-in for a chunk of the model: one (unused) weight, and CountedTime as its compute."""

    def __init__(self, clock: list, forward_units: float, backward_units: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.clock = clock
        self.units = forward_units, backward_units

    def forward(self, x):
        return CountedTime.apply(x, self.weight, self.clock, *self.units)


def counted_bubble(rank, num_ranks, num_chunks_per_rank, num_micro_batches):
    """Bubble over compute of one step of plain 1F1B (a stage: forward 2 units, backward 4),
    interleaved 1F1B (v chunks of 1/v of that) and zero bubble (B and W: half a backward each)."""
    p, v, m = num_ranks, num_chunks_per_rank, num_micro_batches

    def zero_loss(y, _):  # gradient 0: every backward starts "when its rank is free"
        return (y * 0).sum()

    bubbles = {}
    for name in ("1f1b", "interleaved", "zero_bubble"):
        clock = [0.0]
        inputs = [torch.zeros(1, requires_grad=True) for _ in range(m)]
        if name == "1f1b":
            actions = one_f_one_b_schedule(m, rank, p)
            run_schedule(CountedTimeChunk(clock, 2, 4), actions, rank, p, inputs, [None] * m,
                         zero_loss, (1,))
        else:
            backward_units = 4 / v
            if name == "zero_bubble":  # B and W each run half of the backward
                backward_units /= 2
            chunks = {c: CountedTimeChunk(clock, 2 / v, backward_units)
                      for c in range(rank, p * v, p)}
            actions = interleaved_schedule(m, rank, p, v, zero_bubble=name == "zero_bubble")
            run_interleaved(chunks, actions, rank, p, inputs, [None] * m, zero_loss, (1,))
        span = torch.tensor(clock[0])
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the step ends when the last rank does
        busy = 6 * m  # m forwards (2 units) and m backwards (4 units)
        bubbles[name] = (span.item() - busy) / busy
    return bubbles
# --8<-- [end:counted-bubble]


# --8<-- [start:training]
def train_interleaved(rank, num_ranks, num_chunks_per_rank, num_micro_batches, steps, batch_size,
                      seq_len, zero_bubble=False):
    """Train the tiny GPT, a layer per chunk, a few SGD steps: this rank's weights and losses."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", num_hidden_layers=num_ranks * num_chunks_per_rank))
    chunks = chunks_of_rank(model, rank, num_ranks, num_chunks_per_rank)
    # One ModuleList, so that a tied weight held by two of this rank's chunks is stepped once.
    optimizer = torch.optim.SGD(nn.ModuleList(chunks.values()).parameters(), **SGD)
    losses = []
    for tokens in token_batches(model.config.vocab_size, steps, batch_size, seq_len):
        loss, _ = interleaved_train_step(chunks, tokens, num_micro_batches, rank, num_ranks,
                                         zero_bubble)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    state = {k: v.clone() for chunk in chunks.values() for k, v in chunk.state_dict().items()}
    return {"state": state, "losses": losses}
# --8<-- [end:training]


# --8<-- [start:demo]
def demo_worker(rank, p, v, m, steps, batch, seq):
    states = [train_interleaved(rank, p, v, m, steps, batch, seq, zero_bubble)["state"]
              for zero_bubble in (False, True)]
    return states, counted_bubble(rank, p, v, m)


def main(p=2, v=2, m=4, steps=3, batch=8, seq=16):
    from snippets.dist import spawn

    print(f"p={p} ranks, v={v} chunks each, m={m} micro-batches (F2.1: chunk 2, micro-batch 1)")
    for r in range(p):
        actions = interleaved_schedule(m, r, p, v)
        print(f"rank {r}: " + " ".join(f"{k}{c}.{i}" for k, c, i in actions))
    ranks = spawn(demo_worker, p, v, m, steps, batch, seq, timeout_s=60)
    reference, _ = single_process(steps, batch, seq, num_layers=p * v)
    torch.manual_seed(0)  # the initial weights: how far training moved them sets the bound
    init = GPT(get_config("tiny", num_hidden_layers=p * v)).state_dict()
    bound = 1e-5 * max((reference[k] - init[k]).abs().max().item() for k in reference)
    for zb, name in enumerate(("interleaved", "zero bubble")):
        worst = max((w - reference[k]).abs().max().item()
                    for states, _ in ranks for k, w in states[zb].items())
        print(f"{name:<11} vs one process after {steps} SGD steps: max |weight diff| "
              f"{'<' if worst < bound else '>='} 1e-5 x the largest weight change")

    def messages(n):  # sends per step: every forward but chunk 0's, every backward but the last's
        return sum(k == "F" and c > 0 or k == "B" and c < p * n - 1
                   for r in range(p) for k, c, _ in interleaved_schedule(m, r, p, n))

    print(f"p2p messages per step: 1F1B {messages(1)}, interleaved {messages(v)}")
    # The formula's v for each: 1 for 1F1B, v for interleaved, 3 v for zero bubble.
    for (name, bubble), n in zip(ranks[0][1].items(), (1, v, 3 * v)):
        print(f"bubble / compute, {name:<11}  counted {bubble:.4f}   (p-1)/({n} m) = "
              f"{bubble_over_compute(p, m, n):.4f}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
