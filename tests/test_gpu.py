"""The CUDA/NCCL part of the suite: run by `make test-gpu` on a GPU machine (the GPU workflow).

Elsewhere every test here is skipped with its reason; under REQUIRE_GPU=1 a missing GPU fails.
Tests that need two GPUs (NCCL refuses two ranks on one device) skip on a one-GPU machine, except
under REQUIRE_GPU=1 (`make test-gpu`, the GPU runner), where they fail: a GPU run can never pass by
skipping, so the GPU runner needs two GPUs.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from snippets.dist import spawn
from snippets.scratch.collectives import ring_all_reduce
from snippets.scratch.precision import DynamicLossScaler
from tests.conftest import ROOT

pytestmark = [pytest.mark.cuda(reason="CUDA/NCCL tests for the GPU runner"),
              pytest.mark.kernel_independent("runs only on an NVIDIA GPU (make test-gpu)")]


def need_gpus(n):
    have = torch.cuda.device_count()
    if have >= n:
        return
    why = f"needs {n} GPUs (NCCL runs one rank per GPU); this machine has {have}"
    if os.environ.get("REQUIRE_GPU") == "1":
        pytest.fail(f"REQUIRE_GPU=1: {why}; run `make test-gpu` on a machine with {n} GPUs")
    pytest.skip(why)


def nccl_ring(rank, world_size):
    x = torch.arange(1000, dtype=torch.float32, device="cuda") * (rank + 1)
    expected = x.clone()
    dist.all_reduce(expected)
    ring_all_reduce(x)
    return torch.equal(x, expected)  # integer-valued: exact in any order


def test_ring_all_reduce_on_nccl():
    need_gpus(2)
    world = torch.cuda.device_count()
    assert spawn(nccl_ring, world, backend="nccl") == [True] * world


def test_fp16_autocast_with_scratch_scaler_follows_grad_scaler():
    def run(use_torch):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        kwargs = dict(init_scale=2.0**16, growth_interval=2)
        scaler = torch.amp.GradScaler("cuda", **kwargs) if use_torch else DynamicLossScaler(**kwargs)
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")
        scales = []
        for step in range(8):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if step == 3:
                loss = loss * math.inf  # an overflow, as a too-large scale would cause in fp16
            optimizer.zero_grad()
            if use_torch:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                scaler.scale_loss(loss).backward()
                scaler.step(optimizer)
                scales.append(scaler.scale)
        return scales, [p.detach().cpu() for p in model.parameters()]

    ours, theirs = run(False), run(True)
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b)  # same unscale-and-step; fp16 kernels may differ in ulps


def test_tiny_transformer_trains_on_cuda(tmp_path):
    from snippets.scripts.train_tiny_transformer import parse_args, train

    records = train(parse_args(["--config", "tiny", "--device", "cuda", "--epochs", "1",
                                "--steps-per-epoch", "40", "--out", str(tmp_path)]))
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < 0.8 * losses[0]


def torchrun_on_every_gpu(tmp_path, script, *args, extra=0) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={torch.cuda.device_count() + extra}", script, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_torchrun_scripts_keep_collective_tensors_on_the_gpu(tmp_path):
    """Under NCCL a collective's tensors must be on the GPU ("No backend type associated with
    device type cpu" otherwise): the model, the batches, the checksums, the SIGTERM flag. Session
    B's and C's scripts, on every GPU of the machine (one is enough to catch a CPU tensor)."""
    torchrun_on_every_gpu(tmp_path, "snippets/scripts/ddp_simulation_train.py", "--steps", "3",
                          "--grad-norm", "--log-dir", str(tmp_path / "logs"),
                          "--ckpt", str(tmp_path / "sim.pt"))
    log = (tmp_path / "logs" / "rank_0" / "train.log").read_text()
    assert "replicas in sync: True" in log and "done: 3 steps" in log, log
    out = torchrun_on_every_gpu(tmp_path, "snippets/cluster/multi_node_train.py", "--steps", "2",
                                "--ckpt", str(tmp_path / "multi.pt")).stdout
    assert "step 2 | global loss" in out and (tmp_path / "multi.pt").exists(), out
    out = torchrun_on_every_gpu(tmp_path, "snippets/scratch/collectives_playground.py",
                                "--only", "all_reduce").stdout
    assert out.startswith("all_reduce: Everyone ends with"), out


def test_more_processes_than_gpus_train_on_the_cpu(tmp_path):
    """The CPU pages' `torchrun --nproc_per_node=2` on a machine with fewer GPUs than processes:
    NCCL would give the extra rank a GPU that does not exist ("invalid device ordinal"); the
    scripts take gloo and the CPU instead, and the trainer says why."""
    torchrun_on_every_gpu(tmp_path, "snippets/scripts/ddp_simulation_train.py", "--steps", "2",
                          "--log-dir", str(tmp_path / "logs"), "--ckpt", str(tmp_path / "s.pt"),
                          extra=1)
    assert "done: 2 steps" in (tmp_path / "logs" / "rank_0" / "train.log").read_text()
    out = torchrun_on_every_gpu(tmp_path, "snippets/training/ddp_trainer.py", "--model_size",
                                "tiny", "--max_steps", "2", "--out", str(tmp_path / "ddp"),
                                extra=1).stdout
    assert "note: --device auto chose cpu" in out and "device cpu" in out, out


def nccl_ddp(rank, world_size, variant):
    from torch.nn.parallel import DistributedDataParallel

    from snippets.models.gpt import GPT, get_config, shift_for_next_token
    from snippets.scratch.ddp import OverlappedDDP

    torch.manual_seed(0)
    model = GPT(get_config("tiny")).cuda()
    ddp = OverlappedDDP(model) if variant == "scratch" else DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randint(0, 256, (4 * world_size, 17), generator=g)
        inputs, targets = shift_for_next_token(batch.chunk(world_size)[rank].cuda())
        ddp(inputs, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_overlapped_ddp_on_nccl_matches_torch_ddp():
    need_gpus(2)
    world = torch.cuda.device_count()
    ours = spawn(nccl_ddp, world, "scratch", backend="nccl")
    theirs = spawn(nccl_ddp, world, "torch", backend="nccl")
    for name in theirs[0]:
        # NCCL may sum buckets of different sizes in a different order: close, not bit-equal.
        torch.testing.assert_close(ours[0][name], theirs[0][name], rtol=1e-4, atol=1e-5)
