"""The Session B torchrun demo: rank logs, sharding, sync, and what a failing rank does."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = "snippets/training/ddp_simulation_train.py"


def torchrun(tmp_path: Path, *args, nproc=4, torchrun_args=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         *torchrun_args, SCRIPT, "--log-dir", str(tmp_path / "logs"),
         "--ckpt", str(tmp_path / "ckpt.pt"), "--timeout", "20", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def final_loss(log: Path) -> float:
    return float(re.findall(r"final global loss (\S+)", log.read_text())[-1])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One unbroken 4-rank run, 8 steps, a checkpoint every 3: read by the logging test and
    the reference for the restart test (one torchrun of 5 processes instead of two)."""
    tmp = tmp_path_factory.mktemp("four")
    result = torchrun(tmp, "--steps", "8", "--ckpt-every", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank run of 2 steps with --grad-norm, read by two tests."""
    tmp = tmp_path_factory.mktemp("two")
    result = torchrun(tmp, "--steps", "2", "--grad-norm", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def test_four_workers_log_per_rank_see_different_shards_and_stay_in_sync(four_ranks):
    logs = [(four_ranks / "logs" / f"rank_{r}" / "train.log").read_text() for r in range(4)]
    starts = [re.search(r"starts with examples (\[.*?\])", log).group(1) for log in logs]
    assert len(set(starts)) == 4  # every rank trains on a different slice
    for log in logs:
        assert log.count("replicas in sync: True") == 8
    checksums = [re.findall(r"checksum (\S+)", log)[-1] for log in logs]
    assert len(set(checksums)) == 1


def test_without_gradient_sync_replicas_drift_apart(tmp_path):
    result = torchrun(tmp_path, "--steps", "3", "--no-sync", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "logs" / "rank_0" / "train.log").read_text()
    assert "replicas in sync: False" in log


def test_a_failing_rank_stops_the_job_and_is_named(tmp_path):
    result = torchrun(tmp_path, "--steps", "6", "--fail-rank", "2", "--fail-step", "3")
    assert result.returncode != 0
    # run_main: one line naming the rank, and the traceback recorded for torchrun's summary
    assert "error: rank 2: RuntimeError: simulated failure on rank 2 at step 3" in result.stderr
    root_cause = result.stderr.split("Root Cause")[1]
    assert re.search(r"rank\s*: 2 \(local_rank: 2\)", root_cause)
    assert "error_file: <N/A>" not in root_cause and "simulated failure on rank 2" in root_cause


def test_restart_resumes_from_the_checkpoint_and_reaches_the_same_loss(tmp_path, four_ranks):
    restarted = torchrun(tmp_path / "b", "--steps", "8", "--ckpt-every", "3", "--fail-rank", "2",
                         "--fail-step", "5", torchrun_args=["--max-restarts=1"])
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    log_b = tmp_path / "b" / "logs" / "rank_0" / "train.log"
    assert "resumed from" in log_b.read_text() and "at step 3" in log_b.read_text()
    # Equal to 4 decimals, not bit for bit: DDP regroups its gradient buckets after the first
    # step of every run, so the resumed run sums some gradients in a different order.
    a, b = final_loss(four_ranks / "logs" / "rank_0" / "train.log"), final_loss(log_b)
    assert abs(a - b) < 1e-4, (a, b)


def test_grad_norm_is_measured_before_and_after_the_average(two_ranks):
    pattern = r"step\s+(\d+) .* grad norm local (\S+) synced (\S+)"
    runs = [re.findall(pattern, (two_ranks / "logs" / f"rank_{r}" / "train.log").read_text())
            for r in range(2)]
    assert len(runs[0]) == len(runs[1]) == 2
    for (_, local_0, synced_0), (_, local_1, synced_1) in zip(*runs):
        assert synced_0 == synced_1  # after the all-reduce every rank holds the same gradient
        assert local_0 != local_1  # before it, each rank had its own batch's gradient
        # The norm of an average is at most the average of the norms (triangle inequality).
        assert float(synced_0) <= (float(local_0) + float(local_1)) / 2 + 1e-4


def test_steps_per_epoch_and_tokens_per_step_follow_the_world_size(two_ranks):
    log = (two_ranks / "logs" / "rank_1" / "train.log").read_text()
    # 4616 windows / 2 ranks = 2308 per rank; 2308 // 8 = 288 steps; 8 x 2 x 64 tokens per step.
    assert "shard: 2308 of 4616 examples" in log
    assert "288 steps per epoch; a step trains on 8 sequences x 2 ranks x 64 tokens = 1,024 tokens" in log


def test_a_fresh_run_refuses_an_earlier_checkpoint_and_keeps_it(tmp_path, monkeypatch):
    """Without --resume or --overwrite, a run that finds a checkpoint at --ckpt stops before the
    process group starts, naming the three ways on, and leaves the file as it was."""
    from snippets.training import checkpoint, ddp_simulation_train

    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"an earlier run")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(checkpoint.RunExistsError, match="--resume.*--ckpt.*--overwrite"):
        ddp_simulation_train.main(["--ckpt", str(ckpt)])
    assert ckpt.read_bytes() == b"an earlier run"
    with pytest.raises(SystemExit):  # both at once: argparse's one line
        ddp_simulation_train.main(["--ckpt", str(ckpt), "--resume", "--overwrite"])
