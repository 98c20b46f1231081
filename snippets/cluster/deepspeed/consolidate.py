"""From a ZeRO checkpoint (one shard file per rank) to a plain GPT, with no DeepSpeed at run time.

    python -m snippets.cluster.deepspeed.consolidate runs/deepspeed/zero3_offload

DeepSpeed's `engine.save_checkpoint(dir, tag)` writes dir/tag/ with each rank's partition of the
fp32 weights and optimizer states, and copies the script zero_to_fp32.py into dir. Its function
`get_fp32_state_dict_from_zero_checkpoint` reads every rank's partition and joins them into one
ordinary state dict, on one process, no process group needed. This module does that, loads the
result into a plain GPT, and saves it as an ordinary checkpoint (atomically, weights only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import save_checkpoint
from snippets.flags import Parser, int_at_least


# --8<-- [start:consolidate]
def consolidate_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                context: int = 32) -> GPT:
    """The plain GPT held, in shards, by a DeepSpeed ZeRO checkpoint (any stage)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    model = GPT(get_config("tiny", max_position_embeddings=context))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # DeepSpeed stores a tied weight once, under its first name; anything else missing is an error.
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{checkpoint_dir}: the checkpoint does not fit GPT('tiny'): missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return model
# --8<-- [end:consolidate]


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint_dir", help="the --save-dir of train_deepspeed.py")
    p.add_argument("--tag", default=None, help="default: the one in CHECKPOINT_DIR/latest")
    p.add_argument("--context", type=int_at_least(1), default=32)
    p.add_argument("--overwrite", action="store_true", help="replace CHECKPOINT_DIR/model.pt")
    args = p.parse_args(argv)
    out = Path(args.checkpoint_dir) / "model.pt"
    if out.exists() and not args.overwrite:
        p.exit(1, f"error: {out} exists: pass --overwrite to replace it\n")
    try:
        model = consolidate_zero_checkpoint(args.checkpoint_dir, args.tag, args.context)
    except (FileNotFoundError, ValueError) as err:  # no checkpoint there, or not the tiny GPT
        p.exit(1, f"error: {err}\n")
    save_checkpoint(out, {"model": model.state_dict()})
    from snippets.cluster.deepspeed.train_deepspeed import global_batches

    with torch.no_grad():
        _, loss = model(*shift_for_next_token(global_batches(1, 8, args.context)[0]))
    print(f"{out}: plain GPT, {model.num_parameters():,} parameters, "
          f"loss on the first training batch {loss.item():.4f}")


if __name__ == "__main__":
    main()
