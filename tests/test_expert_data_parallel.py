"""EP x DP = 2 x 2 (gloo, 4 processes) against one process: a tiny MoE GPT whose expert gradients
are reduced over their expert-data group only and dense gradients over all ranks gives the same
losses and weights; the bytes each group moves match a formula; and the two classic mistakes
(experts averaged over the world; over the expert-data group without the factor ep), planted as
as their own sync functions in expert_data_parallel_check.py, are caught. One spawn runs all three; every test reads its results."""

import pytest
import torch

from snippets.dist import spawn
from snippets.scratch.expert_data_parallel import (DP, EP, EXPERTS, STEPS, ep_dp_mesh,
                                                   layout_table, moe_gpt)
from snippets.scratch.expert_data_parallel_check import (bound, compare, counted_per_group,
                                                         demo_worker, gather_state, one_process,
                                                         update_gap)

MESH = ep_dp_mesh(EP, DP)


@pytest.fixture(scope="module")
def run():
    ranks = spawn(demo_worker, MESH.size, MESH, timeout_s=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference's sums as the page's run makes them
    try:
        reference, ref_losses = one_process(MESH.size)
        init = moe_gpt().state_dict()
    finally:
        torch.set_num_threads(threads)
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    return ranks, reference, ref_losses, init, moved


def test_layout_puts_ep_innermost_and_copies_of_an_expert_in_one_group():
    assert MESH.groups("tp") == [[0, 1], [2, 3]]  # EP groups: consecutive ranks, one node
    assert MESH.groups("dp") == [[0, 2], [1, 3]]  # expert-data groups: the same experts
    table = layout_table(MESH, EXPERTS).splitlines()
    assert table[2].split()[:5] == ["1", "0", "1", "[2,", "3]"]  # rank 1 holds experts 2, 3


# --8<-- [start:equals-one-process]
def test_ep_dp_training_equals_one_process(run):
    ranks, reference, ref_losses, init, moved = run
    # gather_state also checks that every copy of a weight holds the very same bits
    worst, loss_diffs = compare([r["expert-dp"] for r in ranks], reference, ref_losses)
    assert worst < bound(moved), f"weights differ by {worst:.2e}, bound {bound(moved):.2e}"
    for diff, loss in zip(loss_diffs, ref_losses):
        assert diff < bound(loss), (diff, loss)
    assert len(ref_losses) == STEPS


def test_expert_gradients_averaged_over_the_world_are_caught(run):
    """Plain data parallelism for every weight: same shapes on every rank, so nothing raises,
    but rank 0's expert 0 is averaged with rank 1's expert 2: the two move alike."""
    ranks, reference, ref_losses, init, moved = run
    results = [r["world"] for r in ranks]
    worst, _ = compare(results, reference, ref_losses)
    assert worst > 100 * bound(moved), worst
    assert update_gap(gather_state(results), init, 0, 2) < bound(moved)
    right = gather_state([r["expert-dp"] for r in ranks])
    assert update_gap(right, init, 0, 2) > 100 * bound(moved)  # distinct experts, distinct moves


def test_expert_gradients_divided_by_the_group_size_only_are_caught(run):
    """Averaged over the expert-data group: the right experts, ep times too large."""
    ranks, reference, ref_losses, init, moved = run
    worst, _ = compare([r["expert-dp-mean"] for r in ranks], reference, ref_losses)
    assert worst > 100 * bound(moved), worst
# --8<-- [end:equals-one-process]


def test_bytes_each_group_moves_match_the_formula(run):
    for sync in ("expert-dp", "expert-dp-mean"):  # the world variant reduces over other groups
        rows = counted_per_group([r[sync] for r in run[0]], MESH)
        assert [what for what, *_ in rows] == ["dense all-reduce"] + 2 * ["expert all-reduce"] \
            + 2 * ["all-to-all"]
        for what, group, counted, formula in rows:
            assert counted == formula, (sync, what, group)
