"""A byte-level tokenizer: every UTF-8 byte is one token.

Why byte-level for this course:

* No training step. A BPE or WordPiece tokenizer has to be *learned* from a
  corpus (and then shipped with the model); bytes need nothing. The course
  stays runnable offline with no downloads.
* Any text file works. Every string has a UTF-8 encoding, so there are no
  unknown tokens: accents, emoji and code all round-trip.
* The vocabulary fits the tiny model. 256 rows in the embedding table and the
  output layer (tied: one table) is 16,384 parameters at ``hidden_size=64``, against
  ~50k rows (millions of parameters) for GPT-2's BPE vocabulary. Most of a
  tiny model would otherwise be its embedding table.

What a BPE tokenizer would change: a token would cover ~4 characters of
English on average, so a context window of N tokens sees ~4x more text, each
training step processes ~4x more text, and the loss per token is not comparable
with the loss per byte here (compare bits per byte instead). The vocabulary
(and ``vocab_size`` in the model config) grows to tens of thousands, so the
embedding and output matrices dominate small models and the softmax over the
vocabulary becomes one of the larger costs. Nothing else in the training loop
changes: the model still maps token ids to next-token logits.
"""

from __future__ import annotations


# --8<-- [start:byte-tokenizer]
class ByteTokenizer:
    """Text <-> token ids, where the ids are the UTF-8 bytes of the text."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A model can emit a byte sequence that is not valid UTF-8 (half of a
        # multi-byte character); show it as U+FFFD instead of crashing.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
# --8<-- [end:byte-tokenizer]
