"""The training loop of the learning guide, in one process or many (DDP under torchrun).

    python snippets/training/ddp_trainer.py --model-size small --max-steps 50
    torchrun --nproc_per_node=2 snippets/training/ddp_trainer.py --model-size small --max-steps 50

`DistributedTrainer` holds the four pieces of a real pretraining loop, each one an exercise:

* `_setup_optimizer()`  (exercise 8, in optim.py): AdamW with weight decay on matrices only.
* `get_lr(step)`        (exercise 9, in optim.py): linear warmup, then cosine decay to a floor.
* `train_step()`        (exercise 10): gradient accumulation, clipping, one optimizer step.
* `save_checkpoint()` / `load_checkpoint()` (exercise 11): resume exactly where a run stopped.

The same file runs in one process or, under torchrun, in many: `rank` and `world_size` come
from the environment torchrun sets (0 and 1 without it), `_wrap_model()` wraps the model in
DistributedDataParallel, `_grad_sync()` skips the all-reduce on all but the last micro-batch,
every rank takes its own slice of each global batch, and only rank 0 prints and writes
checkpoints. Search for "DDP seam" to find each spot.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from snippets.data.corpus import DataError
from snippets.data.dataset import RandomWindowSampler, load_tokens, train_val_split
from snippets.data.tokenizer import ByteTokenizer
from snippets.dist import default_backend, init_from_env, leave_process_group, run_main
from snippets.machine import DeviceError, pick_device
from snippets.models.gpt import CONFIGS, GPT, ConfigError, GPTConfig, get_config
from snippets.models.gpt import shift_for_next_token
from snippets.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    config_diff,
    refuse_earlier_run,
    restore_rng_state,
    seed_everything,
    unwrap_model,
)
from snippets.training.checkpoint import load_checkpoint as load_verified
from snippets.training.checkpoint import save_checkpoint as save_atomic
from snippets.training.optim import build_optimizer, lr_at
from snippets.flags import Parser, error_exit, float_at_least, int_at_least, positive_float


# --8<-- [start:train-config]
@dataclass
class TrainConfig:
    """Everything about *how* to train; the model's shape lives in GPTConfig."""

    batch_size: int = 8          # micro-batch: sequences per forward/backward, per process
    grad_accum_steps: int = 1    # micro-batches summed into one optimizer step
    seq_len: int | None = None   # tokens per sequence; None = the model's context length
    max_steps: int = 200         # optimizer steps; the lr schedule ends here
    lr: float = 3e-3             # peak learning rate, reached at the end of warmup
    min_lr: float | None = None  # the floor of the cosine decay; None = lr / 10
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0       # max global gradient norm; 0 turns clipping off
    seed: int = 1337
    data: str = "builtin"        # "builtin" (generated corpus), "dummy" (random), or a file

    def __post_init__(self):
        if self.min_lr is None:
            # Decaying to ~10% of the peak, not to 0, is the usual choice (Chinchilla, Llama).
            self.min_lr = self.lr / 10
        for name in ("batch_size", "grad_accum_steps", "max_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.warmup_steps < 0 or self.lr <= 0 or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"need warmup_steps >= 0 and 0 <= min_lr <= lr, got "
                              f"warmup_steps={self.warmup_steps}, lr={self.lr}, "
                              f"min_lr={self.min_lr}")
# --8<-- [end:train-config]


# --8<-- [start:dummy-data]
class DummyBatches:
    """Uniformly random token ids: exercises the whole loop with no data pipeline at all.

    There is nothing to learn in random tokens, so the loss can only fall to ln(vocab_size)
    (a uniform guess), never below: use it to test plumbing and measure throughput. Same
    interface as RandomWindowSampler, so checkpoints save its generator the same way.
    """

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int):
        self.shape = (batch_size, seq_len + 1)  # +1: the shifted target of the last position
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        self.batches_drawn += 1
        return torch.randint(0, self.vocab_size, self.shape, generator=self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])
