"""ddp_trainer.py under DDP: N processes x micro-batch B train like one process with batch N x B,
gradient accumulation goes through no_sync, and checkpoints resume a multi-process run."""

import os
import subprocess
import sys

import pytest
import torch

from snippets.dist import spawn
from snippets.models.gpt import get_config
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig
from tests.conftest import ROOT

STEPS = 4


def train(world_size, batch_size, accum, steps=STEPS, resume_from=None, save_to=None):
    config = TrainConfig(batch_size=batch_size, grad_accum_steps=accum, seq_len=32,
                         max_steps=20, warmup_steps=2, lr=3e-3)
    trainer = DistributedTrainer(get_config("tiny"), config, "cpu")
    assert trainer.world_size == world_size
    if resume_from:
        trainer.load_checkpoint(resume_from)
    batches = trainer.micro_batches()
    stats = [trainer.train_step(batches) for _ in range(steps)]
    if save_to:
        trainer.save_checkpoint_once(save_to)
    moments = {n: trainer.optimizer.state[p]["exp_avg"].clone()
               for n, p in trainer.raw_model.named_parameters()}
    return ([s["loss"] for s in stats], {k: v.clone() for k, v in trainer.raw_model.state_dict().items()},
            [s["grad_norm"] for s in stats], moments)


def ddp_worker(rank, world_size, batch_size, accum, steps=STEPS, resume_from=None, save_to=None):
    torch.set_num_threads(1)
    return train(world_size, batch_size, accum, steps, resume_from, save_to)


# Why these tolerances. Not bit-exact: the gradient is averaged over ranks (and micro-batches)
# instead of taken over one batch, a different order of fp32 sums.
# - Losses and weights: AdamW turns rounding-level gradient differences into weight differences
#   of ~1e-6 here, far below an update (~3e-3). But Adam divides out the gradient's scale, and
#   clipping rescales it, so a gradient twice too large (a sum over ranks or micro-batches instead
#   of a mean) trains the same weights: these two checks cannot see it.
# - The gradient norm (before clipping) and AdamW's first moment are proportional to the
#   gradient: that bug makes them N times too large, an error of (N - 1) >= 1 times their size.
#   Rounding moves them by ~1e-6 relative. 1e-3 of their size sits far from both.
SCALE_REL = 1e-3


def assert_close_runs(a, b):
    for loss_a, loss_b in zip(a[0], b[0]):
        assert loss_a == pytest.approx(loss_b, abs=1e-5)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=1e-5, msg=name)
    assert a[2] == pytest.approx(b[2], rel=SCALE_REL), "gradient norms differ"
    largest = max(m.abs().max().item() for m in b[3].values())
    worst = max((a[3][n] - b[3][n]).abs().max().item() for n in b[3])
    assert worst < SCALE_REL * largest, f"AdamW exp_avg differs by {worst:.2e} (largest {largest:.2e})"


@pytest.mark.parametrize("world_size, accum", [(2, 1), (2, 2), (4, 1)])
def test_n_processes_train_like_one_process_with_the_global_batch(world_size, accum):
    single = train(1, batch_size=8, accum=1)
    results = spawn(ddp_worker, world_size, 8 // world_size // accum, accum)
    for result in results:
        assert_close_runs(result, single)
    for name in results[0][1]:  # DDP keeps the replicas identical, bit for bit
        assert all(torch.equal(r[1][name], results[0][1][name]) for r in results)


def test_checkpoint_resumes_a_multi_process_run(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    unbroken = spawn(ddp_worker, 2, 4, 1, 6)
    spawn(ddp_worker, 2, 4, 1, 3, None, ckpt)
    resumed = spawn(ddp_worker, 2, 4, 1, 3, ckpt)
    assert resumed[0][0] == unbroken[0][0][3:]  # exact: same state, same data, same order
    for name in unbroken[0][1]:
        assert torch.equal(resumed[0][1][name], unbroken[0][1][name]), name


def test_learning_guide_command_under_torchrun(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "snippets/training/ddp_trainer.py", "--model_size", "tiny", "--max_steps", "10",
         "--batch_size", "4", "--seq_len", "32", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x processes 2 x" in result.stdout
    assert result.stdout.count("done: 10 steps") == 1  # only rank 0 prints
    assert (tmp_path / "latest").read_text() == "ckpt-00000010.pt\n"
    assert (tmp_path / "ckpt-00000010.pt").exists()
