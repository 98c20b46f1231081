"""Train the tiny GPT on one device: the loop every later lesson distributes.

    python snippets/scripts/train_tiny_transformer.py --epochs 2

A plain loop, no Trainer abstraction: sample a batch, forward, loss, backward,
clip, optimizer step, scheduler step. Around it: seeding, periodic validation
on held-out text, metrics as JSON lines plus a loss-curve PNG, and
checkpoints that make ``--resume`` continue *exactly* where a run stopped
(bit-identical losses on CPU).

Everything is importable: ``main(argv)`` is the command line and
``train(args)`` the run itself, returning its metric records.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from snippets.data.corpus import DataError
from snippets.data.dataset import (
    RandomWindowSampler,
    load_tokens,
    sequential_batches,
    train_val_split,
)
from snippets.data.shards import load_tokenizer, read_rank_tokens
from snippets.data.tokenizer import ByteTokenizer
from snippets.machine import DeviceError, pick_device, set_threads
from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    RunExistsError,
    capture_rng_state,
    changed_fields,
    config_diff,
    refuse_earlier_run,
    restore_rng_state,
    seed_everything,
    unwrap_model,
)
from snippets.training.optim import build_optimizer, lr_at
from snippets.flags import Parser, float_at_least, fraction, int_at_least, positive_float

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "models" / "config.json"


class MissingPackageError(RuntimeError):
    """An optional logger (--tensorboard, --wandb) was asked for but is not installed."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where the help text already explains them."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        description="Train the tiny GPT on one device (CPU, CUDA or Apple MPS).",
        formatter_class=_HelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="model config: tiny|small|medium|gpt2-small or a JSON file "
                        "(default: snippets/models/config.json)")
    p.add_argument("--data", default=None,
                   help="UTF-8 text file to train on, or the manifest.json of token shards "
                        "from snippets/data/shards.py (default: the built-in generated corpus)")
    p.add_argument("--epochs", type=int_at_least(1), default=1,
                   help="number of epochs (see --steps-per-epoch)")
    p.add_argument("--steps-per-epoch", type=int_at_least(1), default=None,
                   help="optimizer steps per epoch. Batches are random windows, so an 'epoch' "
                        "is a count, not a shuffle: by default as many steps as it takes to "
                        "draw as many tokens as the training split holds, i.e. "
                        "train_tokens // (batch_size * context_length); every token is then "
                        "seen about once per epoch on average")
    p.add_flag("batch-size", type=int_at_least(1), default=16, help="sequences per step")
    p.add_flag("seq-len", "--context-length", dest="context_length", type=int_at_least(1),
               default=None,
               help="tokens per sequence (default: the config's max_position_embeddings)")
    p.add_argument("--lr", type=positive_float, default=5e-3, help="peak learning rate (AdamW)")
    p.add_flag("warmup-steps", type=int_at_least(0), default=None,
               help="linear warmup steps before the cosine decay (default: 10%% of all steps)")
    p.add_flag("weight-decay", type=float_at_least(0), default=0.1,
               help="AdamW weight decay on weight matrices (not on norm gains)")
    p.add_flag("grad-clip", type=positive_float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int_at_least(0), default=1337,
                   help="seeds model init, the data sampler and every RNG")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto picks cuda, then mps, then cpu")
    p.add_argument("--threads", type=int_at_least(0), default=1,
                   help="CPU threads for PyTorch (default: 1; for the tiny model one thread "
                        "is nearly as fast as several, and does not slow to a crawl when "
                        "other jobs share the cores); 0 = PyTorch's own choice (one per "
                        "core, or $OMP_NUM_THREADS)")
    p.add_argument("--out", default="runs/tiny",
                   help="run directory: metrics.jsonl, loss.png, checkpoints/")
    p.add_flag("ckpt-every", type=int_at_least(0), default=100,
               help="save a checkpoint every N steps (and at the end, or at --max-steps); "
                    "0 = only there")
    p.add_flag("keep-last", type=int_at_least(1), default=3,
               help="checkpoints of this run to keep (earlier runs' are never deleted)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest good checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out, if it has the same model config: delete "
                        "its checkpoints, metrics and plot (only files this script writes) "
                        "and start again")
    p.add_flag("eval-every", type=int_at_least(0), default=50,
               help="validate every N steps (and at the end); 0 = only at the end")
    p.add_argument("--eval-batches", type=int_at_least(1), default=20,
                   help="max validation batches per evaluation")
    p.add_argument("--val-fraction", type=fraction, default=0.1,
                   help="the last fraction of the text held out for validation")
    p.add_flag("max-steps", type=int_at_least(1), default=None,
               help="stop after this global step and save a checkpoint there (no final "
                    "evaluation or sample), so --resume continues from exactly that step")
    p.add_flag("log-every", type=int_at_least(1), default=20,
               help="print a log line every N steps")
    p.add_argument("--sample-tokens", type=int_at_least(0), default=120,
                   help="length of the greedy text sample printed at the end")
    p.add_argument("--tensorboard", action="store_true",
                   help="also log to TensorBoard in OUT/tensorboard (needs: pip install tensorboard)")
    p.add_argument("--wandb", action="store_true",
                   help="also log to Weights & Biases, offline (needs: pip install wandb)")
    args = p.parse_args(argv)
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --out and --overwrite replaces it: pass one")
    return args