# --8<-- [end:dummy-data]


class DistributedTrainer:
    """Train a GPT with AdamW, warmup + cosine lr, gradient accumulation and checkpoints."""

    # --8<-- [start:trainer-init]
    def __init__(self, model_config: GPTConfig, train_config: TrainConfig,
                 device: str | torch.device = "cpu"):
        self.config, self.train_config = model_config, train_config
        self.device = torch.device(device)
        # DDP seam: torchrun starts one process per GPU and tells each who it is through
        # these variables. A plain `python` run has none of them: one process, rank 0.
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))  # GPU index on this machine
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.is_main = self.rank == 0  # only rank 0 prints and writes checkpoints
        if self.world_size > 1:
            if not dist.is_initialized():
                # gloo on CPU, nccl on GPUs; every collective has a timeout
                init_from_env("nccl" if self.device.type == "cuda" else "gloo")
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.local_rank)  # one GPU per process

        self.seq_len = train_config.seq_len or model_config.max_position_embeddings
        if self.seq_len > model_config.max_position_embeddings:
            raise ConfigError(f"seq_len={self.seq_len} exceeds the model's "
                              f"max_position_embeddings={model_config.max_position_embeddings}")
        # The same seed on every rank gives every replica the same initial weights.
        seed_everything(train_config.seed)
        self.raw_model = GPT(model_config).to(self.device)  # the bare model, never wrapped
        self.model = self._wrap_model(self.raw_model)        # what forward/backward run on
        self.model.train()
        self.optimizer = self._setup_optimizer()
        self.sampler = self._setup_data()
        self.step = 0  # optimizer steps taken so far; the lr schedule and checkpoints use it
    # --8<-- [end:trainer-init]

    # --8<-- [start:leave]
    def leave(self) -> None:
        """The end of a run: destroy this process's groups, if it is in any. Left alive to the
        interpreter's exit, gloo's threads can abort the finished process with SIGABRT,
        "terminate called without an active exception" (pytorch/pytorch#190489)."""
        if not dist.is_initialized():
            return  # one process, and no group made for it
        if self.world_size > 1:
            leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last
        else:
            dist.destroy_process_group()  # the group of one this process made
    # --8<-- [end:leave]

    def log(self, message: str) -> None:
        if self.is_main:  # N processes printing the same line N times helps nobody
            print(message, flush=True)

    @property
    def tokens_per_step(self) -> int:
        """Tokens behind one optimizer step, summed over accumulation and processes."""
        tc = self.train_config
        return tc.batch_size * tc.grad_accum_steps * self.replicas * self.seq_len

    @property
    def replicas(self) -> int:
        """DDP seam: how many ranks take different rows of each global batch (all of them
        here; the parallel trainer's DP replicas there)."""
        return self.world_size

    @property
    def replica(self) -> int:
        """Which rows this rank takes."""
        return self.rank

    # --8<-- [start:wrap-model]
    def _wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # DDP seam. DistributedDataParallel broadcasts rank 0's weights, then averages the
        # gradients across processes inside every backward(). One process has nothing to
        # average: no wrapper. (Without it, N processes would train N unrelated copies.)
        if self.world_size == 1:
            return model
        device_ids = [self.local_rank] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def _grad_sync(self, last_micro_step: bool):
        # DDP seam. DDP all-reduces gradients inside every backward(); with gradient
        # accumulation only the last micro-batch's backward needs that, so the others run
        # under no_sync() and their gradients just add up locally: one all-reduce per step.
        if self.world_size == 1 or last_micro_step:
            return contextlib.nullcontext()
        return self.model.no_sync()
    # --8<-- [end:wrap-model]

    def _setup_data(self):
        tc = self.train_config
        # DDP seam: every rank draws the same *global* batch (same seed, world_size times the
        # micro-batch) and keeps its own slice of it (micro_batches below). The ranks train on
        # different data, the sampler's state is the same on every rank (so rank 0's copy in
        # a checkpoint resumes all of them), and N processes x batch B see exactly the batches
        # one process with batch N x B would.
        seed, global_batch = tc.seed, tc.batch_size * self.replicas
        if tc.data == "dummy":
            return DummyBatches(self.config.vocab_size, global_batch, self.seq_len, seed)
        tokenizer = ByteTokenizer()
        if self.config.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"byte-level text needs vocab_size >= {tokenizer.vocab_size}, "
                              f"the model has {self.config.vocab_size}; use --data dummy")
        tokens = load_tokens(None if tc.data == "builtin" else tc.data, tokenizer, self.seq_len)
        # Hold out the tail (as train_tiny_transformer does) so a later evaluation measures
        # text this run never trained on.
        train_tokens, _ = train_val_split(tokens, 0.1, self.seq_len)
        return RandomWindowSampler(train_tokens, global_batch, self.seq_len, seed)

    def micro_batches(self):
        """Endless (batch_size, seq_len + 1) token batches: this rank's rows of each global
        batch. Lazy: a batch is drawn only when train_step asks for it, so the sampler state in
        a checkpoint is exactly 'next batch'."""
        while True:
            yield self.sampler.next_batch()[self.replica :: self.replicas]

    def _setup_optimizer(self) -> torch.optim.AdamW:
        """AdamW with weight decay on the matrices only (optim.py, exercise 8)."""
        tc = self.train_config
        optimizer = build_optimizer(self.raw_model, tc.lr, tc.weight_decay)
        decay, no_decay = (group["params"] for group in optimizer.param_groups)
        self.log(f"optimizer groups: weight decay on {len(decay)} tensors "
                 f"({sum(p.numel() for p in decay):,} parameters), none on {len(no_decay)} "
                 f"tensors ({sum(p.numel() for p in no_decay):,} parameters)")
        return optimizer

    def get_lr(self, step: int) -> float:
        """The learning rate for optimizer step `step`: warmup, then cosine decay to min_lr
        (optim.py, exercise 9)."""
        tc = self.train_config
        return lr_at(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.max_steps)

    # --8<-- [start:train-step]
    def train_step(self, batch_iter) -> dict:
        """One optimizer step from grad_accum_steps micro-batches drawn from batch_iter.

        Returns the loss (mean over the micro-batches and processes), the gradient norm before
        clipping, the lr used, and the number of tokens this step trained on (over all
        processes). How the model is laid out over the processes is forward_backward's and
        clip_gradients' business: the parallel trainer (parallel_trainer.py) overrides those
        two and keeps this method."""
        # --8<-- [start:exercise-10]
        lr = self.get_lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, tokens = self.forward_backward(batch_iter)
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        # None instead of zeros: frees the memory now, and the next backward writes the
        # gradient instead of adding to zeros.
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens}
        # --8<-- [end:exercise-10]

    def forward_backward(self, batch_iter) -> tuple[float, int]:
        """Forward and backward of grad_accum_steps micro-batches, the gradients summed into
        .grad and synchronised. Returns (the mean loss over micro-batches and processes, the
        tokens trained on over all processes)."""
        # --8<-- [start:exercise-10-forward-backward]
        accum = self.train_config.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for micro_step in range(accum):
            batch = next(batch_iter).to(self.device)
            inputs, targets = shift_for_next_token(batch)
            with self._grad_sync(last_micro_step=micro_step == accum - 1):
                _, loss = self.model(inputs, targets)
                # Each loss is a mean over its micro-batch, and backward() *adds* into .grad.
                # Dividing by accum turns the sum of accum gradients into the gradient of
                # the mean over all of them: what one batch accum times larger would give,
                # so lr and grad_clip mean the same thing whatever accum is.
                (loss / accum).backward()
            loss_sum += loss.detach()
            tokens += targets.numel()
        # .item() waits for the device: fine once a step. Under DDP each rank's loss covers its
        # own slice; averaged over ranks it is the global batch's loss.
        if self.world_size > 1:
            dist.all_reduce(loss_sum)  # a sum: gloo has no AVG
            loss_sum /= self.world_size
        return (loss_sum / accum).item(), tokens * self.world_size
        # --8<-- [end:exercise-10-forward-backward]

    def clip_gradients(self) -> float:
        """Scale every gradient down if their global norm is above grad_clip, so one bad batch
        cannot throw the weights far. Returns the norm before clipping."""
        # --8<-- [start:exercise-10-clip]
        max_norm = self.train_config.grad_clip if self.train_config.grad_clip > 0 else math.inf
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        # --8<-- [end:exercise-10-clip]
    # --8<-- [end:train-step]

    # --8<-- [start:checkpoint]
    def save_checkpoint(self, path: str | Path) -> Path:
        """Everything needed to continue exactly: weights, AdamW moments, step, data position,
        RNG states, and both configs. Written atomically (see checkpoint.py)."""
        # --8<-- [start:exercise-11-save]
        state = {
            # The bare model: a DDP-wrapped model's keys all start with "module.", and the
            # file would then load only into another wrapped model.
            "model": unwrap_model(self.model).state_dict(),
            # AdamW's running averages: without them a resumed run restarts "cold" and
            # takes different (larger) steps than the unbroken run would have.
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,  # where we are in the lr schedule
            "sampler": self.sampler.state_dict(),  # where we are in the data
            "rng": capture_rng_state(),
            "model_config": self.config.to_dict(),
            "train_config": asdict(self.train_config),
        }
        # Temp file + fsync + rename: a crash mid-write leaves the previous checkpoint intact.
        return save_atomic(path, state)
        # --8<-- [end:exercise-11-save]

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore everything save_checkpoint wrote; training then continues identically.
        Returns the loaded state (the caller may compare its train_config)."""
        # --8<-- [start:exercise-11-load]
        # weights_only=True inside: unpickling can run arbitrary code, so only tensors and
        # plain containers are accepted. map_location="cpu" loads a GPU checkpoint anywhere;
        # load_state_dict then copies each tensor to where the model's own tensor lives.
        state = load_verified(path, map_location="cpu")
        if diff := config_diff(state["model_config"], self.config.to_dict()):
            raise CheckpointError(f"{path} holds a different model (checkpoint -> now: {diff}); "
                                  "use the --model-size it was trained with")
        unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        self.step = state["step"]
        return state
        # --8<-- [end:exercise-11-load]

    def save_checkpoint_once(self, path: str | Path) -> None:
        """DDP seam: the replicas are identical, so rank 0 writes the only copy; the others
        wait, so no rank runs ahead of a checkpoint it may have to resume from."""
        if self.is_main:
            self.save_checkpoint(path)
        if self.world_size > 1:
            dist.barrier()
    # --8<-- [end:checkpoint]


def save_step(trainer, manager: CheckpointManager) -> None:
    """Save the current step as the manager's next checkpoint (rank 0 writes, all wait)."""
    path = manager.path_for(trainer.step)
    trainer.save_checkpoint_once(path)
    if trainer.is_main:
        manager.commit(path)


