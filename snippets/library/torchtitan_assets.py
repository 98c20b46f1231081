"""The tokenizer and dataset TorchTitan's Llama 3 debug config reads, made offline by the course's
own code (TorchTitan 0.3.0's wheel ships neither; its repository's tests/assets/ is not installed).

    python -m snippets.library.torchtitan_assets --out runs/torchtitan/assets

writes, from the built-in generated corpus (snippets/data/corpus.py) and the course's BPE trainer
(snippets/data/bpe.py):

    OUT/tokenizer/tokenizer.json         a 2,048-token byte-level BPE: the debug model's vocab_size
    OUT/tokenizer/tokenizer_config.json  bos_token and eos_token, both <|endoftext|>, as
                                         HuggingFaceTokenizer reads them
                                         (torchtitan/components/tokenizer.py)
    OUT/c4_test/train.jsonl              {"text": ...} documents, as the "c4_test" dataset's
                                         `load_dataset(path, split="train")` reads a folder

The files are the same bytes on every run: one already there with those bytes is kept; one with
other bytes was not written by this script, and the script refuses to touch it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from snippets.data.bpe import BPETokenizer, write_atomically
from snippets.data.corpus import END_OF_TEXT, generate_corpus
from snippets.flags import Parser

VOCAB_SIZE = 2048          # torchtitan/models/llama3/__init__.py, _debugmodel: vocab_size=2048
CORPUS_BYTES = 120_000     # about 40k tokens: 5 steps of 2 ranks x 4 sequences x 256 need 10k
LINES_PER_DOCUMENT = 8


def assets() -> dict[str, bytes]:
    """Relative path -> contents, deterministic (the corpus has a fixed seed)."""
    lines = generate_corpus(target_bytes=CORPUS_BYTES).splitlines()
    documents = ["\n".join(lines[i:i + LINES_PER_DOCUMENT])
                 for i in range(0, len(lines), LINES_PER_DOCUMENT)]
    bpe = BPETokenizer.train(documents, VOCAB_SIZE)
    config = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {
        "tokenizer/tokenizer.json": bpe.tokenizer.to_str(pretty=True).encode(),
        "tokenizer/tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
        "c4_test/train.jsonl": "".join(json.dumps({"text": d}) + "\n" for d in documents).encode(),
    }


def write(out: Path) -> list[str]:
    """Write the assets under ``out``; refuse before writing anything if a file there differs."""
    files = assets()
    foreign = [name for name, data in files.items()
               if (out / name).exists() and (out / name).read_bytes() != data]
    if foreign:
        raise FileExistsError(f"{out / foreign[0]} exists and was not written by this script "
                              "(other contents): choose another --out")
    report = []
    for name, data in files.items():
        path = out / name
        if path.exists():
            report.append(f"kept  {path} (same bytes)")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
        report.append(f"wrote {path} ({len(data):,} bytes)")
    return report


def main(argv: list[str] | None = None) -> int:
    p = Parser(description="Write TorchTitan's debug-model tokenizer and dataset, offline.")
    p.add_argument("--out", default="runs/torchtitan/assets",
                   help="folder for tokenizer/ and c4_test/ (default: runs/torchtitan/assets)")
    args = p.parse_args(argv)
    try:
        print("\n".join(write(Path(args.out))))
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
