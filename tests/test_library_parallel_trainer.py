"""The parallel trainer with PyTorch's parts (snippets/library/parallel_trainer.py) against one
process, against the scratch parts, and through its checkpoints.

As in tests/test_parallel_trainer.py, the comparisons use SGD with momentum (a rounding error
in a gradient stays a rounding error in the weight, so three_d_check.tolerance bounds it) and
the checkpoint checks use AdamW, where what holds is exact: a resume equals the unbroken run
bit for bit, and the file loads in one process with the same weights and moments.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from snippets.dist import spawn
from snippets.library.parallel_trainer import LibraryParts, check_library_layout
from snippets.models.gpt import ConfigError, get_config
from snippets.scratch.parallelize import Layout
from snippets.scratch.three_d_check import tolerance
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig
from snippets.training.parallel_trainer import LibraryParallelTrainer, ParallelTrainer
from tests.test_parallel_trainer import assert_same, one_process_state

STEPS, MICRO_BATCH, MICRO_BATCHES, SEQ = 3, 2, 2, 16
CONFIG = get_config("tiny", num_hidden_layers=4, max_position_embeddings=SEQ)
LAYOUT = Layout(dp=2, tp=2, pp=2)
# The same seams with a one-stage pipeline: the tied embedding and head in one stage, and
# FSDP over four replicas.
OTHERS = [Layout(dp=4, tp=2)]


def settings(batch_size: int = MICRO_BATCH, **overrides) -> TrainConfig:
    # grad_clip 0.5 is below the tiny GPT's gradient norm (about 2 at the start): every step
    # clips, so the global norm itself is compared, not only the gradients.
    base = dict(batch_size=batch_size, grad_accum_steps=MICRO_BATCHES, seq_len=SEQ,
                max_steps=20, lr=0.5, warmup_steps=0, grad_clip=0.5, seed=3, data="dummy")
    return TrainConfig(**{**base, **overrides})


def quiet(trainer):
    trainer.log = lambda message: None
    return trainer


def run_steps(trainer, steps: int) -> list[float]:
    batches = trainer.micro_batches()
    return [trainer.train_step(batches)["loss"] for _ in range(steps)]


def without_pp_sum(trainer) -> float:
    """The planted mistake: each stage clips by its own norm (no all-reduce over the stages)."""
    pp_group, all_reduce = trainer.mesh["pp"].get_group(), dist.all_reduce
    dist.all_reduce = lambda t, *a, group=None, **k: None if group is pp_group else all_reduce(
        t, *a, group=group, **k)
    try:
        return LibraryParts.clip_gradients(trainer)
    finally:
        dist.all_reduce = all_reduce


def train_sgd(trainer_class, plant: bool = False, layout: Layout = LAYOUT) -> dict:
    trainer = quiet(trainer_class(CONFIG, settings(), layout))
    trainer.optimizer = torch.optim.SGD(trainer.raw_model.parameters(), lr=0.5, momentum=0.9)
    if plant:
        trainer.clip_gradients = lambda: without_pp_sum(trainer)
    losses = run_steps(trainer, STEPS)
    full = trainer.full_state()
    return {"losses": losses, "state": None if full is None else full["param"]}


def adamw(trainer_class=LibraryParallelTrainer, layout: Layout = LAYOUT):
    return quiet(trainer_class(CONFIG, settings(lr=3e-3, warmup_steps=2), layout))


def worker(rank: int, world_size: int, directory: str) -> dict:
    """Every 8-process check in one set of processes: starting them costs more than the steps."""
    results = {"library": train_sgd(LibraryParallelTrainer),
               "scratch": train_sgd(ParallelTrainer),
               "planted": train_sgd(LibraryParallelTrainer, plant=True),
               "others": [train_sgd(LibraryParallelTrainer, layout=layout) for layout in OTHERS]}
    unbroken = adamw()
    run_steps(unbroken, 4)
    first = adamw()
    run_steps(first, 2)
    path = os.path.join(directory, "library.pt")
    first.save_checkpoint_once(path)
    resumed = adamw()
    resumed.load_checkpoint(path)
    run_steps(resumed, 2)
    from_one = adamw()
    from_one.load_checkpoint(os.path.join(directory, "one.pt"))
    scratch = adamw(ParallelTrainer)
    scratch.load_checkpoint(path)
    results.update(saved=first.full_state(), unbroken=unbroken.full_state(),
                   resumed=resumed.full_state(), from_one_process=from_one.full_state(),
                   scratch_loaded=scratch.full_state(), path=path)
    return results


def one_process_sgd(dp: int) -> tuple[dict, list, float]:
    """DistributedTrainer in this process on the whole global batch (every replica's rows)."""
    trainer = quiet(DistributedTrainer(CONFIG, settings(MICRO_BATCH * dp)))
    init = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    trainer.optimizer = torch.optim.SGD(trainer.raw_model.parameters(), lr=0.5, momentum=0.9)
    losses = run_steps(trainer, STEPS)
    state = trainer.raw_model.state_dict()
    return state, losses, max((state[k] - init[k]).abs().max().item() for k in state)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """A one-process DistributedTrainer's run, 2 AdamW steps, and its checkpoint."""
    directory = tmp_path_factory.mktemp("library_parallel")
    trainer = quiet(DistributedTrainer(CONFIG, settings(lr=3e-3, warmup_steps=2)))
    run_steps(trainer, 2)
    trainer.save_checkpoint(directory / "one.pt")
    return directory, trainer


@pytest.fixture(scope="module")
def eight(one_process_run):
    return spawn(worker, 8, str(one_process_run[0]), timeout_s=180)[0]


@pytest.fixture(scope="module")
def reference():
    return one_process_sgd(LAYOUT.dp)


def worst_difference(state: dict, expected: dict) -> float:
    return max((state[k] - expected[k]).abs().max().item() for k in expected)


# --8<-- [start:equals-one-process]
def test_dp_tp_pp_with_the_library_equals_one_process_and_the_scratch_parts(eight, reference):
    state, losses, moved = reference
    tokens = MICRO_BATCH * LAYOUT.dp * MICRO_BATCHES
    bound = tolerance(CONFIG, tokens, SEQ, moved)  # fp32 reordering, derived there
    assert worst_difference(eight["library"]["state"], state) < bound
    for ours, one in zip(eight["library"]["losses"], losses):
        assert abs(ours - one) < tolerance(CONFIG, tokens, SEQ, one)
    # Both are within the bound of one process, so of each other within twice it; held to one.
    assert worst_difference(eight["library"]["state"], eight["scratch"]["state"]) < bound


def test_a_one_stage_pipeline_equals_one_process(eight):
    for layout, result in zip(OTHERS, eight["others"]):
        state, losses, moved = one_process_sgd(layout.dp)
        tokens = MICRO_BATCH * layout.dp * MICRO_BATCHES
        bound = tolerance(CONFIG, tokens, SEQ, moved)
        assert worst_difference(result["state"], state) < bound, layout
        for ours, one in zip(result["losses"], losses):
            assert abs(ours - one) < tolerance(CONFIG, tokens, SEQ, one), layout


def test_a_norm_not_summed_over_the_stages_is_caught(eight, reference):
    state, _, moved = reference
    bound = tolerance(CONFIG, MICRO_BATCH * LAYOUT.dp * MICRO_BATCHES, SEQ, moved)
    assert worst_difference(eight["planted"]["state"], state) > 100 * bound
# --8<-- [end:equals-one-process]


def test_a_resumed_library_run_equals_the_unbroken_one_bit_for_bit(eight):
    assert_same(eight["resumed"], eight["unbroken"])


def test_a_library_checkpoint_loads_in_one_process_and_in_the_scratch_trainer(
        eight, one_process_run):
    loader = quiet(DistributedTrainer(CONFIG, settings(lr=3e-3, warmup_steps=2)))
    loader.load_checkpoint(eight["path"])
    assert loader.step == 2
    assert_same(eight["saved"], one_process_state(loader))
    assert_same(eight["scratch_loaded"], one_process_state(loader))
    # and the other way: the one-process file, cut into the library's shards and gathered back
    assert_same(eight["from_one_process"], one_process_state(one_process_run[1]))


@pytest.mark.parametrize("layout,micro_batches,message", [
    (Layout(dp=2, cp=2), 2, "--cp with --library: sequence and context parallelism, "
                            "interleaved stages and the scratch ZeRO-1 are scratch-only "
                            "(--library's FSDP2 shards everything over DP already); drop "
                            "--library, or drop those flags"),
    (Layout(dp=2, zero=1), 2, "--zero with --library"),
    (Layout(tp=2, sp=True, pp=2, virtual_stages=2), 4, "--sp, --virtual-stages with --library"),
    (Layout(pp=4), 2, "--library runs torch's Schedule1F1B, which needs at least as many "
                      "micro-batches as stages: --grad-accum-steps 2 < --pp 4; use "
                      "--grad-accum-steps 4 or more"),
])
def test_what_the_library_does_not_cover_is_one_line_naming_the_fix(layout, micro_batches,
                                                                      message):
    with pytest.raises(ConfigError) as err:
        check_library_layout(layout, micro_batches)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
