"""Session B demo: the same script, started N times by torchrun, trains one model together.

    torchrun --nproc_per_node=4 snippets/scripts/ddp_simulation_train.py

Each process is a "GPU worker" (a CPU process with the gloo backend here; one GPU each with NCCL
on a GPU machine). Watch for:
- rank-specific logs: logs/rank_N/train.log, one file per process;
- data sharding: DistributedSampler gives each rank a different slice of every epoch;
- gradient synchronisation: after every step the ranks' parameter checksums are equal;
  with --no-sync they drift apart, because each rank trains on its own data alone;
- rank metrics: each rank logs its own loss and speed; --grad-norm adds its gradient norm
  before and after the all-reduce;
- failure: --fail-rank 2 --fail-step 5 kills rank 2; torchrun stops the job and names the rank,
  or with --max-restarts=1 restarts every worker, which resume from the last checkpoint.
"""

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Dataset

from snippets.data.dataset import load_tokens
from snippets.dist import collective_device, init_from_env, leave_process_group, run_main
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import (CheckpointError, config_diff, load_checkpoint,
                                          refuse_earlier_run, save_checkpoint, unwrap_model)
from snippets.flags import Parser, int_at_least, positive_float


class Windows(Dataset):
    """Non-overlapping windows of context + 1 tokens: example i is a fixed piece of the text."""

    def __init__(self, tokens: torch.Tensor, context: int):
        self.tokens, self.size = tokens, context + 1
        self.count = len(tokens) // self.size

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return self.tokens[i * self.size : (i + 1) * self.size].long()


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_flag("max-steps", "--steps", dest="steps", type=int_at_least(1), default=30,
               help="optimizer steps in total")
    p.add_flag("batch-size", type=int_at_least(1), default=8, help="sequences per rank per step")
    p.add_argument("--config", default="tiny")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--log-dir", default="logs", help="each rank writes LOG_DIR/rank_N/train.log")
    p.add_argument("--ckpt", default="runs/ddp_simulation/ckpt.pt")
    p.add_flag("ckpt-every", type=int_at_least(1), default=5)
    p.add_argument("--resume", action="store_true",
                   help="continue from --ckpt if it exists (a torchrun restart always does)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh, deleting the checkpoint at --ckpt and starting the "
                        "rank logs anew")
    p.add_argument("--no-sync", action="store_true",
                   help="skip gradient synchronisation: replicas drift apart")
    p.add_argument("--fail-rank", type=int_at_least(0), default=None,
                   help="rank that crashes on purpose (needs --fail-step)")
    p.add_argument("--fail-step", type=int_at_least(0), default=None,
                   help="step at which it crashes (needs --fail-rank)")
    p.add_argument("--timeout", type=positive_float, default=60,
                   help="seconds a collective may wait")
    p.add_argument("--grad-norm", action="store_true",
                   help="also log each rank's gradient norm before and after synchronisation")
    args = p.parse_args(argv)
    if args.resume and args.overwrite:
        p.error("--resume continues the run at --ckpt and --overwrite deletes it: pass one")
    # A failure that cannot happen would let the run pass silently: refuse it instead.
    world = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
    if (args.fail_rank is None) != (args.fail_step is None):
        p.error("--fail-rank and --fail-step go together: pass both (e.g. --fail-rank 1 "
                "--fail-step 3) or neither")
    if args.fail_rank is not None and args.fail_rank >= world:
        p.error(f"argument --fail-rank: must be a rank of this job, 0 to {world - 1} "
                f"(WORLD_SIZE={world}), got {args.fail_rank}")
    if args.fail_step is not None and args.fail_step >= args.steps:
        p.error(f"argument --fail-step: must be below --max-steps {args.steps} or the failure "
                f"never happens, got {args.fail_step}")
    return args


# --8<-- [start:rank-logger]
def rank_logger(log_dir: str, rank: int, append: bool = True) -> logging.Logger:
    """Each rank writes its own file; only rank 0 also prints, so the terminal stays readable.
    It appends, so that a restarted job continues the same file; a run that replaces an
    earlier one (append=False) starts it afresh."""
    path = Path(log_dir) / f"rank_{rank}" / "train.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"rank{rank}")
    logger.setLevel(logging.INFO)
    formatter = logging.Formatter(f"%(asctime)s rank {rank} | %(message)s", "%H:%M:%S")
    handlers = [logging.FileHandler(path, mode="a" if append else "w")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger
# --8<-- [end:rank-logger]


# --8<-- [start:checksums]
def parameter_checksums(model: torch.nn.Module) -> list[float]:
    """Every rank's sum of all its weights: equal on all ranks iff the replicas are in sync."""
    local = torch.tensor([sum(p.double().sum().item() for p in model.parameters())],
                         dtype=torch.float64, device=collective_device())
    everyone = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    return [t.item() for t in everyone]
# --8<-- [end:checksums]


# --8<-- [start:grad-norm]
class LocalGradNorm:
    """Each rank's own gradient norm, measured before DDP averages it.

    DDP averages the gradients inside backward(), bucket by bucket, so by the time backward
    returns the local gradient is gone. A communication hook sees every bucket just before
    its all-reduce: add up the bucket's squares there, then hand it to DDP's usual averaging.
    """

    def __init__(self):
        self.sum_of_squares = 0.0  # becomes a tensor on the gradients' device

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # Stays on the device: .item() or .cpu() here would stall backward at every bucket.
        self.sum_of_squares = self.sum_of_squares + bucket.buffer().double().pow(2).sum()
        return default_hooks.allreduce_hook(state, bucket)  # state None: the default group

    def pop(self) -> float:
        """This step's local norm (one copy to the host, after backward); reset for the next."""
        norm, self.sum_of_squares = float(self.sum_of_squares) ** 0.5, 0.0
        return norm


def grad_norm(model: torch.nn.Module) -> float:
    """The norm of all gradients as they are now: after backward() with DDP, the averaged one."""
    return torch.linalg.vector_norm(
        torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None])
    ).item()
