"""Load Lab 1's trained checkpoint into models built from other configs.

    python snippets/debugging/checkpoint_mismatch.py [RUN_DIR]     (default: runs/lab1/base)

A checkpoint stores tensors by name and nothing about the code that made them, so
``load_state_dict`` can only compare names and shapes. Three outcomes: a shape mismatch,
missing keys, and a config change that loads without any error at all.
"""

import sys
import textwrap
from pathlib import Path

import torch

from snippets.data.dataset import load_tokens, train_val_split
from snippets.models.gpt import GPT, GPTConfig, get_config
from snippets.training.checkpoint import CheckpointManager
from snippets.labs.lab1_sweep import LAB1_CONFIGS  # snippets/models/lab1/
from snippets.scripts.train_tiny_transformer import evaluate

torch.set_num_threads(1)  # as the trainer does: a tiny model gains nothing from more threads
run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/lab1/base")
ckpt = CheckpointManager(run_dir / "checkpoints").load_latest()
_, val_tokens = train_val_split(load_tokens(None), 0.1)  # the trainer's held-out text


def val_loss(model):  # the trainer's own evaluation: 20 batches of 16 x 64 held-out bytes
    return evaluate(model, val_tokens, 16, 64, "cpu", max_batches=20)


model = GPT(GPTConfig(**ckpt.state["config"]))  # the config it was trained with
model.load_state_dict(ckpt.state["model"])
print(f"{ckpt.path.name} into its own config: validation loss {val_loss(model):.2f}")

for variant in ["ffn-344", "layers-4", "heads-8"]:
    model = GPT(get_config(LAB1_CONFIGS / f"{variant}.json"))
    try:
        model.load_state_dict(ckpt.state["model"])
    except RuntimeError as err:
        print(f"\n{variant}.json: RuntimeError:")
        for line in str(err).splitlines():  # PyTorch's lines are long: wrapped at 100 here
            print(textwrap.fill(line.strip(), 100, initial_indent="  ",
                                subsequent_indent="      ", break_on_hyphens=False))
    else:
        print(f"\n{variant}.json: loaded without an error; validation loss {val_loss(model):.2f}")