def build_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The trainers' shared command line (fsdp_trainer.py adds its own options to it)."""
    defaults = TrainConfig()
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_flag("model-size", default="small",
               help=f"a named config ({', '.join(CONFIGS)}) or a JSON config file")
    p.add_argument("--data", default=defaults.data,
                   help="builtin (generated corpus), dummy (random tokens), or a UTF-8 text file")
    p.add_flag("max-steps", "--steps", type=int_at_least(1), default=defaults.max_steps)
    p.add_flag("batch-size", type=int_at_least(1), default=defaults.batch_size,
               help="micro-batch: sequences per forward/backward")
    p.add_flag("grad-accum-steps", type=int_at_least(1), default=defaults.grad_accum_steps)
    p.add_flag("seq-len", "--context-length", type=int_at_least(1), default=None,
               help="tokens per sequence (default: the config's max_position_embeddings)")
    p.add_argument("--lr", type=positive_float, default=defaults.lr, help="peak learning rate")
    p.add_flag("min-lr", type=float_at_least(0), default=None,
               help="final learning rate of the cosine decay (default: lr / 10)")
    p.add_flag("warmup-steps", type=int_at_least(0), default=defaults.warmup_steps)
    p.add_flag("weight-decay", type=float_at_least(0), default=defaults.weight_decay)
    p.add_flag("grad-clip", type=float_at_least(0), default=defaults.grad_clip,
               help="max global gradient norm; 0 disables clipping")
    p.add_argument("--seed", type=int_at_least(0), default=defaults.seed)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "mps", "cuda"])
    p.add_argument("--out", default=out, help="directory for the checkpoints")
    p.add_flag("ckpt-every", type=int_at_least(0), default=100,
               help="save a checkpoint every N steps (and always at the end); 0 = end only")
    p.add_flag("keep-last", type=int_at_least(1), default=3,
               help="checkpoints of this run to keep (earlier runs' are never deleted)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in OUT")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in OUT (deletes only its checkpoints) and start again")
    p.add_flag("log-every", type=int_at_least(1), default=10)
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The checks that involve more than one flag."""
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --out and --overwrite replaces it: pass one")
    if args.min_lr is not None and args.min_lr > args.lr:
        p.error(f"argument --min-lr: must be at most --lr ({args.lr}), got {args.min_lr}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser("Train a GPT in one process, or with DDP under torchrun.",
                     "runs/ddp_trainer")
    return check_args(p, p.parse_args(argv))


def resume_or_start(trainer, manager: CheckpointManager, args, load) -> None:
    """--resume: load the newest good checkpoint with ``load(path)``, which refuses one of
    another model, naming the fields (a damaged newer one is reported in one line and skipped).
    Otherwise refuse to start over an earlier run's checkpoints, unless --overwrite."""
    if args.resume:
        _, path, state = manager.load_newest_good(load)
        then = state["train_config"]
        changed = {k: (now, then.get(k)) for k, now in asdict(trainer.train_config).items()
                   if then.get(k) != now}
        if changed:
            trainer.log(f"warning: settings differ from the checkpoint's (now, then): "
                        f"{changed}; the run will not match an unbroken one")
        trainer.log(f"resumed from {path} at step {trainer.step}")
        return
    if not manager.checkpoints():
        return
    refuse_earlier_run([manager.describe()], manager.directory, overwrite=args.overwrite,
                       resume=True)
    if trainer.is_main:
        manager.remove_all()
    trainer.log(f"--overwrite: removed the earlier run's checkpoints from {manager.directory}")


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        batch_size=args.batch_size, grad_accum_steps=args.grad_accum_steps,
        seq_len=args.seq_len, max_steps=args.max_steps, lr=args.lr, min_lr=args.min_lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, seed=args.seed, data=args.data)


