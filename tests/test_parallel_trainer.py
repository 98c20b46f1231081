"""The parallel trainer (snippets/training/parallel_trainer.py) against one process.

Each layout trains the tiny GPT for a few steps and is compared with DistributedTrainer in this
process on the same global batches. The comparison uses SGD with momentum, not AdamW: Adam
divides by sqrt(v), so a gradient that cancels to about zero can flip its sign when the same
numbers are added in another order, and that weight then moves by 2 lr either way, which no
rounding bound covers. SGD moves a weight by lr times its gradient, so a rounding error in the
gradient stays a rounding error in the weight (three_d_check.tolerance derives the bound).
AdamW is what the trainer runs; with it the tests check what holds exactly: a resume equals
the unbroken run bit for bit, and a checkpoint saved at one layout loads at another.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from snippets.dist import DEFAULT_TIMEOUT_S, spawn
from snippets.models.gpt import get_config
from snippets.scratch.parallelize import Layout
from snippets.scratch.three_d_check import tolerance
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig

STEPS, MICRO_BATCH, MICRO_BATCHES, SEQ = 3, 2, 2, 16
CONFIG = get_config("tiny", num_hidden_layers=4, max_position_embeddings=SEQ)


def settings(batch_size: int = MICRO_BATCH, **overrides) -> TrainConfig:
    # grad_clip 0.5 is below the tiny GPT's gradient norm (about 2 at the start), so every
    # step clips: the global norm itself is compared, not only the gradients.
    base = dict(batch_size=batch_size, grad_accum_steps=MICRO_BATCHES, seq_len=SEQ,
                max_steps=20, lr=0.5, warmup_steps=0, grad_clip=0.5, seed=3, data="dummy")
    return TrainConfig(**{**base, **overrides})


def use_sgd(trainer) -> None:
    sgd = torch.optim.SGD(trainer.raw_model.parameters(), lr=0.5, momentum=0.9)
    if getattr(trainer, "layout", None) and trainer.layout.zero:  # ZeRO-1 shards it too
        from snippets.scratch.zero import ShardedOptimizer

        sgd = ShardedOptimizer(sgd, trainer.groups["dp"])
    trainer.optimizer = sgd


def one_process(dp: int) -> tuple[dict, list, float]:
    """DistributedTrainer in this process on the whole global batch (dp replicas' rows)."""
    trainer = DistributedTrainer(CONFIG, settings(MICRO_BATCH * dp))
    trainer.log = lambda message: None
    init = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    use_sgd(trainer)
    batches = trainer.micro_batches()
    losses = [trainer.train_step(batches)["loss"] for _ in range(STEPS)]
    state = trainer.raw_model.state_dict()
    moved = max((state[k] - init[k]).abs().max().item() for k in state)
    return state, losses, moved


# --8<-- [start:worker]
def train_layout(layout: Layout, plant: str | None = None) -> dict:
    """Train STEPS steps at `layout` with SGD; rank 0 returns the gathered full state."""
    from snippets.training import parallel_trainer as pt

    trainer = pt.ParallelTrainer(CONFIG, settings(), layout)
    trainer.log = lambda message: None
    use_sgd(trainer)
    if plant == "sync over the stage":  # every rank of the stage: DP x TP, not DP
        mesh = layout.mesh()
        for p in range(layout.pp):
            ranks = [r for r in range(mesh.size) if mesh.coords(r)["pp"] == p]
            group = dist.new_group(ranks, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
            if trainer.rank in ranks:
                trainer.grad_groups = [group]
    elif plant == "no CP reduction":
        trainer.grad_groups = [trainer.groups["dp"]]
    elif plant == "norm counts copies":  # every rank adds every gradient it holds
        trainer.clip_gradients = lambda: replace_norm(trainer)
    elif plant == "ZeRO-1 without the all-gather":  # the other replicas' shards go stale
        trainer.optimizer.comm.all_gather = lambda full, shard: None
    batches = trainer.micro_batches()
    losses = [trainer.train_step(batches)["loss"] for _ in range(STEPS)]
    full = trainer.full_state()
    return {"losses": losses, "state": None if full is None else full["param"]}
# --8<-- [end:worker]


def replace_norm(trainer) -> float:
    from snippets.training import parallel_trainer as pt

    original = pt.counted_in_norm
    pt.counted_in_norm = lambda *args: True
    try:
        return pt.ParallelTrainer.clip_gradients(trainer)
    finally:
        pt.counted_in_norm = original


def worst_difference(result: dict, reference: dict) -> float:
    return max((result["state"][k] - reference[k]).abs().max().item() for k in reference)


def compare_with_one_process(runs: list, results: list) -> list[tuple]:
    """(layout, plant, worst weight difference, bound, every loss within its bound)."""
    rows = []
    for (layout, plant), result in zip(runs, results):
        reference, ref_losses, moved = one_process(layout.dp)
        tokens = MICRO_BATCH * layout.dp * MICRO_BATCHES
        bound = tolerance(CONFIG, tokens, SEQ, moved)
        losses_ok = all(abs(a - b) < tolerance(CONFIG, tokens, SEQ, b)
                        for a, b in zip(result["losses"], ref_losses))
        rows.append((layout, plant, worst_difference(result, reference), bound, losses_ok))
    return rows


# --8<-- [start:checkpoints]
def make_trainer(layout: Layout):
    from snippets.training.parallel_trainer import ParallelTrainer

    trainer = ParallelTrainer(CONFIG, settings(lr=3e-3, warmup_steps=2), layout)  # AdamW
    trainer.log = lambda message: None
    return trainer


def run_steps(trainer, steps: int) -> None:
    batches = trainer.micro_batches()
    for _ in range(steps):
        trainer.train_step(batches)


def stop_and_resume(layout: Layout, directory: str) -> dict:
    """4 steps unbroken; and 2 steps, saved, then 2 more in a fresh trainer that loads them."""
    unbroken = make_trainer(layout)
    run_steps(unbroken, 4)
    first = make_trainer(layout)
    run_steps(first, 2)
    name = (f"dp{layout.dp}-tp{layout.tp}-pp{layout.pp}-cp{layout.cp}-sp{int(layout.sp)}"
            f"-v{layout.virtual_stages}-z{layout.zero}.pt")
    path = os.path.join(directory, name)
    first.save_checkpoint_once(path)
    resumed = make_trainer(layout)
    resumed.load_checkpoint(path)
    run_steps(resumed, 2)
    return {"unbroken": unbroken.full_state(), "resumed": resumed.full_state(), "path": path}


def load_at(layout: Layout, path: str) -> dict | None:
    trainer = make_trainer(layout)
    trainer.load_checkpoint(path)
    return trainer.full_state()
# --8<-- [end:checkpoints]


ZERO = Layout(dp=2, tp=2, pp=2, zero=1)
EIGHT = [(Layout(dp=2, tp=2, pp=2), None),
         (Layout(dp=2, tp=2, pp=2, sp=True), None),
         (ZERO, None),
         (Layout(dp=2, tp=2, pp=2), "sync over the stage"),
         (Layout(dp=2, tp=2, pp=2), "norm counts copies"),
         (ZERO, "ZeRO-1 without the all-gather")]
FOUR = [(Layout(dp=2, cp=2), None),
        (Layout(dp=2, pp=2, virtual_stages=2), None),
        (Layout(cp=2, tp=2, sp=True), None),
        (Layout(dp=2, cp=2), "no CP reduction")]


def eight_worker(rank: int, world_size: int, directory: str) -> dict:
    """One set of 8 processes for every 8-process check: starting them costs more than
    the tiny model's steps."""
    resumes = [stop_and_resume(layout, directory) for layout in (EIGHT[0][0], EIGHT[1][0], ZERO)]
    return {"compare": [train_layout(layout, plant) for layout, plant in EIGHT],
            "resume": resumes,
            "loaded": [load_at(layout, resumes[0]["path"])
                       for layout in (Layout(pp=2, cp=2, tp=2, sp=True), Layout(dp=4, pp=2),
                                      ZERO)],
            "zero_file_loaded": load_at(Layout(dp=4, pp=2), resumes[2]["path"]),
            "from_one_process": load_at(EIGHT[0][0], os.path.join(directory, "one.pt"))}


def four_worker(rank: int, world_size: int, directory: str) -> dict:
    return {"compare": [train_layout(layout, plant) for layout, plant in FOUR],
            "resume": [stop_and_resume(layout, directory) for layout, _ in FOUR[:2]]}


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """A one-process DistributedTrainer's run, 2 steps, and its checkpoint."""
    directory = tmp_path_factory.mktemp("parallel")
    trainer = DistributedTrainer(CONFIG, settings(lr=3e-3, warmup_steps=2))
    trainer.log = lambda message: None
    run_steps(trainer, 2)
    trainer.save_checkpoint(directory / "one.pt")
    return directory, trainer


@pytest.fixture(scope="module")
def eight(one_process_run):
    return spawn(eight_worker, 8, str(one_process_run[0]), timeout_s=180)[0]


@pytest.fixture(scope="module")
def four(one_process_run):
    return spawn(four_worker, 4, str(one_process_run[0]), timeout_s=180)[0]


# --8<-- [start:equals-one-process]
def assert_equal_unless_planted(rows: list[tuple]) -> None:
    for layout, plant, worst, bound, losses_ok in rows:
        if plant is None:
            assert worst < bound and losses_ok, (layout, worst, bound)
        else:  # each planted mistake is caught
            assert worst > 100 * bound, (plant, worst, bound)


def test_eight_processes_dp_tp_pp_with_and_without_sp_or_zero_equal_one_process(eight):
    assert_equal_unless_planted(compare_with_one_process(EIGHT, eight["compare"]))


def test_four_processes_dp_cp_and_interleaved_equal_one_process(four):
    assert_equal_unless_planted(compare_with_one_process(FOUR, four["compare"]))
# --8<-- [end:equals-one-process]


def one_process_state(trainer) -> dict:
    """A DistributedTrainer's weights and AdamW moments, by parameter name."""
    state = {"param": trainer.raw_model.state_dict(), "exp_avg": {}, "exp_avg_sq": {}}
    for name, param in trainer.raw_model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key][name] = trainer.optimizer.state[param][key]
    return state


def assert_same(gathered: dict, expected: dict) -> None:
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert expected[key], key
        for name, tensor in expected[key].items():
            assert torch.equal(gathered[key][name], tensor), (key, name)


def test_a_resumed_run_equals_the_unbroken_one_bit_for_bit(eight, four):
    # dp x tp x pp, + sp, + ZeRO-1; dp x cp, interleaved
    for run in eight["resume"] + four["resume"]:
        assert_same(run["resumed"], run["unbroken"])


def test_a_checkpoint_loads_at_any_layout_and_in_one_process(eight, one_process_run):
    directory, one = one_process_run
    assert_same(eight["from_one_process"], one_process_state(one))
    # The parallel run's file, loaded by one process: the same weights and moments as every
    # other layout gathers back from it.
    loader = DistributedTrainer(CONFIG, settings(lr=3e-3, warmup_steps=2))
    loader.load_checkpoint(eight["resume"][0]["path"])
    assert loader.step == 2
    for loaded in eight["loaded"]:  # ZeRO-1's shards of it gathered back too
        assert_same(loaded, one_process_state(loader))
    # A ZeRO-1 run's file holds whole moments: it loads without ZeRO, and in one process.
    loader.load_checkpoint(eight["resume"][2]["path"])
    assert_same(eight["zero_file_loaded"], one_process_state(loader))


def torchrun(tmp_path, *args, nproc: int = 2) -> subprocess.CompletedProcess:
    from snippets.ports import free_port

    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         f"--master_port={free_port()}", "snippets/training/parallel_trainer.py",
         "--model-size", "tiny", "--data", "dummy", "--max-steps", "2", "--seq-len", "16",
         "--out", str(tmp_path / "run"), *args],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300)


