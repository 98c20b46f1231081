"""Lab 1: train several model configs for the same number of steps and compare them.

    python snippets/labs/lab1_sweep.py              # config.json and 4 variants in lab1/
    python snippets/labs/lab1_sweep.py snippets/models/config.json my-config.json

Each config is trained by the ordinary trainer (``train_tiny_transformer.train``) with the
same seed, data, batch and learning-rate schedule, so the model config is the only thing
that differs between runs. The first config is the baseline: the table names the fields in
which every other config differs from it. Each run's log goes to ``OUT/<name>/train.log``;
the table goes to the terminal and the loss curves to ``OUT/loss_curves.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from snippets.models.gpt import GPT, ConfigError, get_config
from snippets.training.checkpoint import CheckpointError, refuse_earlier_run
from snippets.flags import Parser, int_at_least
from snippets.scripts.train_tiny_transformer import DEFAULT_CONFIG, parse_args, train

LAB1_CONFIGS = DEFAULT_CONFIG.parent / "lab1"
DEFAULT_VARIANTS = [DEFAULT_CONFIG] + [LAB1_CONFIGS / f"{name}.json" for name in
                                       ("hidden-128", "ffn-344", "heads-8", "layers-4")]


def variant_name(path: Path) -> str:
    return "base" if Path(path).resolve() == DEFAULT_CONFIG.resolve() else Path(path).stem


def config_changes(baseline: dict, config: dict) -> str:
    """'num_hidden_layers 2->4': the fields in which ``config`` differs from ``baseline``."""
    changed = [f"{key} {baseline[key]}->{value}" for key, value in config.items()
               if baseline.get(key) != value]
    return ", ".join(changed) or "(baseline)"


# --8<-- [start:run-variant]
def run_variant(config_path: Path, out: Path, steps: int, batch_size: int,
                context_length: int, seed: int, device: str = "cpu",
                overwrite: bool = False) -> dict:
    """Train one config with the shared settings; summarise the run as one table row."""
    argv = ["--config", str(config_path), "--out", str(out), "--epochs", "1",
            "--steps-per-epoch", str(steps), "--batch-size", str(batch_size),
            "--seq-len", str(context_length), "--seed", str(seed),
            "--eval-every", str(max(1, steps // 4)), "--eval-batches", "10",
            "--ckpt-every", "0", "--keep-last", "1",
            "--device", device, "--threads", "1", "--sample-tokens", "60"]
    if overwrite:  # the learner asked for it; the trainer still deletes only its own kinds of file
        argv.append("--overwrite")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        records = train(parse_args(argv))
    steps_done = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    tokens_per_step = batch_size * context_length
    # Time spent in training steps only (evaluation excluded): tokens_per_s was measured per step.
    step_seconds = [tokens_per_step / r["tokens_per_s"] for r in steps_done]
    # The median step: a step that waited for another program on a shared CPU does not move it.
    typical_step = statistics.median(step_seconds)
    last = steps_done[-10:]  # one step's loss is noisy; average the last ten
    return {
        "name": variant_name(config_path),
        "config": get_config(config_path).to_dict(),
        "params": GPT(get_config(config_path)).num_parameters(),
        "train_loss": sum(r["loss"] for r in last) / len(last),
        "val_loss": evals[-1]["val_loss"],
        "tokens_per_s": tokens_per_step / typical_step,
        "seconds": sum(step_seconds),
        "curve": [(r["step"], r["loss"], s) for r, s in zip(steps_done, step_seconds)],
        "val_curve": [(r["step"], r["val_loss"]) for r in evals],
    }
# --8<-- [end:run-variant]


def format_table(rows: list[dict]) -> str:
    baseline = rows[0]["config"]
    lines = [f"{'variant':<11} {'change':<26} {'params':>8} {'train loss':>10} "
             f"{'val loss':>8} {'tokens/s':>8} {'seconds':>7}"]
    for r in rows:
        lines.append(f"{r['name']:<11} {config_changes(baseline, r['config']):<26} "
                     f"{r['params']:>8,} {r['train_loss']:>10.3f} {r['val_loss']:>8.3f} "
                     f"{r['tokens_per_s']:>8,.0f} {r['seconds']:>7.1f}")
    return "\n".join(lines)


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(rows: list[dict], png_path: Path, vocab_size: int = 256) -> None:
    """Train loss (smoothed) and validation loss per variant, against steps and against seconds:
    a config can win per step and lose per second."""
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone

    fig = Figure(figsize=(11, 4))
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    for i, r in enumerate(rows):
        color = f"C{i}"
        steps = [s for s, _, _ in r["curve"]]
        smooth = moving_average([loss for _, loss, _ in r["curve"]], 10)
        elapsed, clock = [], 0.0
        for _, _, seconds in r["curve"]:
            clock += seconds
            elapsed.append(clock)
        at_step = dict(zip(steps, elapsed))
        by_step.plot(steps, smooth, color=color, lw=1.2, label=r["name"])
        by_time.plot(elapsed, smooth, color=color, lw=1.2, label=r["name"])
        val_steps = [s for s, _ in r["val_curve"]]
        val = [v for _, v in r["val_curve"]]
        by_step.plot(val_steps, val, "o", color=color, ms=4)
        by_time.plot([at_step[s] for s in val_steps], val, "o", color=color, ms=4)
    for ax in (by_step, by_time):
        ax.axhline(math.log(vocab_size), ls="--", c="gray", lw=1)
        ax.grid(alpha=0.3)
    by_step.set(xlabel="step", ylabel="cross-entropy (nats per byte)",
                title="per step (line: train, trailing 10-step mean; dots: validation)")
    by_time.set(xlabel="training time (s, this machine)", title="per second of training")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


def sweep(configs: list[Path], out: Path, steps: int, batch_size: int, context_length: int,
          seed: int = 1337, device: str = "cpu", progress=print,
          overwrite: bool = False) -> list[dict]:
    for path in configs:  # every config is checked before any training starts
        get_config(path)
    # ... and the folder: an earlier sweep (or anything else) in it stays unless asked.
    refuse_earlier_run(sorted(p.name for p in out.iterdir()) if out.is_dir() else [], out,
                       overwrite=overwrite)
    rows = []
    for path in configs:
        name = variant_name(path)
        progress(f"training {name} ({os.path.relpath(path)}) ...")
        rows.append(run_variant(Path(path), out / name, steps, batch_size, context_length, seed,
                                device, overwrite))
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(rows, out / "loss_curves.png")
    (out / "summary.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k not in ("curve", "val_curve")} for r in rows],
        indent=2))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("configs", nargs="*", type=Path,
                   help="config JSON files; the first is the baseline "
                        "(default: snippets/models/config.json and four variants in "
                        "snippets/models/lab1/)")
    p.add_flag("max-steps", "--steps", dest="steps", type=int_at_least(1), default=120,
               help="optimizer steps per config")
    p.add_flag("batch-size", type=int_at_least(1), default=8)
    p.add_flag("seq-len", "--context-length", dest="context_length", type=int_at_least(1),
               default=64)
    p.add_argument("--seed", type=int_at_least(0), default=1337)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"],
                   help="the same device for every config, so tokens/s compare")
    p.add_argument("--out", type=Path, default=Path("runs/lab1/sweep"))
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier sweep in --out (each run's own files only)")
    args = p.parse_args(argv)
    configs = args.configs or DEFAULT_VARIANTS
    started = time.perf_counter()
    try:
        rows = sweep(configs, args.out, args.steps, args.batch_size, args.context_length,
                     args.seed, args.device, overwrite=args.overwrite)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\n{args.steps} steps of {args.batch_size} x {args.context_length} tokens per "
          f"config, seed {args.seed}, {args.device}, 1 thread:\n")
    print(format_table(rows))
    print(f"\nwrote {args.out / 'loss_curves.png'}, {args.out / 'summary.json'} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