def pick_trainer_device(preference: str) -> tuple[torch.device, str | None]:
    """pick_device, plus two rules for several processes. NCCL runs one process per GPU, so
    with fewer GPUs than processes on this machine (LOCAL_WORLD_SIZE) 'auto' takes the CPU and
    an explicit 'cuda' is refused. Without CUDA they talk through gloo, which carries CPU and
    CUDA tensors only (torch 2.13.0, `Backend.backend_capability` in
    torch/distributed/distributed_c10d.py), so 'auto' takes the CPU instead of Apple's MPS and
    an explicit 'mps' is refused. Returns the device and a note for the log when 'auto' fell
    back, else None."""
    device = pick_device(preference)
    if device.type == "cuda" and default_backend() == "gloo":  # NCCL: one process per GPU
        processes, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
        if preference == "cuda":
            raise DeviceError(f"--device cuda: {processes} processes on this machine but {gpus} "
                              f"GPU(s), and each process needs its own: start {gpus} "
                              "(--nproc_per_node) or use --device cpu")
        return torch.device("cpu"), (f"note: --device auto chose cpu: {processes} processes "
                                     f"but {gpus} GPU(s), and NCCL needs one GPU per process")
    if device.type != "mps" or int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return device, None
    if preference == "mps":
        raise DeviceError("--device mps works in one process only: several processes "
                          "talk through gloo, which carries CPU and CUDA tensors only; "
                          "use --device cpu")
    return torch.device("cpu"), ("note: --device auto chose cpu, not mps: several processes "
                                 "talk through gloo, which carries CPU and CUDA tensors only")


