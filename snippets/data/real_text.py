"""Real text for the data pipeline: an OpenWebText-style loader, run here on Python's own docs.

    python snippets/data/real_text.py                  # the text that ships with Python
    python snippets/data/real_text.py path/to/corpus   # a folder of .txt files, or a .jsonl(.gz)

OpenWebText, the open re-creation of GPT-2's training set, is a few million web documents, each
one plain text; Hugging Face's copy is rows of ``{"text": ...}``. Preparing any corpus like it
takes the same steps, done once, before training:

1. read the documents one at a time (a folder of ``.txt`` files, one per document, or JSON lines
   with a ``text`` field, optionally gzipped), in a fixed order;
2. clean each one: Unicode NFC, Unix newlines, no control characters, no trailing spaces, at
   most one blank line in a row, and no literal ``<|endoftext|>`` (it would be read as the
   separator);
3. drop the ones that are too short to teach anything, and exact duplicates (the web repeats
   itself: boilerplate pages, mirrors);
4. join them with ``<|endoftext|>`` after each document, the separator GPT-2 uses, so the model
   learns where one document ends and an unrelated one begins.

Nothing here downloads. The course runs it on ``pydoc_data.topics``, which every CPython ships:
the text of the Python Language Reference that ``help("assert")`` shows, 79 documents and about
460,000 characters of English technical prose. It is part of the Python documentation, licensed
under the PSF License Agreement (the ``LICENSE.txt`` of your Python, and
https://docs.python.org/3/license.html). Its text changes between Python releases, so its
token counts are those of your Python version.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator

from snippets.data.corpus import END_OF_TEXT, DataError

MIN_CHARACTERS = 200  # shorter documents are navigation stubs and error pages on the web


# --8<-- [start:read-documents]
def read_documents(source: str | Path) -> Iterator[str]:
    """Documents, one string each, from "pydoc", a folder of .txt files or a .jsonl(.gz) file."""
    if str(source) == "pydoc":
        from pydoc_data.topics import topics  # {"assert": "The \"assert\" statement...", ...}
        for name in sorted(topics):
            yield topics[name]
        return
    path = Path(source)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))  # sorted: the same order, so the same shards
        if not files:
            raise DataError(f"{path} holds no .txt files (one document per file)")
        for file in files:
            yield file.read_text(encoding="utf-8", errors="replace")
    elif path.name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise DataError(f"{path}:{number}: not a JSON object with a "
                                        "\"text\" field") from None
    else:
        raise DataError(f"{source}: not 'pydoc', a folder of .txt files or a .jsonl(.gz) file")
# --8<-- [end:read-documents]


# --8<-- [start:clean]
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # all but tab and newline
_BLANK_LINES = re.compile(r"\n{3,}")


def clean(document: str) -> str:
    text = unicodedata.normalize("NFC", document)  # one encoding of "é", not two
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text.replace(END_OF_TEXT, ""))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", text).strip()


def prepare_documents(documents: Iterable[str], min_characters: int = MIN_CHARACTERS
                      ) -> tuple[list[str], dict]:
    """Cleaned documents, without short ones and exact duplicates, and what was dropped."""
    kept, seen, stats = [], set(), {"read": 0, "too_short": 0, "duplicates": 0}
    for document in documents:
        stats["read"] += 1
        text = clean(document)
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if len(text) < min_characters:
            stats["too_short"] += 1
        elif digest in seen:
            stats["duplicates"] += 1
        else:
            seen.add(digest)
            kept.append(text)
    return kept, stats


def join_documents(documents: list[str]) -> str:
    """One training text: every document followed by the end-of-text separator."""
    return "".join(document + END_OF_TEXT for document in documents)
# --8<-- [end:clean]


def main(argv: list[str] | None = None) -> int:
    from snippets.flags import Parser, int_at_least

    p = Parser(description="Read, clean and de-duplicate an OpenWebText-style corpus.")
    p.add_argument("source", nargs="?", default="pydoc",
                   help="'pydoc' (Python's own documentation; the default), a folder of .txt "
                        "files, or a .jsonl / .jsonl.gz file with a \"text\" field per line")
    p.add_argument("--min-characters", type=int_at_least(0), default=MIN_CHARACTERS,
                   help="drop shorter documents after cleaning")
    args = p.parse_args(argv)
    try:
        documents, stats = prepare_documents(read_documents(args.source), args.min_characters)
    except (DataError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = join_documents(documents)
    origin = (f"pydoc_data.topics of Python {sys.version.split()[0]}" if args.source == "pydoc"
              else args.source)
    print(f"{origin}: read {stats['read']} documents, dropped {stats['too_short']} shorter than "
          f"{args.min_characters} characters and {stats['duplicates']} duplicates")
    print(f"kept {len(documents)} documents, {len(text):,} characters with the separators")
    print(f"first document begins: {documents[0][:60]!r}" if documents else "nothing kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
