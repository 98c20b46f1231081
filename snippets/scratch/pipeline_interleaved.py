"""Interleaved 1F1B from scratch: v model chunks per rank, and an optional zero-bubble variant.

The model is cut into p * v chunks; rank r holds chunks r, r + p, ..., r + (v - 1) p (Megatron-LM's
layout), so a micro-batch visits every rank v times. A chunk is 1/v of a stage: the pipeline
fills and drains v times faster, and the bubble shrinks from (p - 1)/m to (p - 1)/(v m) of the
compute time, for about v times the hand-offs. Zero bubble (Qi et al., 2024) splits a backward
into B, the input gradient the previous chunk waits for, and W, the weight gradient, which waits.
A schedule is a pure function (rank -> ordered (kind, chunk, micro-batch) list); `simulate`
replays it. Run: python -m snippets.scratch.pipeline_interleaved
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.scratch.pipeline import (cross_entropy, one_f_one_b_schedule, run_schedule,
                                       single_process, split_into_stages, sync_tied_embedding_grads)
from snippets.scratch.pipeline_trace import StageTrace


# --8<-- [start:chunks]
def chunks_of_rank(model: GPT, rank: int, num_ranks: int, num_chunks_per_rank: int) -> dict:
    """This rank's chunks, {global chunk index: GPTStage}: r, r + p, ..., r + (v - 1) p."""
    stages = split_into_stages(model, num_ranks * num_chunks_per_rank)
    return {c: stages[c] for c in range(rank, len(stages), num_ranks)}
# --8<-- [end:chunks]


