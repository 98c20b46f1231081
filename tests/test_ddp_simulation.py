"""The Session B torchrun demo: rank logs, sharding, sync, and what a failing rank does."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = "snippets/scripts/ddp_simulation_train.py"


def torchrun(tmp_path: Path, *args, nproc=4, torchrun_args=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         *torchrun_args, SCRIPT, "--log-dir", str(tmp_path / "logs"),
         "--ckpt", str(tmp_path / "ckpt.pt"), "--timeout", "20", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One unbroken 2-rank run of 6 steps with --grad-norm and a checkpoint every 2, read by the
    logging tests. Two ranks show everything four do (Lab 2's page runs the four-rank versions)
    with half the processes, each of which pays about 3 s of CPU to import torch and
    torch._dynamo before its first step. A restart under torchrun's --max-restarts, resuming
    from the checkpoint and ending at the unbroken run's loss, is Lab 2's own block (section 4),
    which fails unless both hold."""
    tmp = tmp_path_factory.mktemp("two")
    result = torchrun(tmp, "--steps", "6", "--ckpt-every", "2", "--grad-norm", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def test_workers_log_per_rank_see_different_shards_and_stay_in_sync(two_ranks):
    logs = [(two_ranks / "logs" / f"rank_{r}" / "train.log").read_text() for r in range(2)]
    starts = [re.search(r"starts with examples (\[.*?\])", log).group(1) for log in logs]
    assert len(set(starts)) == 2  # every rank trains on a different slice
    for log in logs:
        assert log.count("replicas in sync: True") == 6
    checksums = [re.findall(r"checksum (\S+)", log)[-1] for log in logs]
    assert len(set(checksums)) == 1


@pytest.fixture(scope="module")
def unsynced_then_failing(tmp_path_factory):
    """One 2-rank run without gradient sync in which rank 1 raises after step 2: the drift shows
    in steps 1 and 2, the failure after them, for the price of one torchrun."""
    tmp = tmp_path_factory.mktemp("fail")
    result = torchrun(tmp, "--steps", "3", "--no-sync", "--fail-rank", "1", "--fail-step", "2",
                      nproc=2)
    return tmp, result


def test_without_gradient_sync_replicas_drift_apart(unsynced_then_failing):
    tmp, _ = unsynced_then_failing
    log = (tmp / "logs" / "rank_0" / "train.log").read_text()
    assert log.count("replicas in sync: False") == 2, log  # steps 1 and 2, then rank 1 fails


def test_a_failing_rank_stops_the_job_and_is_named(unsynced_then_failing):
    _, result = unsynced_then_failing
    assert result.returncode != 0
    # run_main: one line naming the rank, and the traceback recorded for torchrun's summary
    assert "error: rank 1: RuntimeError: simulated failure on rank 1 at step 2" in result.stderr
    root_cause = result.stderr.split("Root Cause")[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause)
    assert "error_file: <N/A>" not in root_cause and "simulated failure on rank 1" in root_cause


def test_grad_norm_is_measured_before_and_after_the_average(two_ranks):
    pattern = r"step\s+(\d+) .* grad norm local (\S+) synced (\S+)"
    runs = [re.findall(pattern, (two_ranks / "logs" / f"rank_{r}" / "train.log").read_text())
            for r in range(2)]
    assert len(runs[0]) == len(runs[1]) == 6
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
    from snippets.scripts import ddp_simulation_train
    from snippets.training import checkpoint

    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"an earlier run")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(checkpoint.RunExistsError, match="--resume.*--ckpt.*--overwrite"):
        ddp_simulation_train.main(["--ckpt", str(ckpt)])
    assert ckpt.read_bytes() == b"an earlier run"
    with pytest.raises(SystemExit):  # both at once: argparse's one line
        ddp_simulation_train.main(["--ckpt", str(ckpt), "--resume", "--overwrite"])


@pytest.fixture(scope="module")
def overwritten_twice(tmp_path_factory):
    """One process, one step, run twice into the same folders with --overwrite."""
    tmp = tmp_path_factory.mktemp("overwrite")
    for _ in range(2):
        result = torchrun(tmp, "--steps", "1", "--overwrite", nproc=1)
        assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def test_overwrite_starts_the_rank_logs_afresh(overwritten_twice):
    """Lab 2 greps the logs: with --overwrite they hold this run only, not the one replaced."""
    log = (overwritten_twice / "logs" / "rank_0" / "train.log").read_text()
    assert log.count("started:") == 1 and log.count("done:") == 1, log


def test_resume_with_another_config_is_one_line_last_on_screen(overwritten_twice, tmp_path):
    """The field that changed, named in one line; not load_state_dict's line per tensor. Under
    torchrun the last text on screen is torchrun's summary of the first failure, which ends
    with the worker's error (its traceback, read from its error file): that one line."""
    for name in ("ckpt.pt", "ckpt.pt.json"):  # the checkpoint and its checksum
        shutil.copy(overwritten_twice / name, tmp_path / name)
    result = torchrun(tmp_path, "--resume", "--config", "small", nproc=2)
    assert result.returncode == 1
    assert "size mismatch" not in result.stderr
    message = (f"CheckpointError: {tmp_path / 'ckpt.pt'} was trained with a different model "
               "config (checkpoint -> --config: hidden_size 64 -> 128, intermediate_size 172 -> "
               "344, num_hidden_layers 2 -> 4, max_position_embeddings 64 -> 128); pass the "
               "--config it was trained with")
    assert f"error: rank 0: {message}\n" in result.stderr  # run_main's line, once per rank
    last = [line for line in result.stderr.splitlines() if line.strip(" =")][-1]
    assert last.endswith(message), result.stderr[-3000:]  # after "snippets.training.checkpoint."
