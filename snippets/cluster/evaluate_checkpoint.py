"""Evaluate a checkpoint of the tiny GPT on the held-out split, on one process.

    python -m snippets.cluster.evaluate_checkpoint runs/session-c/ckpt.pt
    python -m snippets.cluster.evaluate_checkpoint runs/session-c/ranked   # one file per rank
    python -m snippets.cluster.evaluate_checkpoint A B ...                 # several, one process

Training needs every node; evaluating a checkpoint needs none of them: the file holds the
config and the weights, and the held-out text is the tail of the built-in corpus that
multi_node_train.py never trains on (the same train_val_split). The loss is compared with two
references: an untrained model, and guessing uniformly among 256 byte values, ln 256 = 5.545.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from pathlib import Path

from snippets.cluster.multi_node_train import VAL_FRACTION
from snippets.cluster.ranked_checkpoint import consolidate
from snippets.data.dataset import load_tokens, train_val_split
from snippets.models.gpt import GPT, GPTConfig, get_config
from snippets.training.checkpoint import CheckpointError, load_checkpoint
from snippets.scripts.train_tiny_transformer import evaluate
from snippets.flags import Parser
from snippets.machine import set_threads


# --8<-- [start:load]
def load_model(path: str, config_name: str = "tiny") -> tuple[GPT, dict]:
    """The model saved at `path`: one checkpoint file, or a directory of ranked shards."""
    if Path(path).is_dir():  # one file per rank: join the slices (their layout is in the files)
        meta, groups = consolidate(path)
        model = GPT(get_config(config_name))  # ranked files hold tensors, not the config
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(groups["model"][name])
        return model, {"step": meta["step"], "world_size": meta["saved_world_size"]}
    state = load_checkpoint(path)  # checks the checksum, loads with weights_only=True
    model = GPT(GPTConfig(**state["config"]))
    model.load_state_dict(state["model"])
    return model, {"step": state["step"], "world_size": state.get("world_size")}
# --8<-- [end:load]


# --8<-- [start:evaluate]
def evaluate_checkpoint(path: str, config_name: str = "tiny", batch_size: int = 32) -> dict:
    """Validation loss and perplexity of the checkpoint at `path`, and of an untrained model."""
    model, saved = load_model(path, config_name)
    config = model.config
    context = config.max_position_embeddings
    _, val = train_val_split(load_tokens(None, context_length=context), VAL_FRACTION, context)
    trained = evaluate(model, val, batch_size, context, torch.device("cpu"))
    torch.manual_seed(0)
    untrained = evaluate(GPT(config), val, batch_size, context, torch.device("cpu"))
    return {**saved, "val_tokens": len(val),
            "val_loss": trained, "perplexity": math.exp(trained), "untrained_loss": untrained}
# --8<-- [end:evaluate]


def main(argv=None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoints", nargs="*", default=["runs/session-c/ckpt.pt"],
                   help="checkpoint files, or directories of ranked checkpoint files")
    p.add_argument("--config", default="tiny", help="model config of a ranked checkpoint")
    args = p.parse_args(argv)
    set_threads(1, "a tiny model gains nothing from more")
    for path in args.checkpoints:
        try:
            r = evaluate_checkpoint(path, args.config)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except KeyError as err:  # a file of another script: no model config, no step
            print(f"error: {path} has no {err} entry: evaluate a checkpoint of "
                  "multi_node_train.py or train_tiny_transformer.py", file=sys.stderr)
            return 1
        processes = (f"trained by {r['world_size']} processes" if r["world_size"]
                     else "world size not recorded")
        print(f"{path}: step {r['step']}, {processes}")
        print(f"validation: {r['val_tokens']:,} held-out tokens")
        print(f"  loss {r['val_loss']:.4f} (perplexity {r['perplexity']:.1f})")
        print(f"  untrained model {r['untrained_loss']:.4f}, "
              f"uniform guess ln 256 = {math.log(256):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