# --8<-- [start:schedule]
def interleaved_schedule(num_micro_batches: int, rank: int, num_ranks: int,
                         num_chunks_per_rank: int, zero_bubble: bool = False) -> list:
    """Rank `rank`'s actions, in order: ("F" | "B" | "W", global chunk, micro-batch).

    Megatron's order: micro-batches go through a rank's chunks in groups of p: its k-th forward
    runs local chunk (k // p) % v on micro-batch (k // (p v)) p + k % p; backwards go in reverse.
    Warm-up: (v - 1) p forwards for the rounds before the last chunk, plus 2 per rank downstream
    (Megatron's count, for the gradient's way back); then one forward, one backward; then the
    last backwards. With zero_bubble, "B" is the input gradient only, the warm-up counts 1 per
    rank downstream, and rank r runs each weight gradient "W" r backwards later.
    """
    p, v, m = num_ranks, num_chunks_per_rank, num_micro_batches
    if m % p:
        raise ConfigError(f"num_micro_batches={m} must be a multiple of num_ranks={p} for the "
                          f"interleaved schedule (micro-batches go round in groups of p)")
    total = m * v  # forwards (and backwards) on this rank
    warmup = min((v - 1) * p + (1 if zero_bubble else 2) * (p - rank - 1), total)

    def action(kind, k):  # this rank's k-th forward, or k-th backward
        local = (k // p) % v if kind == "F" else v - 1 - (k // p) % v
        return (kind, local * p + rank, (k // (p * v)) * p + k % p)

    actions = [action("F", k) for k in range(warmup)]
    for k in range(total):  # steady state, then cool-down
        actions += [action("F", warmup + k)] if warmup + k < total else []
        actions.append(action("B", k))
        if zero_bubble and k >= rank:  # the weight gradient of the backward r steps back
            actions.append(("W", *action("B", k - rank)[1:]))
    if zero_bubble:
        actions += [("W", *action("B", k)[1:]) for k in range(total - rank, total)]
    return actions
# --8<-- [end:schedule]


# --8<-- [start:simulate]
class ScheduleError(ValueError):
    """A schedule that misses an action, repeats one, or deadlocks."""


def simulate(orders: dict, num_chunks: int, num_micro_batches: int, duration=None) -> dict:
    """Run every rank's list as the pipeline would. An action starts once its rank is free and
    its input exists: a forward needs the previous chunk's forward, a backward the next chunk's
    backward (the last chunk: its own forward), a weight gradient its own backward. Sends never
    block, receives do. Returns {rank: [(kind, chunk, micro-batch, start, end), ...]}."""
    duration, p = duration or {"F": 1, "B": 1, "W": 1}, len(orders)
    kinds = "FBW" if any(a[0] == "W" for acts in orders.values() for a in acts) else "FB"
    for r, acts in orders.items():
        if sorted(acts) != sorted((k, c, i) for k in kinds for c in range(r, num_chunks, p)
                                  for i in range(num_micro_batches)):
            raise ScheduleError(f"rank {r} does not run every action of its chunks exactly once")

    def needs(kind, c, i):
        if kind == "F":
            return ("F", c - 1, i) if c > 0 else None
        if kind == "W":
            return ("B", c, i)
        return ("B", c + 1, i) if c < num_chunks - 1 else ("F", c, i)

    done, timeline = {}, {r: [] for r in orders}
    position, free_at = dict.fromkeys(orders, 0), dict.fromkeys(orders, 0)
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, acts in orders.items():
            while position[r] < len(acts):
                action = acts[position[r]]
                need = needs(*action)
                if need is not None and need not in done:
                    break  # blocked in a receive
                start = max(free_at[r], done[need] if need else 0)
                free_at[r] = done[action] = start + duration[action[0]]
                timeline[r].append((*action, start, free_at[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            waits = {r: orders[r][position[r]] for r in orders if position[r] < len(orders[r])}
            raise ScheduleError(f"deadlock: every rank waits, at {waits}")
    return timeline
# --8<-- [end:simulate]


# --8<-- [start:run]
def run_interleaved(chunks: dict, actions: list, rank: int, num_ranks: int, micro_inputs: list,
                    micro_targets: list, loss_fn, activation_shape: tuple):
    """Run one step's actions on this rank's chunks. Chunk c sends its output to rank (c + 1) % p,
    its input gradient to rank (c - 1) % p, tagged with the action that receives it (a safeguard:
    same-tag messages arrive in order anyway). Returns (mean loss on the last rank, trace)."""
    p, m, last = num_ranks, len(micro_inputs), num_ranks * len(chunks) - 1
    trace = StageTrace(rank)  # events: (kind, (chunk, micro-batch), start, end)
    held = {}  # (chunk, micro-batch) -> (input, output, activation send or output gradient)
    grad_sends, loss_sum = [], 0.0  # input gradients in flight: waited for at the end
    split = any(kind == "W" for kind, _, _ in actions)  # zero bubble: B is the input gradient

    def tag(kind, c, i):
        return (c * m + i) * 2 + (kind == "B")

    for kind, c, i in actions:
        if kind == "F":
            x = micro_inputs[i]
            if c > 0:
                x = torch.empty(activation_shape)
                dist.recv(x, src=(c - 1) % p, tag=tag("F", c, i))
                x.requires_grad_()
            with trace.op("F", (c, i)):
                y = chunks[c](x)
                if c == last:  # divided by m: the summed gradients are the whole batch's
                    y = loss_fn(y, micro_targets[i]) / m
            held[c, i] = (x, y, None if c == last else
                          dist.isend(y.detach(), dst=(c + 1) % p, tag=tag("F", c + 1, i)))
            loss_sum += y.item() if c == last else 0.0
        elif kind == "B":
            x, y, sent = held[c, i]
            grad = None  # on the last chunk y is the loss: backward starts from it
            if c < last:
                grad = torch.empty_like(y)
                dist.recv(grad, src=(c + 1) % p, tag=tag("B", c, i))
                sent.wait()  # its gradient is back, so it was received: returns at once
            with trace.op("B", (c, i)):
                if split:
                    x_grad = (torch.autograd.grad(y, x, grad, retain_graph=True)[0]
                              if x.requires_grad else None)
                    held[c, i] = (x, y, grad)  # kept, graph and all, for W
                else:
                    torch.autograd.backward(y, grad)  # input and weight gradients at once
                    x_grad = x.grad
                    del held[c, i]  # frees this micro-batch's activations
            if c > 0:  # chunk 0's input is the tokens: no gradient to send
                grad_sends.append(dist.isend(x_grad, dst=(c - 1) % p, tag=tag("B", c - 1, i)))
        else:  # "W": the weight gradients, accumulated into .grad as a full backward would
            x, y, grad = held.pop((c, i))
            with trace.op("W", (c, i)):
                torch.autograd.backward(y, grad, inputs=list(chunks[c].parameters()))
    for work in grad_sends:
        work.wait()
    return (loss_sum if last in chunks else None), trace
# --8<-- [end:run]


# --8<-- [start:train-step]
def interleaved_train_step(chunks: dict, tokens: torch.Tensor, num_micro_batches: int, rank: int,
                           num_ranks: int, zero_bubble: bool = False):
    """One global batch (B, T+1) forward and backward; returns (mean loss or None, trace)."""
    batch, m = tokens.shape[0], num_micro_batches
    if batch % m:
        raise ValueError(f"batch size {batch} does not divide into num_micro_batches={m}")
    inputs, targets = shift_for_next_token(tokens)
    actions = interleaved_schedule(m, rank, num_ranks, len(chunks), zero_bubble)
    loss, trace = run_interleaved(chunks, actions, rank, num_ranks, list(inputs.chunk(m)),
                                  list(targets.chunk(m)), cross_entropy,
                                  (batch // m, inputs.shape[1], chunks[min(chunks)].hidden_size))
    # The tied matrix: embedding of chunk 0 (rank 0), output head of the last chunk (rank p-1).
    sync_tied_embedding_grads(chunks[min(chunks) if rank == 0 else max(chunks)], rank, num_ranks)
    return loss, trace
# --8<-- [end:train-step]


# --8<-- [start:bubble]
def bubble_over_compute(num_ranks: int, num_micro_batches: int, num_chunks_per_rank: int = 1):
    """Megatron's bubble: idle over compute time per rank, (p - 1)/(v m); (p - 1)/m for plain
    1F1B (v = 1). As a share of the step it is x / (1 + x): (p - 1)/(m + p - 1) for 1F1B."""
    return (num_ranks - 1) / (num_chunks_per_rank * num_micro_batches)


class CountedTime(torch.autograd.Function):
    """A chunk's compute, counted in time units instead of spent: its output holds the time its
    forward ended, its input gradient the time its backward ended (a clock per rank), so the
    clock ends at the span of the step as the processes ran it, without a shared CPU's noise."""

    @staticmethod
    def forward(ctx, x, weight, clock, forward_units, backward_units):
        ctx.clock, ctx.backward_units = clock, backward_units
        clock[0] = max(clock[0], x.max().item()) + forward_units
        return torch.full_like(x, clock[0])

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] = max(ctx.clock[0], grad.max().item()) + ctx.backward_units
        return torch.full_like(grad, ctx.clock[0]), torch.zeros(1), None, None, None


class CountedTimeChunk(nn.Module):
    def __init__(self, clock: list, forward_units: float, backward_units: float):
        super().__init__()
        self.weight, self.clock = nn.Parameter(torch.zeros(1)), clock
        self.units = forward_units, backward_units

    def forward(self, x):
        return CountedTime.apply(x, self.weight, self.clock, *self.units)


def counted_bubble(rank, num_ranks, num_chunks_per_rank, num_micro_batches):
    """Bubble over compute of one step of plain 1F1B (a stage: forward 2 units, backward 4),
    interleaved 1F1B (v chunks of 1/v of that) and zero bubble (B and W: half a backward each)."""
    p, v, m = num_ranks, num_chunks_per_rank, num_micro_batches
    bubbles, zero_loss = {}, lambda y, _: (y * 0).sum()  # gradient 0: "start when free"
    for name in ("1f1b", "interleaved", "zero_bubble"):
        clock, inputs = [0.0], [torch.zeros(1, requires_grad=True) for _ in range(m)]
        if name == "1f1b":
            run_schedule(CountedTimeChunk(clock, 2, 4), one_f_one_b_schedule(m, rank, p), rank,
                         p, inputs, [None] * m, zero_loss, (1,))
        else:
            b = 4 / v / (2 if name == "zero_bubble" else 1)  # W runs the backward a 2nd time
            chunks = {c: CountedTimeChunk(clock, 2 / v, b) for c in range(rank, p * v, p)}
            actions = interleaved_schedule(m, rank, p, v, zero_bubble=name == "zero_bubble")
            run_interleaved(chunks, actions, rank, p, inputs, [None] * m, zero_loss, (1,))
        span = torch.tensor(clock[0])
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the step ends when the last rank does
        bubbles[name] = (span.item() - 6 * m) / (6 * m)  # busy: m forwards and backwards
    return bubbles
# --8<-- [end:bubble]


# --8<-- [start:training]
def train_interleaved(rank, num_ranks, num_chunks_per_rank, num_micro_batches, steps, batch_size,
                      seq_len, zero_bubble=False):
    """Train the tiny GPT, a layer per chunk, a few SGD steps: this rank's weights and losses."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", num_hidden_layers=num_ranks * num_chunks_per_rank))
    chunks = chunks_of_rank(model, rank, num_ranks, num_chunks_per_rank)
    optimizer = torch.optim.SGD(nn.ModuleList(chunks.values()).parameters(),  # tied: once
                                lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)  # the same batches on every rank
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=g)
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
    return ([train_interleaved(rank, p, v, m, steps, batch, seq, zb)["state"] for zb in (0, 1)],
            counted_bubble(rank, p, v, m))


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
    sends = {n: sum(k == "F" and c > 0 or k == "B" and c < p * n - 1 for r in range(p)
                    for k, c, _ in interleaved_schedule(m, r, p, n)) for n in (1, v)}
    print(f"p2p messages per step: 1F1B {sends[1]}, interleaved {sends[v]}")
    for (name, bubble), n in zip(ranks[0][1].items(), (1, v, 3 * v)):  # 1F1B, v, ZB: 3 v
        print(f"bubble / compute, {name:<11}  counted {bubble:.4f}   (p-1)/({n} m) = "
              f"{bubble_over_compute(p, m, n):.4f}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
