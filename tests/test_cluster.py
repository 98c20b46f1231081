"""Session C: rank arithmetic, the fake multi-node launcher, and Lab 3's training script.

The launcher's successful runs, the barrier demos and the two-node torchrun commands run as
blocks of the Session C pages; here are the checks that need assertions: the rank arithmetic,
bad input, and a real job whose rank 3 crashes.
"""

import re
import subprocess
import sys

import pytest

from snippets.cluster.multi_node_train import describe_process, parse_args
from snippets.cluster.node_ranks import RankError, check_answer, global_ranks, worker_env
from snippets.dist import LaunchError
from tests.conftest import ROOT

LAUNCHER = [sys.executable, "-m", "snippets.cluster.fake_multi_node_launcher"]


# --8<-- [start:global-ranks]
def test_global_ranks_node_by_node():
    assert global_ranks(0, 4, 8) == range(0, 8)
    assert global_ranks(2, 4, 8) == range(16, 24)  # "node 3 of 4": the third node
    assert global_ranks(3, 4, 8) == range(24, 32)  # the last node ends at world size - 1
    # Every rank of the job lives on exactly one node.
    everyone = [r for n in range(4) for r in global_ranks(n, 4, 8)]
    assert everyone == list(range(32))


@pytest.mark.parametrize("args, message", [
    ((4, 4, 8), "node ranks count from 0, so they run from 0 to 3"),
    ((-1, 4, 8), "outside a job of num_nodes=4"),
    ((0, 0, 8), "num_nodes=0 must be a positive whole number"),
    ((0, 4, 2.5), "gpus_per_node=2.5 must be a positive whole number"),
])
def test_global_ranks_rejects_nodes_outside_the_job(args, message):
    with pytest.raises(RankError, match=re.escape(message)):
        global_ranks(*args)
# --8<-- [end:global-ranks]


def test_check_answer_explains_the_off_by_one_mistakes():
    assert check_answer("16-23") == (True, check_answer("16 - 23")[1])
    right, why = check_answer("24-31")
    assert not right and why.startswith("off by one node")
    right, why = check_answer("17-24")
    assert not right and why.startswith("off by one rank")
    right, why = check_answer("16-31")
    assert not right and "a node holds 8 ranks, your range has 16" in why
    with pytest.raises(RankError, match="FIRST-LAST"):
        check_answer("sixteen")


def test_worker_env_is_what_a_cluster_sets():
    envs = [worker_env(n, l, 2, 3, "10.0.0.1", 29500) for n in range(2) for l in range(3)]
    assert [e["RANK"] for e in envs] == [str(r) for r in range(6)]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"] * 2
    assert [e["NODE_RANK"] for e in envs] == ["0"] * 3 + ["1"] * 3
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {
        ("10.0.0.1", "29500", "3")}
    with pytest.raises(RankError, match=r"local_rank=3 must be in \[0, procs_per_node=3\)"):
        worker_env(0, 3, 2, 3, "10.0.0.1", 29500)


def test_training_script_refuses_inconsistent_variables(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    env = {"rank": 1, "world_size": 4, "local_rank": 1, "master_addr": "127.0.0.1",
           "master_port": 29500}
    with pytest.raises(LaunchError, match=r"RANK=1 but NODE_RANK=1 x LOCAL_WORLD_SIZE=2 \+ "
                                          r"LOCAL_RANK=1 = 3"):
        describe_process(env)
    assert describe_process({**env, "rank": 3})["node_rank"] == 1


def test_launcher_rejects_a_node_outside_the_job_and_a_missing_port():
    outside = subprocess.run([*LAUNCHER, "--nnodes", "2", "--node-rank", "2", "--master-port",
                              "29500", "x.py"], cwd=ROOT, capture_output=True, text=True)
    assert outside.returncode == 2
    assert "node_rank=2 is outside a job of num_nodes=2" in outside.stderr
    no_port = subprocess.run([*LAUNCHER, "--nnodes", "2", "--node-rank", "1", "x.py"], cwd=ROOT,
                             capture_output=True, text=True)
    assert no_port.returncode == 2 and "same --master-port" in no_port.stderr


# --8<-- [start:failing-rank]
def test_launcher_sets_each_rank_and_names_the_rank_that_failed(tmp_path):
    """2 nodes x 2 processes of the Session B script; rank 3 (node 1, local rank 1) crashes."""
    result = subprocess.run(
        [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "2",
         "snippets/scripts/ddp_simulation_train.py", "--steps", "2", "--fail-rank", "3",
         "--fail-step", "0", "--timeout", "60", "--log-dir", str(tmp_path / "logs"),
         "--ckpt", str(tmp_path / "ckpt.pt")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:]
    # Each process saw the variables a cluster would set, and joined one group of 4.
    for rank, local_rank in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        log = (tmp_path / "logs" / f"rank_{rank}" / "train.log").read_text()
        assert f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE=4" in log
    # The crash is in the output, tagged with who printed it, and the summary names it.
    assert "[node 1 rank 3] error: rank 3: RuntimeError: simulated failure on rank 3" in result.stdout
    assert re.search(r"launcher:\s+1\s+1\s+3\s+FAILED, exit 1", result.stdout)
    assert "job FAILED: node 1, rank 3 (local rank 1) failed first with exit 1" in result.stdout
# --8<-- [end:failing-rank]


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "argument --max-steps: '0' is not a whole number of at least 1"),
    ("--batch-size", "-2", "argument --batch-size: '-2' is not a whole number of at least 1"),
    ("--timeout", "0", "--timeout 0: must be more than 0 seconds"),
])
def test_training_script_refuses_bad_numbers_at_parse_time(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_lab3_script_refuses_an_earlier_runs_checkpoint_and_overwrite_replaces_it(tmp_path):
    """One process under the fake launcher: an earlier checkpoint and a 3-rank run's rank file
    stay untouched without --overwrite (one line, exit 1); with it, both are replaced."""
    import torch

    from snippets.training.checkpoint import load_checkpoint, save_checkpoint

    ckpt, ranked = tmp_path / "ckpt.pt", tmp_path / "ranked"
    save_checkpoint(ckpt, {"step": 99})
    ranked.mkdir()
    (ranked / "rank_00002-of-00003.pt").write_bytes(b"an earlier run's shard")
    job = [*LAUNCHER, "--nnodes", "1", "--nproc-per-node", "1",
           "snippets/cluster/multi_node_train.py", "--steps", "1", "--ckpt", str(ckpt),
           "--ranked-dir", str(ranked)]
    refused = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stdout[-2000:]
    assert (f"error: rank 0: RunExistsError: an earlier run left {ckpt}, "
            f"{ranked / 'rank_00002-of-00003.pt'}: pass another --ckpt (and --ranked-dir) to "
            "keep it, or --overwrite to replace it") in refused.stdout
    assert "step 1" not in refused.stdout  # refused before training
    assert load_checkpoint(ckpt) == {"step": 99}
    assert (ranked / "rank_00002-of-00003.pt").read_bytes() == b"an earlier run's shard"

    done = subprocess.run([*job, "--overwrite"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
    assert load_checkpoint(ckpt)["step"] == 1
    assert sorted(p.name for p in ranked.iterdir()) == [
        "rank_00000-of-00001.pt", "rank_00000-of-00001.pt.json"]
    assert isinstance(load_checkpoint(ranked / "rank_00000-of-00001.pt")["shards"]["model"],
                      torch.Tensor)
