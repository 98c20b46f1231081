"""Pipeline parallelism from scratch (GPipe and 1F1B) against single-process training on the same
global batch, and torch.distributed.pipelining against the from-scratch schedules (gloo, 2 and 4
processes), and the live tensor memory of a step under each schedule (2 processes). One spawn
per number of stages runs every case; the tests read its results."""

from pathlib import Path

import pytest
import torch

from snippets.bench.pipeline_memory import MICRO_BATCHES as MEMORY_MICRO_BATCHES
from snippets.bench.pipeline_memory import memory_worker, plot_svg
from snippets.dist import spawn
from snippets.models.gpt import GPT, ConfigError, get_config
from snippets.scratch.pipeline import (SCHEDULES, gpipe_schedule, one_f_one_b_schedule,
                                       pipeline_train_step, split_into_stages)
from snippets.scratch.pipeline_check import train_pipeline
from snippets.scratch.reference import single_process

STEPS, BATCH, SEQ = 2, 8, 16
MICRO_BATCHES = {2: [2, 4], 4: [4, 8]}  # stages -> micro-batch counts tried
FIGURE = Path(__file__).parents[1] / "docs/assets/figures/pipeline-memory.svg"


def pipeline_worker(rank, world_size, micro_batch_counts):
    results = {m: train_pipeline(rank, world_size, list(SCHEDULES), m, STEPS, BATCH, SEQ)
               for m in micro_batch_counts}
    if world_size == 2:  # torch's schedules and the memory measurement, in the same processes
        results["memory"] = memory_worker(rank, world_size, list(MEMORY_MICRO_BATCHES))
        from snippets.library.pipeline import train_torch_pipeline  # a slow import: only here

        results["torch"] = train_torch_pipeline(rank, world_size, list(SCHEDULES),
                                                micro_batch_counts[-1], STEPS, BATCH, SEQ)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2-stages", "4-stages"])
def runs(request):
    stages = request.param
    ranks = spawn(pipeline_worker, stages, MICRO_BATCHES[stages], timeout_s=120)
    reference, losses = single_process(STEPS, BATCH, SEQ, num_layers=stages)
    torch.manual_seed(0)  # the initial weights, as single_process and the workers build them
    init = GPT(get_config("tiny", num_hidden_layers=stages)).state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    return stages, ranks, reference, losses, moved


# --8<-- [start:equals-single-process]
def assert_close(stage_state, reference, moved):
    """Each weight a stage holds equals the single-process model's, up to fp32 rounding judged
    against how far training moved the weights (`moved`: the largest change of any weight).

    Not bit-exact: one process takes the mean loss over the whole batch, the pipeline the mean of
    the micro-batches' means, and sums their gradients: the same numbers added in another order
    (a few ulps). A real bug (a loss not divided by m, a gradient lost between stages, a tied
    weight updated on one side only) moves weights by the size of a whole update.
    """
    worst = max((stage_state[k] - reference[k]).abs().max().item() for k in stage_state)
    assert worst < 1e-5 * moved, f"differs by {worst:.2e}; training moved weights {moved:.2e}"


def test_both_schedules_equal_single_process_training(runs):
    stages, ranks, reference, ref_losses, moved = runs
    for m in MICRO_BATCHES[stages]:
        for name in SCHEDULES:
            owned = set()
            for rank, result in enumerate(ranks):
                assert_close(result[m][name]["state"], reference, moved)
                owned |= set(result[m][name]["state"])
            assert owned == set(reference), "every weight lives on some stage"
            losses = ranks[-1][m][name]["losses"]  # the last stage computes the loss
            assert losses == pytest.approx(ref_losses, rel=1e-6), (name, m)
# --8<-- [end:equals-single-process]


# --8<-- [start:live-activations]
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m(runs):
    stages, ranks, _, _, _ = runs
    for m in MICRO_BATCHES[stages]:
        for s, result in enumerate(ranks):
            assert result[m]["gpipe"]["traces"][-1].peak_live == m
            assert result[m]["1f1b"]["traces"][-1].peak_live == min(stages - s, m) <= stages
# --8<-- [end:live-activations]