# --8<-- [start:evaluate]
@torch.no_grad()
def evaluate(model, tokens, batch_size, context_length, device, max_batches=None) -> float:
    """Mean next-token loss over held-out windows, in order: no randomness involved."""
    model.eval()
    total, count = 0.0, 0
    for batch in sequential_batches(tokens, batch_size, context_length, max_batches):
        inputs, targets = shift_for_next_token(batch.to(device))
        _, loss = model(inputs, targets)
        total += loss.item() * targets.numel()
        count += targets.numel()
    model.train()
    return total / count
# --8<-- [end:evaluate]


# --8<-- [start:sample]
@torch.no_grad()
def sample_text(model, tokenizer, prompt_ids, max_new_tokens, device) -> str:
    """Greedy continuation (argmax each step): deterministic, and draws no random numbers."""
    model.eval()
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)[None]
    out = unwrap_model(model).generate(ids, max_new_tokens, temperature=0)
    model.train()
    return tokenizer.decode(out[0, len(prompt_ids):].tolist())
# --8<-- [end:sample]


def _prompt_from(val: torch.Tensor, length: int) -> list[int]:
    """The first `length` tokens of the validation text, starting at a line if there is one."""
    newline = (val[:200] == ord("\n")).nonzero()
    start = int(newline[0]) + 1 if len(newline) else 0
    return val[start : start + length].tolist()


