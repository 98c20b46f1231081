"""Interleaved 1F1B from scratch (snippets/scratch/pipeline_interleaved.py): its schedule checked
by simulation, training on 2 ranks with 2 chunks each equal to one process (with and without the
zero-bubble split), the bubble measured against (p-1)/(v m) beside plain 1F1B's (p-1)/m, and
torch.distributed.pipelining's ScheduleInterleaved1F1B against ours. One spawn of 2 processes
runs every distributed case; the tests read its results."""

from __future__ import annotations

import pytest
import torch

from snippets.dist import spawn
from snippets.models.gpt import GPT, ConfigError, get_config
from snippets.scratch.pipeline import split_into_stages
from snippets.scratch.pipeline_interleaved import (ScheduleError, bubble_over_compute,
                                                   chunks_of_rank, interleaved_schedule, simulate)
from snippets.scratch.pipeline_interleaved_check import counted_bubble, train_interleaved
from snippets.scratch.reference import single_process

P, V, M, STEPS, BATCH, SEQ = 2, 2, 4, 3, 8, 16


# --8<-- [start:library]
def torch_interleaved(rank, num_ranks, num_chunks_per_rank, num_micro_batches, steps,
                      batch_size, seq_len, schedule_name="ScheduleInterleaved1F1B"):
    """train_interleaved, with a schedule of torch.distributed.pipelining driving the same
    chunks. V-shaped schedules (ZBV) put chunks r and 2p - 1 - r on rank r instead."""
    import torch.distributed.pipelining as pipelining

    from snippets.models.gpt import shift_for_next_token
    from snippets.scratch.pipeline import cross_entropy, sync_tied_embedding_grads

    p, v, m = num_ranks, num_chunks_per_rank, num_micro_batches
    torch.manual_seed(0)
    model = GPT(get_config("tiny", num_hidden_layers=p * v))
    v_shape = schedule_name == "ScheduleZBVZeroBubble"
    chunks = chunks_of_rank(model, rank, p, v)
    if v_shape:
        stages = split_into_stages(model, p * v)
        chunks = {c: stages[c] for c in sorted({rank, 2 * p - 1 - rank})}
    stages = [pipelining.PipelineStage(chunk, c, p * v, torch.device("cpu"))
              for c, chunk in chunks.items()]
    schedule = getattr(pipelining, schedule_name)(
        stages, n_microbatches=m, scale_grads=False,  # each micro-batch's loss divided by m
        loss_fn=lambda logits, targets: cross_entropy(logits, targets) / m)
    optimizer = torch.optim.SGD(torch.nn.ModuleList(chunks.values()).parameters(), lr=0.5,
                                momentum=0.9)
    g = torch.Generator().manual_seed(1)
    first, last = 0 in chunks, p * v - 1 in chunks
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=g)
        inputs, targets = shift_for_next_token(tokens)
        step_losses = [] if last else None
        schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                      losses=step_losses)
        if not v_shape:  # V: chunk 0 and the last share rank 0, and their tied matrix
            sync_tied_embedding_grads(chunks[min(chunks) if first else max(chunks)], rank, p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(x.item() for x in step_losses) if last else None)
    state = {k: v.clone() for chunk in chunks.values() for k, v in chunk.state_dict().items()}
    order = [(a.computation_type.name, a.stage_index, a.microbatch_index)
             for a in schedule.pipeline_order[rank] if a is not None]
    return {"state": state, "losses": losses, "order": order}
# --8<-- [end:library]


def try_library(rank, schedule_name):
    """A library schedule's result, or the error it raised (as text)."""
    try:
        return torch_interleaved(rank, P, V, M, STEPS, BATCH, SEQ, schedule_name)
    except Exception as err:  # recorded, and asserted on, in test_library_zero_bubble
        return f"{type(err).__name__}: {err}"


def worker(rank, num_ranks):
    return {"ours": train_interleaved(rank, num_ranks, V, M, STEPS, BATCH, SEQ),
            "zero_bubble": train_interleaved(rank, num_ranks, V, M, STEPS, BATCH, SEQ, True),
            "bubble": counted_bubble(rank, num_ranks, V, M),
            **{name: try_library(rank, name) for name in
               ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
                "ScheduleZBVZeroBubble")}}


@pytest.fixture(scope="module")
def runs():
    ranks = spawn(worker, P, timeout_s=30)
    reference, losses = single_process(STEPS, BATCH, SEQ, num_layers=P * V)
    torch.manual_seed(0)
    init = GPT(get_config("tiny", num_hidden_layers=P * V)).state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    return ranks, reference, losses, moved


# --8<-- [start:equals-single-process]
def max_diff(state, reference):
    return max((state[k] - reference[k]).abs().max().item() for k in state)


@pytest.mark.parametrize("variant", ["ours", "zero_bubble"])
def test_interleaved_equals_single_process_training(runs, variant):
    """Every weight of every chunk equals one process's after 3 SGD steps, within 1e-5 of the
    largest change training made to any weight (`moved`). Why that bound: the pipeline does the
    same fp32 operations on the same numbers, but sums a weight's gradient one micro-batch at a
    time (m partial sums added in turn) and the loss as a mean of m means, where one process
    reduces the batch at once. Reordering an fp32 sum changes it by a few ulps of its terms,
    eps = 1.2e-7 relative; through 3 momentum steps that stays within ~10 eps of an update
    (measured here: 6e-7 of `moved`, 5 eps). 1e-5 leaves ~80 eps of room; a real bug (a chunk on
    the wrong rank, a gradient sent to the wrong chunk, a loss not divided by m) moves weights
    by a sizeable fraction of a whole update. Losses: the same argument, relative 1e-6."""
    ranks, reference, ref_losses, moved = runs
    owned = set()
    for result in ranks:
        assert max_diff(result[variant]["state"], reference) < 1e-5 * moved
        owned |= set(result[variant]["state"])
    assert owned == set(reference), "every weight lives on some chunk"
    assert ranks[-1][variant]["losses"] == pytest.approx(ref_losses, rel=1e-6)