# --8<-- [start:main]
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        # DDP seam: under torchrun each process then takes cuda:LOCAL_RANK (see __init__).
        device, device_note = pick_trainer_device(args.device)
    except (ValueError, RuntimeError) as err:
        return error_exit(err)
    # Step-numbered files, a `latest` pointer, the newest keep_last of this run's (checkpoint.py).
    manager = CheckpointManager(args.out, keep_last=args.keep_last)
    try:
        train_config = train_config_from_args(args)
        trainer = DistributedTrainer(get_config(args.model_size), train_config, device)
        resume_or_start(trainer, manager, args, load=trainer.load_checkpoint)
    except (ConfigError, DataError, CheckpointError) as err:
        return error_exit(err)

    tc = trainer.train_config
    if device_note:
        trainer.log(device_note)
    trainer.log(f"device {device} | model {args.model_size}: "
                f"{trainer.raw_model.num_parameters():,} parameters | data: {tc.data}")
    trainer.log(f"effective batch = micro-batch {tc.batch_size} x accumulation "
                f"{tc.grad_accum_steps} x processes {trainer.world_size} x seq_len "
                f"{trainer.seq_len} = {trainer.tokens_per_step:,} tokens per optimizer step")
    status = train(trainer, args, save=lambda: save_step(trainer, manager))
    trainer.leave()
    return status


