"""Process-group start-up: clear errors without a launcher, and no hangs when a rank dies or stalls."""

import time

import pytest
import torch
import torch.distributed as dist

from snippets.dist import LaunchError, read_launch_env, spawn

pytestmark = pytest.mark.kernel_independent("process-group start-up and its errors")


def sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a rank that will never come
    return t.item()


def rank_one_stalls(rank, world_size):
    if rank == 1:
        time.sleep(60)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_spawn_runs_a_collective(world_size):
    assert spawn(sum_of_ranks, world_size) == [sum(range(world_size))] * world_size


def test_a_failing_rank_is_named_in_seconds():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed:(.|\n)*boom on rank 1"):
        spawn(rank_one_raises, 2, timeout_s=30)
    assert time.monotonic() - start < 20


def test_a_stalled_rank_times_out_the_collective():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed:(.|\n)*(imed out|Timeout|timeout)"):
        spawn(rank_one_stalls, 2, timeout_s=3)
    assert time.monotonic() - start < 30


def test_missing_launcher_environment_is_a_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        read_launch_env()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(LaunchError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        read_launch_env()


def mesh_timeouts(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from snippets.dist import init_mesh

    def timeouts(mesh):
        # The gloo backend of each dimension's group, and the timeout it was created with.
        return {name: mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout
                .total_seconds() for name in mesh.mesh_dim_names}

    return (timeouts(init_mesh("cpu", (2, 2), ("replicate", "shard"), timeout_s=7)),
            timeouts(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))))


def test_every_group_of_a_mesh_gets_the_timeout():
    """init_device_mesh alone gives a 2-D mesh's groups torch's default (30 min under gloo), not
    the default group's 60 s: a rank that died would hang FSDP's HYBRID_SHARD for half an hour."""
    for ours, plain in spawn(mesh_timeouts, 4, timeout_s=60):
        assert ours == {"replicate": 7, "shard": 7}
        assert plain == {"replicate": 1800, "shard": 1800}