class MetricsLog:
    """metrics.jsonl (always), TensorBoard and W&B (optional): one record per step and eval."""

    def __init__(self, out: Path, args, config_dict: dict, resume_step: int | None):
        self.path = out / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop records past the checkpoint: those steps are about to be redone.
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        else:
            self.path.write_text("")
        self.file = open(self.path, "a")
        self.tb = self.wandb = None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if args.wandb:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")  # no account or network needed
            self.wandb = wandb.init(project="tiny-transformer", dir=str(out),
                                    config={**vars(args), "model": config_dict})

    @staticmethod
    def check_optional_packages(args) -> None:
        """Fail before training starts, not after, when an optional logger is missing."""
        wanted = {"tensorboard": args.tensorboard, "wandb": args.wandb}
        for package, flag in wanted.items():
            if flag and importlib.util.find_spec(package) is None:
                raise MissingPackageError(f"--{package} needs the {package} package: "
                                          f"pip install {package} (or leave out --{package})")

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in record.items() if k not in ("kind", "step", "epoch")}
        if self.tb:
            for key, value in scalars.items():
                self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
        if self.wandb:
            self.wandb.log({f"{record['kind']}/{k}": v for k, v in scalars.items()},
                           step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def plot_losses(metrics_path: Path, png_path: Path, vocab_size: int) -> None:
    # A bare Figure, not pyplot: no display needed, and no global backend switch that would
    # turn off the inline plots of a notebook calling train().
    from matplotlib.figure import Figure

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), lw=1, label="train loss (per step)")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.axhline(math.log(vocab_size), ls="--", c="gray", lw=1,
               label=f"uniform guess, ln({vocab_size})")
    ax.set(xlabel="step", ylabel="cross-entropy (nats per token)", title="Tiny GPT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


RUN_FILES = ("metrics.jsonl", "run.json", "loss.png")  # what a run writes beside checkpoints/
RUN_FOLDERS = ("checkpoints", "tensorboard", "wandb")


def recorded_config(out: Path, manager: CheckpointManager) -> dict | None:
    """The model config of the run in `out`, from its run.json, else its newest checkpoint."""
    try:
        return json.loads((out / "run.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):  # no run.json, or not one of ours
        pass
    if manager.checkpoints():
        return manager.load_latest(map_location="cpu").state["config"]
    return None


def start_fresh(out: Path, manager: CheckpointManager, overwrite: bool, config: dict) -> None:
    """Refuse to start a run where an earlier one left its files, unless --overwrite and the
    earlier run has the same model config; even then delete only the kinds of file this
    script writes."""
    found = [manager.describe()] if manager.checkpoints() else []
    found += [name for name in RUN_FILES if (out / name).exists()]
    if not found:
        return
    earlier = recorded_config(out, manager)
    if earlier is not None and (changed := changed_fields(earlier, config)):
        # Another config's run is another experiment, not an earlier try at this one: a
        # rerun with an edited config.json must not delete it.
        own_out = out.parent / "-".join(f"{key}-{config.get(key)}" for key in changed)
        raise RunExistsError(f"{out} holds a run of another model config (that run -> "
                             f"--config: {config_diff(earlier, config)}); --resume and "
                             "--overwrite accept only that run's config: give this one its "
                             f"own --out, e.g. --out {own_out}")
    refuse_earlier_run(found, out, overwrite=overwrite, resume=True)
    manager.remove_all()
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for events in (out / "tensorboard").glob("events.out.tfevents.*"):
        events.unlink()
    print(f"--overwrite: removed the earlier run in {out} ({', '.join(found)})")
    kept = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES + RUN_FOLDERS)
    if kept:  # e.g. the pictures Lab 1's inspect_checkpoints.py drew of the removed run
        print(f"--overwrite: kept {', '.join(kept)}, which this script did not write: they "
              "show the run it replaced, not this one")


def train(args: argparse.Namespace) -> list[dict]:
    """Run (or resume) training; returns the metric records written by this call."""
    threads = torch.get_num_threads()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)  # leave in-process callers (tests) as they were


def _train(args: argparse.Namespace) -> list[dict]:
    device = pick_device(args.device)
    MetricsLog.check_optional_packages(args)
    config = get_config(args.config)
    context_length = args.context_length or config.max_position_embeddings
    if context_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-len {context_length} exceeds the config's "
                          f"max_position_embeddings={config.max_position_embeddings}")
    out = Path(args.out)
    seed_everything(args.seed)

    if args.data and args.data.endswith(".json"):
        # --8<-- [start:read-shards]
        # Token shards prepared once by snippets/data/shards.py. One process is rank 0 of 1 and
        # reads every shard; the vocabulary is the data's: the tokenizer it was written with.
        tokenizer = load_tokenizer(args.data)
        files, ids = read_rank_tokens(args.data, rank=0, world_size=1)
        tokens = torch.from_numpy(ids.astype("int32"))
        config = dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
        data_name = f"{args.data} ({len(files)} shards verified, vocab {tokenizer.vocab_size:,})"
        # --8<-- [end:read-shards]
    else:
        tokenizer = ByteTokenizer()
        if config.vocab_size != tokenizer.vocab_size:
            raise ConfigError(f"the byte tokenizer has {tokenizer.vocab_size} tokens but the "
                              f"config has vocab_size={config.vocab_size}; use vocab_size 256")
        tokens = load_tokens(args.data, tokenizer, context_length)
        data_name = args.data or "the built-in generated corpus"
    train_tokens, val_tokens = train_val_split(tokens, args.val_fraction, context_length,
                                               source=str(data_name))
    steps_per_epoch = args.steps_per_epoch or max(
        1, len(train_tokens) // (args.batch_size * context_length))
    total_steps = args.epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 10)

    # --8<-- [start:optimizer]
    model = GPT(config).to(device)
    # AdamW, weight decay on the matrices only, and warmup + cosine: the course's one copy of
    # each (snippets/training/optim.py), which every later trainer uses too.
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    # LambdaLR multiplies --lr by a factor each step: the schedule with a peak of 1 is that
    # factor, decaying to 0.1 (min_lr = lr / 10).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, 1.0, 0.1, warmup, total_steps))
    # --8<-- [end:optimizer]
    sampler = RandomWindowSampler(train_tokens, args.batch_size, context_length, seed=args.seed)
    manager = CheckpointManager(out / "checkpoints", keep_last=args.keep_last)
    hparams = {"batch_size": args.batch_size, "context_length": context_length,
               "lr": args.lr, "total_steps": total_steps, "warmup_steps": warmup,
               "seed": args.seed, "data": str(args.data)}

    # --8<-- [start:resume]
    step = 0
    if args.resume:
        ckpt = manager.load_latest(map_location="cpu")
        if diff := config_diff(ckpt.state["config"], config.to_dict()):
            # A changed head count loads without a shape error and silently computes
            # something else, so every difference is an error, named field by field.
            raise CheckpointError(f"{ckpt.path} was trained with a different model config "
                                  f"(checkpoint -> --config: {diff}); pass the --config it "
                                  "was trained with")
        changed = {k: (ckpt.state["hparams"].get(k), v) for k, v in hparams.items()
                   if ckpt.state["hparams"].get(k) != v}
        if changed:
            logging.warning("resuming with changed settings (was, now): %s; the run will not "
                            "match an unbroken one", changed)
        unwrap_model(model).load_state_dict(ckpt.state["model"])
        optimizer.load_state_dict(ckpt.state["optimizer"])
        scheduler.load_state_dict(ckpt.state["scheduler"])
        sampler.load_state_dict(ckpt.state["sampler"])  # the data position
        restore_rng_state(ckpt.state["rng"])
        step = ckpt.state["step"]
        print(f"resumed from {ckpt.path} at step {step}")
    else:
        start_fresh(out, manager, args.overwrite, config.to_dict())  # never on another run
    # --8<-- [end:resume]
    if args.threads:  # once the run is accepted: a refused command changes nothing
        set_threads(args.threads, "--threads (0 leaves PyTorch's choice)")

    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(
        {"args": vars(args), "model": config.to_dict(), **hparams}, indent=2, default=str))
    metrics = MetricsLog(out, args, config.to_dict(), resume_step=step if args.resume else None)
    print(f"device {device} | {model.num_parameters():,} parameters | data: {data_name}, "
          f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens")
    print(f"{args.epochs} epoch(s) x {steps_per_epoch} steps = {total_steps} steps of "
          f"{args.batch_size} x {context_length} tokens; warmup {warmup}, peak lr {args.lr}")

    # --8<-- [start:checkpointing]
    def save_checkpoint_now() -> None:
        manager.save(step, {
            "step": step,
            "model": unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "rng": capture_rng_state(),
            "config": config.to_dict(),
            "hparams": hparams,
        })
    # --8<-- [end:checkpointing]

    records: list[dict] = []  # what this call logs; also returned

    def run_eval() -> float:
        val_loss = evaluate(model, val_tokens, args.batch_size, context_length, device,
                            args.eval_batches)
        record = {"kind": "eval", "step": step, "val_loss": val_loss}
        records.append(record)
        metrics.log(record)
        return val_loss

    # The terminal progress bar (not tqdm.auto's notebook widget): with disable=None it turns
    # itself off when the output is not a terminal (a log file, a notebook); the log lines stay.
    from tqdm import tqdm

    stop_at = total_steps if args.max_steps is None else min(args.max_steps, total_steps)
    bar = tqdm(total=total_steps, initial=step, disable=None, unit="step", dynamic_ncols=True)
    start_time = time.perf_counter()
    tokens_per_step = args.batch_size * context_length
    model.train()

    # --8<-- [start:training-loop]
    while step < stop_at:
        t0 = time.perf_counter()
        batch = sampler.next_batch().to(device)   # (batch, context_length + 1)
        inputs, targets = shift_for_next_token(batch)
        _, loss = model(inputs, targets)          # forward + mean cross-entropy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()                           # gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        lr = scheduler.get_last_lr()[0]           # the lr this step uses
        optimizer.step()                          # update weights
        scheduler.step()                          # next step's lr
        step += 1

        loss_value = loss.item()                  # waits for the device to finish
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step}; "
                                     f"try a lower --lr (now {args.lr})")
        seconds = time.perf_counter() - t0
        record = {"kind": "train", "step": step, "epoch": (step - 1) // steps_per_epoch + 1,
                  "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "tokens_per_s": tokens_per_step / seconds}
        records.append(record)
        metrics.log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.1e}")
        if step % args.log_every == 0 or step == 1:
            bar.write(f"step {step:5d} | epoch {record['epoch']} | loss {loss_value:.4f} | "
                      f"lr {lr:.2e} | grad norm {record['grad_norm']:.3f} | "
                      f"{record['tokens_per_s']:,.0f} tokens/s")

        if args.eval_every and step % args.eval_every == 0 and step < total_steps:
            bar.write(f"step {step:5d} | val loss {run_eval():.4f}")
        periodic = args.ckpt_every and step % args.ckpt_every == 0
        if step < total_steps and (periodic or step == stop_at):  # the end saves one below
            save_checkpoint_now()  # at --max-steps too, so that --resume redoes no step
    # --8<-- [end:training-loop]
    bar.close()
    elapsed = time.perf_counter() - start_time

    finished = step >= total_steps
    if finished and records:  # the end of the schedule, reached by this call
        val_loss = run_eval()
        save_checkpoint_now()
        prompt = _prompt_from(val_tokens, min(48, context_length // 2))
        text = sample_text(model, tokenizer, prompt, args.sample_tokens, device)
        print(f"\nval loss at step {step}: {val_loss:.4f}")
        print("greedy sample (prompt from the validation text, model output after »):")
        print(tokenizer.decode(prompt) + "»" + text)
    elif not finished:
        print(f"stopped at step {step} (--max-steps): --resume continues from "
              f"{manager.path_for(step)}")
    metrics.close()
    plot_losses(metrics.path, out / "loss.png", config.vocab_size)

    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    if train_losses:
        n = len(train_losses)
        print(f"\n{n} steps in {elapsed:.1f} s ({n * tokens_per_step / elapsed:,.0f} tokens/s) | "
              f"train loss {train_losses[0]:.4f} -> {train_losses[-1]:.4f} | "
              f"wrote {out / 'metrics.jsonl'}, {out / 'loss.png'}, {manager.directory}/")
    else:
        print(f"nothing to do: the run in {out} already reached step {step}")
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        train(args)
    except (DeviceError, DataError, ConfigError, CheckpointError, MissingPackageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