def last_line(result: subprocess.CompletedProcess) -> str:
    return [line for line in result.stderr.splitlines() if line.strip(" =")][-1]


@pytest.mark.parametrize("flags,message", [
    (["--tp", "4"], "error: dp*pp*cp*tp = 1*1*1*4 = 4 but 2 processes were started: start 4 "
                    "(--nproc_per_node) or change the sizes"),
    (["--cp", "0"], "argument --cp: must be a whole number >= 1, got 0"),
    (["--sp"], "error: --sp splits the sequence inside the tensor-parallel group: it needs "
               "--tp 2 or more"),
    (["--pp", "2", "--virtual-stages", "2"],
     "error: num_hidden_layers=2 does not divide into pp*virtual_stages = 4 chunks: choose "
     "sizes whose product divides the layer count"),
])
def test_a_bad_layout_is_one_line_last_on_screen_under_torchrun(tmp_path, flags, message):
    result = torchrun(tmp_path, *flags)
    assert result.returncode != 0
    # torchrun's own ChildFailedError traceback, and no worker's
    assert result.stderr.count("Traceback (most recent call last)") <= 1, result.stderr[-3000:]
    assert last_line(result).endswith(message), result.stderr[-3000:]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("ckpt-*"))


def test_without_a_launcher_it_trains_as_one_process(tmp_path):
    """`python parallel_trainer.py`: no torchrun, a group of one, the same code path."""
    result = subprocess.run(
        [sys.executable, "snippets/training/parallel_trainer.py", "--model-size", "tiny",
         "--data", "dummy", "--max-steps", "2", "--seq-len", "16", "--out", str(tmp_path / "run")],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "layout dp 1 x pp 1 x cp 1 x tp 1" in result.stdout
    assert (tmp_path / "run" / "latest").exists()


def test_a_run_leaves_its_process_group(tmp_path, monkeypatch):
    """main ends by destroying its groups (trainer.leave): left to the interpreter's exit, gloo's
    groups can abort a finished process ("terminate called without an active exception"), as
    8-process runs of this trainer did in CI. In one process main makes a group of one; none is
    left after it."""
    import torch.distributed as dist

    from snippets.training import parallel_trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert parallel_trainer.main(["--model-size", "tiny", "--data", "dummy", "--max-steps", "1",
                                  "--seq-len", "16", "--out", str(tmp_path / "run")]) == 0
    assert not dist.is_initialized()
