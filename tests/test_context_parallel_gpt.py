"""The course GPT under context parallelism (snippets/scratch/context_parallel_gpt.py) against one
process: RoPE positions (exact), the forward's logits, and training for a few steps under cp=2,
DP x CP = 2 x 2 and CP x TP = 2 x 2 (TP applied before and after CP), within the bound
`tolerance` derives; and two planted mistakes, caught: no gradient average over the CP ranks,
and RoPE at positions 0 .. T/cp-1 instead of the rank's own. Each layout is spawned once (a
module-scoped fixture) and every test reads its results."""

import pytest
import torch

from snippets.dist import spawn
from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.scratch import context_parallel_gpt
from snippets.scratch.context_parallel import ring_bytes_per_rank, unshard_sequence
from snippets.scratch.context_parallel_gpt import (apply_context_parallel, positions_of_rank,
                                                   shard_batch)
from snippets.scratch.context_parallel_gpt_check import (BATCH, SEQ, STEPS, Layout, compare,
                                                         demo_worker, tolerance, train_cp)
from snippets.scratch.reference import single_process, token_batches

CONFIG = get_config("tiny")


def test_positions_of_rank_are_the_global_positions_of_the_two_chunks():
    assert positions_of_rank(8, 0, 1).tolist() == list(range(8))
    assert positions_of_rank(8, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions_of_rank(8, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [positions_of_rank(4, r, 4).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    every = torch.cat([positions_of_rank(6, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))  # each position exactly once
    with pytest.raises(ValueError, match="even number"):
        positions_of_rank(5, 0, 2)


def test_shard_batch_takes_the_same_tokens_as_the_positions():
    inputs, targets = shift_for_next_token(torch.arange(2 * 17).view(2, 17))
    for rank in range(2):
        mine, my_targets = shard_batch(inputs, targets, rank, 2)
        assert torch.equal(mine, inputs[:, positions_of_rank(8, rank, 2)])
        assert torch.equal(my_targets, mine + 1)  # each target still follows its input
    with pytest.raises(ConfigError) as err:
        shard_batch(inputs[:, :14], targets[:, :14], 0, 2)
    assert str(err.value) == ("sequence length 14 does not divide into 2 x cp = 4 chunks (each "
                              "CP rank holds two); use a sequence length that is a multiple of "
                              "4, e.g. 12 or 16")


def one_batch():
    return shift_for_next_token(next(token_batches(CONFIG.vocab_size, 1, BATCH, SEQ)))


def forward(rank, world_size, whole_model=True):
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply_context_parallel(model if whole_model else model.layers)
    logits, loss = model(*shard_batch(*one_batch(), rank, world_size))
    return logits.detach(), loss.item()


def local_positions(local_len, rank, size):
    """The planted RoPE mistake: every rank rotates as if its tokens were the first ones."""
    return torch.arange(local_len)


def cp2_worker(rank, world_size):
    results = {"forward": forward(rank, world_size),
               "forward_layers": forward(rank, world_size, whole_model=False),
               **demo_worker(rank, world_size, Layout(cp=2))}
    context_parallel_gpt.positions_of_rank = local_positions  # this process only
    results["rope_forward"] = forward(rank, world_size)
    results["rope"] = train_cp(rank, world_size, Layout(cp=2), STEPS, BATCH, SEQ)
    return results


def cp2_tp2_worker(rank, world_size):
    layout = Layout(cp=2, tp=2)
    return {order: train_cp(rank, world_size, layout, STEPS, BATCH, SEQ, tp_after_cp=after)
            for order, after in (("tp_first", False), ("cp_first", True))}


@pytest.fixture(scope="module")
def reference():
    state, losses = single_process(STEPS, BATCH, SEQ)
    torch.manual_seed(0)
    init = GPT(CONFIG).state_dict()
    moved = max((state[k] - init[k]).abs().max().item() for k in state)
    return state, losses, tolerance(CONFIG, BATCH, SEQ, moved)


@pytest.fixture(scope="module")
def runs():
    return {"cp2": spawn(cp2_worker, 2, timeout_s=60),
            "dp2_cp2": spawn(demo_worker, 4, Layout(dp=2, cp=2), timeout_s=60),
            "cp2_tp2": spawn(cp2_tp2_worker, 4, timeout_s=60)}


def one_process_forward():
    torch.manual_seed(0)
    logits, loss = GPT(CONFIG)(*one_batch())
    return logits.detach(), loss.item()


# --8<-- [start:tests-forward]
def test_cp_forward_equals_one_process(runs):
    expected, expected_loss = one_process_forward()
    logits = unshard_sequence([r["forward"][0] for r in runs["cp2"]], dim=1)
    # 2 (K + T) u * the largest logit: the sums of one forward in another order (tolerance)
    bound = tolerance(CONFIG, BATCH, SEQ, expected.abs().max().item(), training=False)
    assert (logits - expected).abs().max().item() < bound
    loss = sum(r["forward"][1] for r in runs["cp2"]) / 2  # equal shares of the tokens
    assert abs(loss - expected_loss) < tolerance(CONFIG, BATCH, SEQ, expected_loss, False)
    # converting the layers alone (as a pipeline stage would hold them) is the same model
    for r in runs["cp2"]:
        assert torch.equal(r["forward_layers"][0], r["forward"][0])
# --8<-- [end:tests-forward]


# --8<-- [start:tests-train]
@pytest.mark.parametrize("run, variant", [("cp2", "dp_cp"), ("dp2_cp2", "dp_cp"),
                                          ("cp2_tp2", "tp_first"), ("cp2_tp2", "cp_first")])
def test_cp_training_equals_one_process(runs, reference, run, variant):
    state, losses, bound = reference  # bound: 2 (K + T + B*T) u * the largest weight change
    layout = {"cp2": Layout(cp=2), "dp2_cp2": Layout(dp=2, cp=2),
              "cp2_tp2": Layout(cp=2, tp=2)}[run]
    got = compare([r[variant] for r in runs[run]], layout, state, losses)
    assert got["weights"] < bound, f"weights differ by {got['weights']:.2e}, bound {bound:.2e}"
    for diff, loss in zip(got["losses"], losses):
        assert diff < tolerance(CONFIG, BATCH, SEQ, loss), (diff, loss)
    assert got["replicas_equal"]  # every DP x CP replica holds the very same bits


@pytest.mark.parametrize("run", ["cp2", "dp2_cp2"])
def test_no_gradient_average_over_cp_is_caught(runs, reference, run):
    state, losses, bound = reference
    layout = Layout(cp=2) if run == "cp2" else Layout(dp=2, cp=2)
    got = compare([r["dp"] for r in runs[run]], layout, state, losses)
    # each rank followed the gradient of its own half of the sequence: off by the update's size
    assert got["weights"] > 100 * bound and not got["replicas_equal"]


def test_rope_at_local_positions_is_caught(runs, reference):
    state, losses, bound = reference
    expected, _ = one_process_forward()
    logits = unshard_sequence([r["rope_forward"][0] for r in runs["cp2"]], dim=1)
    logit_bound = tolerance(CONFIG, BATCH, SEQ, expected.abs().max().item(), training=False)
    # Subtler than a missing average: at initialisation the scores are near zero, so rotating
    # q and k by wrong angles moves little: about a hundred bounds, for the logits and for
    # the weights after 3 steps, where the right positions stay near a hundredth of one.
    assert (logits - expected).abs().max().item() > 10 * logit_bound
    got = compare([r["rope"] for r in runs["cp2"]], Layout(cp=2), state, losses)
    assert got["weights"] > 10 * bound
# --8<-- [end:tests-train]


def test_ring_bytes_per_step_match_the_formula(runs):
    for run, layout in (("cp2", Layout(cp=2)), ("dp2_cp2", Layout(dp=2, cp=2)),
                        ("cp2_tp2", Layout(cp=2, tp=2))):
        formula = ring_bytes_per_rank(BATCH // layout.dp, CONFIG.num_attention_heads // layout.tp,
                                      SEQ, CONFIG.head_dim, layout.cp)
        for r in runs[run]:
            variant = r["dp_cp"] if "dp_cp" in r else r["tp_first"]
            assert variant["sent"] == {phase: CONFIG.num_hidden_layers * sent
                                       for phase, (_, sent) in formula.items()}, run