# --8<-- [end:grad-norm]


def main(argv=None) -> None:
    args = parse_args(argv)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 and not args.resume:  # a restart by torchrun resumes its own checkpoint
        refuse_earlier_run([args.ckpt] if os.path.exists(args.ckpt) else [],
                           overwrite=args.overwrite, keep="--ckpt", resume=True)
    env = init_from_env(timeout_s=args.timeout)
    rank, world = env["rank"], env["world_size"]
    log = rank_logger(args.log_dir, rank, append=restart > 0 or not args.overwrite)
    log.info(f"started: RANK={rank} LOCAL_RANK={env['local_rank']} WORLD_SIZE={world} "
             f"MASTER={env['master_addr']}:{env['master_port']} restart={restart}")

    config = get_config(args.config)
    context = config.max_position_embeddings
    dataset = Windows(load_tokens(None, context_length=context), context)
    # --8<-- [start:sharding]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    log.info(f"shard: {len(sampler)} of {len(dataset)} examples; epoch 0 starts with "
             f"examples {list(sampler)[:4]}")
    log.info(f"{len(loader)} steps per epoch; a step trains on {args.batch_size} sequences x "
             f"{world} ranks x {context} tokens = {args.batch_size * world * context:,} tokens")
    # --8<-- [end:sharding]

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts)
    device = collective_device()  # this rank's GPU under NCCL, the CPU under gloo
    model = GPT(config).to(device)
    if not args.no_sync:
        model = DistributedDataParallel(model)  # gradients are averaged inside backward()
    local_norm = LocalGradNorm() if args.grad_norm and not args.no_sync else None
    if local_norm:
        model.register_comm_hook(None, local_norm.hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step = 0
    if os.path.exists(args.ckpt) and (restart > 0 or args.resume):
        state = load_checkpoint(args.ckpt)
        # A checkpoint saved without its config (an older one) is left to load_state_dict.
        if "config" in state and (diff := config_diff(state["config"], config.to_dict())):
            # A changed head count loads without a shape error and silently computes
            # something else, so every difference is an error, named field by field.
            raise CheckpointError(f"{args.ckpt} was trained with a different model config "
                                  f"(checkpoint -> --config: {diff}); pass the --config it "
                                  "was trained with")
        unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        log.info(f"resumed from {args.ckpt} at step {step}")
    elif rank == 0 and os.path.exists(args.ckpt):
        os.remove(args.ckpt)  # --overwrite (checked before the process group started)

    # --8<-- [start:loop]
    steps_per_epoch = len(loader)
    while step < args.steps:
        epoch, position = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        batches = iter(loader)
        for _ in range(position):  # after a resume, skip what this epoch already trained on
            next(batches)
        for batch in batches:
            if step == args.fail_step and rank == args.fail_rank and restart == 0:
                raise RuntimeError(f"simulated failure on rank {rank} at step {step}")
            start = time.perf_counter()
            inputs, targets = shift_for_next_token(batch.to(device))
            _, loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # with DDP: returns only after every rank's gradients are averaged
            optimizer.step()
            step += 1

            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # the global batch's loss, for logging only
            sums = parameter_checksums(unwrap_model(model))
            tokens_per_s = inputs.numel() / (time.perf_counter() - start)
            norms = ""
            if args.grad_norm:  # with --no-sync nothing is averaged: local is all there is
                local = local_norm.pop() if local_norm else grad_norm(model)
                norms = f" | grad norm local {local:.4f} synced {grad_norm(model):.4f}"
            log.info(f"step {step:3d} | local loss {loss.item():.4f} | global loss "
                     f"{mean_loss.item() / world:.4f} | {tokens_per_s:,.0f} tokens/s | "
                     f"replicas in sync: {len(set(sums)) == 1} | checksum {sums[rank]:.6f}"
                     f"{norms}")
            if step % args.ckpt_every == 0 or step == args.steps:
                if rank == 0:  # one copy is enough: all replicas are identical
                    save_checkpoint(args.ckpt, {"model": unwrap_model(model).state_dict(),
                                                "optimizer": optimizer.state_dict(), "step": step,
                                                "config": config.to_dict()})
                dist.barrier()  # nobody runs ahead of a checkpoint that may be needed
            if step == args.steps:
                break
    # --8<-- [end:loop]
    log.info(f"done: {step} steps, final global loss {mean_loss.item() / world:.4f}")
    leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last


if __name__ == "__main__":
    run_main(main)