def train(trainer, args: argparse.Namespace, save) -> int:
    """Run optimizer steps up to max_steps, logging and calling save() every ckpt_every steps
    and at the end. Returns the process exit code."""
    # --8<-- [start:training-loop]
    tc = trainer.train_config
    batches = trainer.micro_batches()
    losses = []
    start = time.perf_counter()
    while trainer.step < tc.max_steps:
        t0 = time.perf_counter()
        stats = trainer.train_step(batches)
        seconds = time.perf_counter() - t0
        losses.append(stats["loss"])
        if not math.isfinite(stats["loss"]):
            print(f"error: loss is {stats['loss']} at step {trainer.step}; "
                  f"try a lower --lr (now {tc.lr})", file=sys.stderr)
            return 1
        if trainer.step % args.log_every == 0 or trainer.step == 1:
            trainer.log(f"step {trainer.step:5d}/{tc.max_steps} | loss {stats['loss']:.4f} | "
                        f"lr {stats['lr']:.2e} | grad norm {stats['grad_norm']:.3f} | "
                        f"{stats['tokens'] / seconds:,.0f} tokens/s")
        if args.ckpt_every and trainer.step % args.ckpt_every == 0:
            save()
    # --8<-- [end:training-loop]
    elapsed = time.perf_counter() - start

    if not losses:
        trainer.log(f"nothing to do: {args.out} is already at step {trainer.step}")
        return 0
    save()
    trainer.log(f"done: {len(losses)} steps in {elapsed:.1f} s "
                f"({len(losses) * trainer.tokens_per_step / elapsed:,.0f} tokens/s) | "
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | checkpoint in {args.out}")
    return 0
# --8<-- [end:main]


if __name__ == "__main__":
    run_main(main)