# --8<-- [start:measured-memory]
@pytest.mark.parametrize("runs", [2], indirect=True, ids=["2-stages"])
def test_1f1b_peak_memory_is_flat_in_m_gpipe_grows_with_m(runs):
    """Peak live tensor bytes of one step on each stage s, for m micro-batches of one size.
    Sizes, not timings: exact. The peak comes in a backward, once the stage's gradients exist:
    GPipe's second backward, still holding m - 1 micro-batches, and 1F1B's steady state,
    holding p - s. So 1F1B's peak is GPipe's with p - s + 1 micro-batches, whatever m is."""
    p, ranks = runs[0], runs[1]
    for s, result in enumerate(ranks):
        gpipe = {m: result["memory"]["gpipe", m] for m in MEMORY_MICRO_BATCHES}
        a = (gpipe[4] - gpipe[2]) // 2  # one micro-batch's activations on this stage
        assert a > 0

        def gpipe_peak(m):  # GPipe's peak grows by a with every micro-batch
            return gpipe[2] + (m - 2) * a

        for m in MEMORY_MICRO_BATCHES:
            assert gpipe[m] == gpipe_peak(m), (s, m)
            # With m <= p - s micro-batches, 1F1B is GPipe: all forwards come first.
            assert result["memory"]["1f1b", m] == gpipe_peak(min(m, p - s + 1)), (s, m)


@pytest.mark.parametrize("runs", [2], indirect=True, ids=["2-stages"])
def test_the_page_plots_these_peaks(runs, tmp_path):
    plot_svg([result["memory"] for result in runs[1]], tmp_path / "plot.svg")
    assert (tmp_path / "plot.svg").read_bytes() == FIGURE.read_bytes(), (
        "the figure is stale: python -m snippets.bench.pipeline_memory --svg " + str(FIGURE))
# --8<-- [end:measured-memory]


# --8<-- [start:torch-pipelining]
@pytest.mark.parametrize("runs", [2], indirect=True, ids=["2-stages"])
def test_torch_pipelining_equals_the_from_scratch_schedules(runs):
    stages, ranks, reference, _, moved = runs
    m = MICRO_BATCHES[stages][-1]
    for name in SCHEDULES:
        for result in ranks:
            ours, theirs = result[m][name], result["torch"][name]
            # Same stage modules, same micro-batches, same order of backwards: the same bits.
            for key in ours["state"]:
                assert torch.equal(ours["state"][key], theirs["state"][key]), (name, key)
            assert_close(theirs["state"], reference, moved)
        assert ranks[-1]["torch"][name]["losses"] == ranks[-1][m][name]["losses"]
# --8<-- [end:torch-pipelining]


def test_schedules_run_every_forward_before_its_backward():
    assert one_f_one_b_schedule(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                             ("F", 3), ("B", 2), ("B", 3)]
    for schedule in (gpipe_schedule, one_f_one_b_schedule):
        for p, m in [(2, 2), (3, 5), (4, 2), (4, 8)]:
            for s in range(p):
                actions = schedule(m, s, p)
                assert sorted(actions) == sorted([(k, i) for k in "FB" for i in range(m)])
                assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


# --8<-- [start:bad-split]
def test_a_bad_split_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"num_hidden_layers=2 is smaller than num_stages=4"):
        split_into_stages(GPT(get_config("tiny")), 4)
    with pytest.raises(ConfigError, match=r"num_hidden_layers=4 does not divide by num_stages=3"
                                          r".*num_stages in \[1, 2, 4\]"):
        split_into_stages(GPT(get_config("tiny", num_hidden_layers=4)), 3)
    stage = split_into_stages(GPT(get_config("tiny")), 1)[0]
    with pytest.raises(ValueError, match="batch size 8 does not divide into num_micro_batches=3"):
        pipeline_train_step(stage, gpipe_schedule, torch.zeros(8, 17, dtype=torch.long), 3, 0, 1)
# --8<-- [end:bad-split]


def test_the_library_demo_runs_the_pipeline_its_flags_describe(capsys):
    """The flags of `python -m snippets.library.pipeline` set what it runs: 3 stages, not 2."""
    from snippets.library.pipeline import main

    main(["--stages", "3", "--micro-batches", "3", "--batch-size", "3", "--steps", "1"])
    out = capsys.readouterr().out
    assert out.startswith("tiny GPT, 3 stages, 3 micro-batches of 1 x 32 tokens, 1 SGD steps\n")
    assert out.count("weights equal to from scratch: True") == 2, out
