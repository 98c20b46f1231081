"""A byte-level BPE tokenizer, trained with Hugging Face ``tokenizers`` on the course's text.

    python snippets/data/bpe.py --vocab-size 1024 --out runs/local/bpe-1024

Byte-pair encoding starts from the 256 byte values (so, like the byte tokenizer, it has no
unknown tokens) and repeatedly merges the most frequent adjacent pair into a new token until the
vocabulary is full. It is GPT-2's scheme: the same pre-tokenizer (words, numbers and
punctuation runs, each keeping the space before it), the same byte alphabet, one special token,
``<|endoftext|>``, that separates documents. The trained tokenizer is one JSON file: the data
folder keeps it beside the token shards it produced, because token ids mean nothing without it.

The command trains one and compares it with bytes on the same text: tokens per character, the
vocabulary, and the share of the tiny model's parameters that the embedding table takes.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from snippets.data.corpus import END_OF_TEXT, DataError


# --8<-- [start:bpe-tokenizer]
class BPETokenizer:
    """Text <-> token ids with a trained byte-level BPE; the same interface as ByteTokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.end_of_text_id = tokenizer.token_to_id(END_OF_TEXT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BPETokenizer":
        tokenizer = Tokenizer(models.BPE())
        # GPT-2's choices: map every byte to a visible character, split the text into words,
        # numbers and punctuation runs, each with its leading space (no merge crosses a word
        # boundary), and undo the byte mapping when decoding.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=False)
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
# --8<-- [end:bpe-tokenizer]

    # --8<-- [start:save-load]
    def save(self, path: str | Path, overwrite: bool = False) -> None:
        """Write the tokenizer's JSON atomically: a reader sees the old file or the new one."""
        path = Path(path)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} already exists: pass --overwrite to replace it, "
                                  "or choose another --out")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, self.tokenizer.to_str(pretty=True).encode("utf-8"))

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as err:  # tokenizers raises a bare Exception for a missing/bad file
            raise DataError(f"cannot load the tokenizer {path}: {err}") from None
    # --8<-- [end:save-load]


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename it over
    ``path``: a crash leaves the old file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private (0600); use the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


# --8<-- [start:compare]
def compare(text: str, tokenizers: dict, config="tiny") -> list[dict]:
    """Per tokenizer: vocabulary, tokens for ``text``, and what the vocabulary costs the model."""
    from snippets.models.gpt import GPT, get_config

    rows = []
    for name, tok in tokenizers.items():
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # both are lossless: every byte sequence round-trips
        model_config = get_config(config, vocab_size=tok.vocab_size)
        embedding = tok.vocab_size * model_config.hidden_size  # tied: also the output layer
        total = GPT(model_config).num_parameters()
        rows.append({"tokenizer": name, "vocab": tok.vocab_size, "tokens": len(ids),
                     "tokens_per_char": len(ids) / len(text), "parameters": total,
                     "embedding_share": embedding / total})
    return rows
# --8<-- [end:compare]


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'tokenizer':10} {'vocab':>6} {'tokens':>8} {'tokens/char':>11} "
             f"{'parameters':>10} {'embedding':>9}"]
    for r in rows:
        lines.append(f"{r['tokenizer']:10} {r['vocab']:>6,} {r['tokens']:>8,} "
                     f"{r['tokens_per_char']:>11.3f} {r['parameters']:>10,} "
                     f"{r['embedding_share']:>9.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from snippets.data.corpus import load_text
    from snippets.data.real_text import join_documents, prepare_documents, read_documents
    from snippets.data.tokenizer import ByteTokenizer
    from snippets.flags import Parser, checked

    p = Parser(description="Train a byte-level BPE tokenizer and compare it with bytes.")
    p.add_argument("--vocab-size", type=checked(int, lambda v: 257 <= v <= 65_536,
                                                "a whole number from 257 to 65536"),
                   default=1024, help="256 bytes + 1 special token + merges (default: 1024)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", default=None,
                        help="UTF-8 text file to train on (default: the built-in generated corpus)")
    source.add_argument("--documents", default=None,
                        help="an OpenWebText-style corpus instead: 'pydoc', a folder of .txt "
                             "files or a .jsonl(.gz) file (see snippets/data/real_text.py)")
    p.add_argument("--out", default="runs/local/bpe-1024",
                   help="folder for tokenizer.json (default: runs/local/bpe-1024)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT/tokenizer.json")
    args = p.parse_args(argv)
    try:
        if args.documents:
            documents, _ = prepare_documents(read_documents(args.documents))
            text, name = join_documents(documents), args.documents
        else:
            text, name = load_text(args.data), args.data or "the built-in generated corpus"
        bpe = BPETokenizer.train([text], args.vocab_size)
        path = Path(args.out) / "tokenizer.json"
        bpe.save(path, overwrite=args.overwrite)
    except (DataError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"trained a {bpe.vocab_size:,}-token BPE on {len(text):,} characters of {name}; "
          f"wrote {path}")
    print(format_rows(compare(text, {"bytes": ByteTokenizer(), "bpe": bpe})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
