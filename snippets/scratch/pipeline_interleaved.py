"""Interleaved 1F1B from scratch: v model chunks per rank, and an optional zero-bubble variant.

The model is cut into p * v chunks; rank r holds chunks r, r + p, ..., r + (v - 1) p
(Megatron-LM's layout), so a micro-batch visits every rank v times. A chunk is 1/v of a stage:
the pipeline fills and drains v times faster, and the bubble shrinks from (p - 1)/m to
(p - 1)/(v m) of the compute time, for about v times the hand-offs.

Zero bubble (Qi et al., 2024) splits a backward into B, the input gradient the previous chunk
waits for, and W, the weight gradient, which can wait.

A schedule is a pure function: a rank in, its ordered list of (kind, chunk, micro-batch) out.
`simulate` replays the lists of all ranks, with no processes, to check them.

Only torch.distributed primitives. Training with it against one process, and the bubble counted
in time units, are in pipeline_interleaved_check.py:
python -m snippets.scratch.pipeline_interleaved_check
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from snippets.models.gpt import GPT, ConfigError, shift_for_next_token
from snippets.scratch.pipeline import cross_entropy, split_into_stages, sync_tied_embedding_grads
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
    p = num_ranks
    v = num_chunks_per_rank
    m = num_micro_batches
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
        if warmup + k < total:
            actions.append(action("F", warmup + k))
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
    duration = duration or {"F": 1, "B": 1, "W": 1}
    p = len(orders)
    split = any(a[0] == "W" for acts in orders.values() for a in acts)
    kinds = "FBW" if split else "FB"
    for r, acts in orders.items():
        expected = [(k, c, i) for k in kinds
                    for c in range(r, num_chunks, p)
                    for i in range(num_micro_batches)]
        if sorted(acts) != sorted(expected):
            raise ScheduleError(f"rank {r} does not run every action of its chunks exactly once")

    def needs(kind, c, i):
        if kind == "F":
            return ("F", c - 1, i) if c > 0 else None
        if kind == "W":
            return ("B", c, i)
        return ("B", c + 1, i) if c < num_chunks - 1 else ("F", c, i)

    done = {}  # action -> the time it ended
    timeline = {r: [] for r in orders}
    position = dict.fromkeys(orders, 0)  # the index of each rank's next action
    free_at = dict.fromkeys(orders, 0)  # when each rank finishes what it is running
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, acts in orders.items():
            while position[r] < len(acts):
                action = acts[position[r]]
                need = needs(*action)
                if need is not None and need not in done:
                    break  # blocked in a receive
                start = max(free_at[r], done[need] if need else 0)
                end = start + duration[action[0]]
                free_at[r] = end
                done[action] = end
                timeline[r].append((*action, start, end))
                position[r] += 1
                progressed = True
        if not progressed:
            waits = {r: orders[r][position[r]] for r in orders if position[r] < len(orders[r])}
            raise ScheduleError(f"deadlock: every rank waits, at {waits}")
    return timeline
# --8<-- [end:simulate]


# --8<-- [start:run]
def run_interleaved(chunks: dict, actions: list, rank: int, num_ranks: int, micro_inputs: list,
                    micro_targets: list, loss_fn, activation_shape: tuple, group=None):
    """Run one step's actions on this rank's chunks. Chunk c sends its output to rank (c + 1) % p,
    its input gradient to rank (c - 1) % p, tagged with the action that receives it (a safeguard:
    same-tag messages arrive in order anyway). Ranks are counted within `group` (the world by
    default). Returns (mean loss on the last rank, trace)."""
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
                x = torch.empty(activation_shape, device=micro_inputs[0].device)
                dist.recv(x, group=group, group_src=(c - 1) % p, tag=tag("F", c, i))
                x.requires_grad_()
            with trace.op("F", (c, i)):
                y = chunks[c](x)
                if c == last:  # divided by m: the summed gradients are the whole batch's
                    y = loss_fn(y, micro_targets[i]) / m
            held[c, i] = (x, y, None if c == last else
                          dist.isend(y.detach(), group=group, group_dst=(c + 1) % p,
                                     tag=tag("F", c + 1, i)))
            loss_sum += y.item() if c == last else 0.0
        elif kind == "B":
            x, y, sent = held[c, i]
            grad = None  # on the last chunk y is the loss: backward starts from it
            if c < last:
                grad = torch.empty_like(y)
                dist.recv(grad, group=group, group_src=(c + 1) % p, tag=tag("B", c, i))
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
                grad_sends.append(dist.isend(x_grad, group=group, group_dst=(c - 1) % p,
                                             tag=tag("B", c - 1, i)))
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
    1F1B (v = 1). As a share of the step it is x / (1 + x): (p - 1)/(m + p - 1) for 1F1B.
    pipeline_interleaved_check.py counts it in time units, from the schedules as they run."""
    return (num_ranks - 1) / (num_chunks_per_rank * num_micro_batches)
# --8<-- [end:bubble]