# --8<-- [end:equals-single-process]


# --8<-- [start:torch-interleaved]
LIBRARY_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B",
                 "BACKWARD_WEIGHT": "W"}


@pytest.mark.parametrize("ours, theirs", [("ours", "ScheduleInterleaved1F1B"),
                                          ("zero_bubble", "ScheduleInterleavedZeroBubble")])
def test_torch_runs_our_order_and_gets_our_bits(runs, ours, theirs):
    ranks = runs[0]
    for rank, result in enumerate(ranks):
        order = [(LIBRARY_KINDS[k], c, i) for k, c, i in result[theirs]["order"]]
        assert order == interleaved_schedule(M, rank, P, V, zero_bubble=ours == "zero_bubble")
        for key, value in result[ours]["state"].items():  # same order, same arithmetic
            assert torch.equal(value, result[theirs]["state"][key]), key
    assert ranks[-1][theirs]["losses"] == ranks[-1][ours]["losses"]
# --8<-- [end:torch-interleaved]


# --8<-- [start:bubble]
def test_interleaving_divides_the_bubble_counted_in_a_real_run(runs):
    """Counted time units (CountedTime): one step of each schedule, on both processes, with
    their real sends and receives. A stage's forward costs 2 units and its backward 4; a chunk
    1/v of that. Exact: the units are small integers and halves, exact in floating point."""
    for result in runs[0]:
        assert result["bubble"] == {"1f1b": bubble_over_compute(P, M),  # (p-1)/m = 1/4
                                    "interleaved": bubble_over_compute(P, M, V),  # 1/8
                                    "zero_bubble": bubble_over_compute(P, M, 3 * V)}  # 1/24
# --8<-- [end:bubble]


def test_library_zbv_zero_bubble(runs):
    """ScheduleZBVZeroBubble (chunks r and 2p - 1 - r on rank r), as the page reports it."""
    ranks, reference, _, moved = runs
    for result in ranks:
        outcome = result["ScheduleZBVZeroBubble"]
        assert isinstance(outcome, dict), outcome
        assert max_diff(outcome["state"], reference) < 1e-5 * moved


# --8<-- [start:schedule-checks]
@pytest.mark.parametrize("zero_bubble", [False, True], ids=["1f1b", "zero-bubble"])
@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8),
                                     (4, 4, 8), (3, 2, 6)])
def test_schedule_is_complete_deadlock_free_and_hits_the_formula(p, v, m, zero_bubble):
    orders = {r: interleaved_schedule(m, r, p, v, zero_bubble) for r in range(p)}
    # A forward 1 unit per chunk, a backward 2 (or input and weight gradients 1 each).
    duration = {"F": 1, "B": 1, "W": 1} if zero_bubble else {"F": 1, "B": 2}
    timeline = simulate(orders, p * v, m, duration)  # raises on a deadlock or a missing action
    span = max(end for acts in timeline.values() for *_, end in acts)
    busy = 3 * v * m  # per rank
    expected = bubble_over_compute(p, m, v) / (3 if zero_bubble else 1)
    assert (span - busy) / busy == pytest.approx(expected)
    for r, acts in timeline.items():
        live = peak = 0
        for kind, *_ in acts:
            live += {"F": 1, "B": 0 if zero_bubble else -1, "W": -1}[kind]
            peak = max(peak, live)
        # Chunk-activations held at once: the warm-up forwards + 1, (v - 1) p + 2 (p - 1 - r)
        # + 1 (plain 1F1B: p - r stages); zero bubble keeps each r backwards longer, until its
        # W: v p on every rank. A chunk is 1/v of a stage.
        warmup = (v - 1) * p + (p - 1 - r) * (1 if zero_bubble else 2)
        assert peak == min(warmup + 1 + (r if zero_bubble else 0), v * m)


def test_chunks_go_round_robin_and_bad_schedules_are_refused():
    model = GPT(get_config("tiny", num_hidden_layers=8))
    assert [sorted(chunks_of_rank(model, r, 2, 2)) for r in range(2)] == [[0, 2], [1, 3]]
    assert [list(chunks_of_rank(model, r, 2, 4)[r + 2].layers) for r in range(2)] == [
        ["2"], ["3"]]
    with pytest.raises(ConfigError, match="num_micro_batches=6 must be a multiple of "
                                          "num_ranks=4"):
        interleaved_schedule(6, 0, 4, 2)
    orders = {r: interleaved_schedule(4, r, 2, 2) for r in range(2)}
    orders[0] = [orders[0][5]] + orders[0][:5] + orders[0][6:]  # B2.0 before its forward
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(orders, 4, 4)
    orders[0] = orders[0][1:]
    with pytest.raises(ScheduleError, match="rank 0 does not run every action"):
        simulate(orders, 4, 4)
# --8<-- [end:schedule-checks]
