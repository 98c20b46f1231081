"""Lab 3's training script: what every process of a multi-node job runs.

    python -m snippets.cluster.fake_multi_node_launcher --nnodes 2 --nproc-per-node 2 \\
        snippets/cluster/multi_node_train.py --max-steps 4

The script does not know how many machines there are; it reads who it is from the environment
its launcher set (our fake launcher, torchrun, or SLURM's srun starting torchrun), prints that,
checks it is consistent, and trains the tiny GPT with DistributedDataParallel on the training
split: each rank draws its own random windows, gradients are averaged every step. Rank 0 logs
the global loss, step time and throughput, and writes one checkpoint at the end that
snippets/cluster/evaluate_checkpoint.py evaluates on the held-out split. With --ranked-dir,
every rank also writes its own shard of the weights and Adam moments, one file per rank
(snippets/cluster/ranked_checkpoint.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from snippets.data.dataset import RandomWindowSampler, load_tokens, train_val_split
from snippets.cluster.ranked_checkpoint import (adam_groups, rank_files, remove_rank_files,
                                                save_shard)
from snippets.dist import (LaunchError, StopSignal, collective_device, init_from_env,
                           leave_process_group, run_main)
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import refuse_earlier_run, save_checkpoint
from snippets.flags import Parser, int_at_least, positive_float

VAL_FRACTION = 0.1  # the same split evaluate_checkpoint.py holds out


# --8<-- [start:identity]
def describe_process(env: dict) -> dict:
    """Who this process is in the job, from what the launcher set.

    The node's index has a different name in each launcher: our fake launcher and a torchrun
    command line call it NODE_RANK, torchrun tells its workers GROUP_RANK, SLURM sets
    SLURM_NODEID. The host name tells you which machine you are really on.
    """
    node_rank = next((int(os.environ[name]) for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
                      if name in os.environ), 0)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))
    expected = node_rank * local_world + env["local_rank"]
    if env["rank"] != expected:  # every launcher numbers ranks node by node
        raise LaunchError(f"RANK={env['rank']} but NODE_RANK={node_rank} x LOCAL_WORLD_SIZE="
                          f"{local_world} + LOCAL_RANK={env['local_rank']} = {expected}: the "
                          "launcher's variables disagree; check NODE_RANK and --nproc_per_node")
    return {"rank": env["rank"], "world_size": env["world_size"], "node_rank": node_rank,
            "local_rank": env["local_rank"], "local_world_size": local_world,
            "host": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            "master": f"{env['master_addr']}:{env['master_port']}"}
# --8<-- [end:identity]


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_flag("max-steps", "--steps", dest="steps", type=positive_int, default=4)
    p.add_flag("batch-size", type=positive_int, default=8,
                   help="sequences per rank per step")
    p.add_argument("--config", default="tiny")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--ckpt", default="runs/session-c/ckpt.pt", help="rank 0 writes it at the end")
    p.add_argument("--ranked-dir", default=None,
                   help="also save ranked checkpoints here: each rank writes its own shard")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's --ckpt and rank files in --ranked-dir")
    p.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout:g}: must be more than 0 seconds")
    return args


def earlier_outputs(args) -> list[Path]:
    """What an earlier run left where this one will write: its checkpoint, its rank files."""
    return ([Path(args.ckpt)] if os.path.exists(args.ckpt) else []) + rank_files(args.ranked_dir)


def refuse_earlier_outputs(args) -> None:
    """Every rank stops before training if any rank sees an earlier run's files (a node's disk
    may be its own), unless --overwrite."""
    found = [] if args.overwrite else earlier_outputs(args)
    anyone = torch.tensor([len(found)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
    if anyone.item():
        refuse_earlier_run(found or ["files on another node's disk"], overwrite=args.overwrite,
                           keep="--ckpt (and --ranked-dir)")


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main(argv=None) -> None:
    args = parse_args(argv)
    # From here on SIGTERM (the time limit is near, or the job was cancelled) means: finish
    # the current step, save, and stop. Set first: SLURM may signal early, even mid-start-up.
    stop = StopSignal()
    env = init_from_env(timeout_s=args.timeout)  # NCCL if every local rank has a GPU, else gloo
    me = describe_process(env)
    print(f"rank {me['rank']}/{me['world_size']}: node {me['node_rank']} (host {me['host']}), "
          f"local rank {me['local_rank']} of {me['local_world_size']}, "
          f"rendezvous {me['master']}", flush=True)
    rank, world = me["rank"], me["world_size"]
    device = collective_device()  # cuda:LOCAL_RANK under NCCL, the CPU under gloo

    # --8<-- [start:train]
    config = get_config(args.config)
    refuse_earlier_outputs(args)  # an earlier run's checkpoint stays, unless --overwrite
    context = config.max_position_embeddings
    train_tokens, _ = train_val_split(load_tokens(None, context_length=context), VAL_FRACTION,
                                      context)
    # A different seed per rank: each rank draws its own windows, like a sharded dataset.
    sampler = RandomWindowSampler(train_tokens, args.batch_size, context, seed=args.seed + rank)
    torch.manual_seed(args.seed)  # equal initial weights everywhere (DDP also broadcasts them)
    model = DistributedDataParallel(GPT(config).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tokens_per_step = args.batch_size * context * world
    step_times = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        inputs, targets = shift_for_next_token(sampler.next_batch().to(device))
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # gradients are averaged over all ranks, on all nodes, in here
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # for the log only
        step_times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step} | global loss {global_loss.item() / world:.4f} | "
                  f"step {step_times[-1] * 1e3:.0f} ms | "
                  f"{tokens_per_step / step_times[-1]:,.0f} tokens/s", flush=True)
        if stop.requested():  # every rank agrees: stop after this step, and save it
            if rank == 0:
                print(f"rank 0: stop requested ({stop.received or 'SIGTERM on another rank'}) "
                      f"after step {step}: saving", flush=True)
            break
    # --8<-- [end:train]
    if rank == 0:
        # The first step pays for DDP's bucket set-up: leave it out of the summary.
        steady = statistics.median(step_times[1:] or step_times)
        print(f"done: world size {world}, {tokens_per_step} tokens/step, median step "
              f"{steady * 1e3:.0f} ms, {tokens_per_step / steady:,.0f} tokens/s", flush=True)
        save_checkpoint(args.ckpt, {"model": model.module.state_dict(), "step": step,
                                    "config": asdict(config), "world_size": world})
        print(f"checkpoint: {args.ckpt}", flush=True)
    # --8<-- [start:ranked]
    if args.ranked_dir:  # every rank writes its slice, in parallel: rank_0000R-of-0000N.pt
        if rank == 0:  # --overwrite: an earlier run's rank files go first, whatever its size
            remove_rank_files(args.ranked_dir)
        dist.barrier()
        path = save_shard(args.ranked_dir, step, rank, world,
                          adam_groups(model.module, optimizer))
        print(f"rank {rank}: saved {path}", flush=True)
    dist.barrier()  # a checkpoint is complete only when every rank's file is on disk
    # --8<-- [end:ranked]
    leave_process_group()  # rank 0, which hosts the store, leaves last


if __name__ == "__main__":
    run_main(main)
