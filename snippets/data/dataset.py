"""Token tensors, the train/validation split, and batch samplers.

Training draws random windows from a ``torch.Generator`` owned by the sampler,
so "where we are in the data" is one small tensor (the generator state) that a
checkpoint can save; restoring it replays exactly the same batches.
Evaluation walks the held-out tokens in order, with no randomness at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from snippets.data.corpus import DataError, load_text
from snippets.data.tokenizer import ByteTokenizer


# --8<-- [start:load-tokens]
def load_tokens(path: str | Path | None, tokenizer=None, context_length: int = 1) -> torch.Tensor:
    """Encode a text file (or the built-in corpus when ``path`` is None) as one 1-D tensor."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode(load_text(path))
    need = context_length + 1  # one window = context_length inputs + 1 shifted target
    if len(ids) < need:
        name = path if path is not None else "the built-in corpus"
        raise DataError(f"{name} is too short: {len(ids)} tokens, but one training window "
                        f"needs context_length + 1 = {need} tokens (use a longer file "
                        "or a smaller --seq-len)")
    # Byte ids fit in uint8: 1 byte per token instead of 8 keeps big files small in memory.
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    return torch.tensor(ids, dtype=dtype)
# --8<-- [end:load-tokens]


# --8<-- [start:split]
def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1, context_length: int = 1,
                    source: str = "the text") -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - val_fraction) of the tokens for training, the rest for validation.

    The split is contiguous, not a random choice of windows: neighbouring windows
    overlap and share most of their text, so a random split would put nearly
    every validation sentence in the training set too, and validation loss would
    measure memorisation. A held-out *tail* is text the model has never seen.
    """
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    need = context_length + 1
    if len(train) < need or len(val) < need:
        raise DataError(f"{source} has {len(tokens)} tokens; split {len(train)}/{len(val)} "
                        f"(train/val) leaves a part shorter than one window of {need} tokens: "
                        "use a longer file, a smaller --seq-len or another --val-fraction")
    return train, val
# --8<-- [end:split]


# --8<-- [start:random-sampler]
class RandomWindowSampler:
    """Batches of random windows of ``context_length + 1`` tokens.

    All randomness comes from ``self.generator``; ``state_dict()`` captures it
    (plus a counter), and ``load_state_dict()`` puts it back, so a resumed run
    sees exactly the batches an unbroken run would have seen.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, context_length: int, seed: int):
        if len(tokens) < context_length + 1:
            raise DataError(f"{len(tokens)} tokens is shorter than one window of "
                            f"{context_length + 1}")
        self.tokens, self.batch_size, self.context_length = tokens, batch_size, context_length
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0
        self._offsets = torch.arange(context_length + 1)

    def next_batch(self) -> torch.Tensor:
        """A (batch_size, context_length + 1) int64 tensor of token ids."""
        high = len(self.tokens) - self.context_length  # last valid start + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        self.batches_drawn += 1
        return self.tokens[starts[:, None] + self._offsets].long()

    def state_dict(self) -> dict:
        # A uint8 tensor and an int: loadable with torch.load(weights_only=True).
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])
# --8<-- [end:random-sampler]


def random_token_batches(steps: int, batch_size: int, seq_len: int, vocab_size: int = 256,
                         seed: int = 1) -> list[torch.Tensor]:
    """`steps` batches of random tokens, (batch_size, seq_len + 1) each, the same on every rank
    and in one process: the data of the course's equivalence checks (a parallel run against
    one process), where what is learned does not matter, only that both see the same tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
            for _ in range(steps)]


# --8<-- [start:sequential-batches]
def sequential_batches(tokens: torch.Tensor, batch_size: int, context_length: int,
                       max_batches: int | None = None) -> Iterator[torch.Tensor]:
    """Non-overlapping windows of ``context_length + 1`` tokens, in order, for evaluation.

    Consecutive windows share one token (the last target of one window is the
    first input of the next), so every token is predicted exactly once.
    """
    starts = list(range(0, len(tokens) - context_length, context_length))
    offsets = torch.arange(context_length + 1)
    for i, b in enumerate(range(0, len(starts), batch_size)):
        if max_batches is not None and i >= max_batches:
            return
        idx = torch.tensor(starts[b : b + batch_size])
        yield tokens[idx[:, None] + offsets].long()
# --8<-- [end:sequential-batches]
