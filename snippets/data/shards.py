"""Tokenize a corpus once into shard files with a manifest; each rank reads and verifies its own.

    python snippets/data/shards.py prepare --tokenizer runs/local/bpe-1024/tokenizer.json \\
        --num-shards 4 --out runs/local/bpe-1024
    RANK=1 WORLD_SIZE=2 python snippets/data/shards.py read runs/local/bpe-1024/manifest.json

Tokenizing is slow next to training on the tokens, and every run (and every rank) would repeat
it, so it is done once. The token ids go into flat binary files, as nanoGPT stores OpenWebText:
no header, just the ids as little-endian unsigned integers, the narrowest type the vocabulary
fits (uint8 for bytes, uint16 up to 65,536 tokens), so ``np.memmap`` maps a file without reading
it. ``manifest.json`` beside them says what they hold: the tokenizer (a copy of its file sits in
the same folder), the dtype, and per shard its file name, token count and SHA-256.

The manifest is written last, and atomically: a folder without one is an unfinished preparation,
and a reader refuses it. A reader checks each shard it opens against the manifest (size, then
checksum), so a truncated copy or a flipped bit stops the run with the file's name instead of
training on garbage. Rank ``r`` of ``W`` reads shards ``r, r + W, r + 2W, ...``: the ranks read
disjoint files, and together all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from snippets.data.bpe import BPETokenizer, write_atomically
from snippets.data.corpus import DataError, load_text
from snippets.data.tokenizer import ByteTokenizer

FORMAT = "course-token-shards/1"
MANIFEST = "manifest.json"


class ShardError(DataError):
    """A shard does not match its manifest (missing, truncated, changed)."""


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id; fixed little-endian, as on disk."""
    for dtype in ("<u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in 32 bits")


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --8<-- [start:prepare]
def prepare(text: str, tokenizer, tokenizer_file: Path | None, num_shards: int, out: Path,
            source: str, overwrite: bool = False) -> dict:
    """Tokenize ``text`` once, write ``num_shards`` shard files and the manifest to ``out``."""
    ids = np.asarray(tokenizer.encode(text), dtype=token_dtype(tokenizer.vocab_size))
    if len(ids) < num_shards:
        raise DataError(f"{source} has {len(ids)} tokens: too few for {num_shards} shards")
    out.mkdir(parents=True, exist_ok=True)
    content = None if tokenizer_file is None else Path(tokenizer_file).read_bytes()
    remove_previous(out, num_shards, overwrite, content)
    tokenizer_entry = {"kind": "bytes", "vocab_size": tokenizer.vocab_size}
    if content is not None:  # a copy beside the shards: the ids mean nothing without it
        copy = out / "tokenizer.json"
        write_atomically(copy, content)
        tokenizer_entry = {"kind": "bpe", "vocab_size": tokenizer.vocab_size,
                           "file": copy.name, "sha256": sha256_of(copy)}
    shards = []
    for index, part in enumerate(np.array_split(ids, num_shards)):  # sizes differ by <= 1
        path = out / shard_name(index, num_shards)
        write_atomically(path, part.tobytes())
        shards.append({"file": path.name, "tokens": len(part), "sha256": sha256_of(path)})
    manifest = {"format": FORMAT, "source": source, "characters": len(text),
                "tokenizer": tokenizer_entry, "dtype": ids.dtype.str,
                "total_tokens": len(ids), "shards": shards}
    write_atomically(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest
# --8<-- [end:prepare]


def remove_previous(out: Path, num_shards: int, overwrite: bool, tokenizer: bytes | None
                    ) -> None:
    """Make room for a new preparation. Check everything first, then delete only the files an
    earlier preparation's manifest lists, so a refusal leaves the folder as it was."""
    manifest_path, ours = out / MANIFEST, set()
    if manifest_path.exists():
        if not overwrite:
            raise FileExistsError(f"{out} already holds prepared shards ({MANIFEST}): pass "
                                  "--overwrite to replace them, or choose another --out")
        old = json.loads(manifest_path.read_text())
        ours = {shard["file"] for shard in old["shards"]}
    strangers = [name for name in (shard_name(i, num_shards) for i in range(num_shards))
                 if (out / name).exists() and name not in ours]
    if strangers:  # shard files no manifest of ours lists: not ours to replace
        raise FileExistsError(f"{out / strangers[0]} exists but no {MANIFEST} lists it: "
                              "move it away, or choose another --out")
    copy = out / "tokenizer.json"
    if tokenizer is not None and copy.exists() and copy.read_bytes() != tokenizer and not (
            manifest_path.exists() and old["tokenizer"].get("file") == copy.name):
        raise FileExistsError(f"{copy} is another tokenizer, not listed in a {MANIFEST}: "
                              "choose another --out")
    if manifest_path.exists():
        manifest_path.unlink()  # first: a crash from here on leaves no manifest, not a stale one
        for name in ours:
            (out / name).unlink(missing_ok=True)


def load_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no manifest at {path}: run `python snippets/data/shards.py prepare` "
                        "first (an interrupted preparation leaves none)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a {FORMAT} manifest (written by "
                        "`python snippets/data/shards.py prepare`)")
    return manifest


def load_tokenizer(manifest_path: str | Path):
    """The tokenizer the shards were written with, checked against the manifest."""
    manifest_path = Path(manifest_path)
    entry = load_manifest(manifest_path)["tokenizer"]
    if entry["kind"] == "bytes":
        return ByteTokenizer()
    path = manifest_path.parent / entry["file"]
    if not path.is_file() or sha256_of(path) != entry["sha256"]:
        raise ShardError(f"{path}: missing, or not the tokenizer the shards were written with "
                         f"(sha256 in {manifest_path.name}: {entry['sha256'][:12]}...)")
    return BPETokenizer.load(path)


# --8<-- [start:read]
def shards_for_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """Rank r of W reads shards r, r + W, r + 2W, ...: disjoint, and all of them together."""
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside a world of {world_size} processes")
    if world_size > num_shards:
        raise DataError(f"{world_size} ranks but only {num_shards} shards: rank "
                        f"{num_shards} would read nothing; prepare at least {world_size}")
    return list(range(rank, num_shards, world_size))


def read_shard(manifest_path: str | Path, index: int) -> np.ndarray:
    """One shard's tokens, memory-mapped, after checking its size and SHA-256."""
    manifest_path = Path(manifest_path)
    manifest = load_manifest(manifest_path)
    entry, dtype = manifest["shards"][index], np.dtype(manifest["dtype"])
    path = manifest_path.parent / entry["file"]
    expected = entry["tokens"] * dtype.itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        raise ShardError(f"{path}: {'missing' if size is None else f'{size:,} bytes'}, but "
                         f"{manifest_path.name} lists {expected:,}; prepare the shards again")
    if (actual := sha256_of(path)) != entry["sha256"]:
        raise ShardError(f"{path}: sha256 {actual[:12]}... does not match {manifest_path.name}"
                         f" ({entry['sha256'][:12]}...): the file changed after it was "
                         "written; prepare the shards again")
    return np.memmap(path, dtype=dtype, mode="r")


def read_rank_tokens(manifest_path: str | Path, rank: int = 0, world_size: int = 1
                     ) -> tuple[list[str], np.ndarray]:
    """This rank's shard files and their tokens, verified, in one array."""
    shards = load_manifest(manifest_path)["shards"]
    indices = shards_for_rank(len(shards), rank, world_size)
    tokens = np.concatenate([read_shard(manifest_path, i) for i in indices])
    return [shards[i]["file"] for i in indices], tokens
# --8<-- [end:read]


def main(argv: list[str] | None = None) -> int:
    from snippets.data.real_text import join_documents, prepare_documents, read_documents
    from snippets.flags import Parser, int_at_least

    p = Parser(description="Prepare token shards once; read a rank's shards back, verified.")
    commands = p.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenize a corpus into shard files + manifest")
    source = prep.add_mutually_exclusive_group()
    source.add_argument("--text", default=None,
                        help="one UTF-8 text file (default: the built-in generated corpus)")
    source.add_argument("--documents", default=None,
                        help="an OpenWebText-style corpus: 'pydoc', a folder of .txt files or "
                             "a .jsonl(.gz) file (see snippets/data/real_text.py)")
    prep.add_argument("--tokenizer", default="bytes",
                      help="'bytes' or a tokenizer.json from snippets/data/bpe.py")
    prep.add_argument("--num-shards", type=int_at_least(1), default=4)
    prep.add_argument("--out", required=True, help="folder for the shards and manifest.json")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace an earlier preparation in OUT (only the files it listed)")
    read = commands.add_parser("read", help="read this rank's shards (RANK and WORLD_SIZE "
                               "from the environment, as torchrun sets them)")
    read.add_argument("manifest")
    args = p.parse_args(argv)
    try:
        if args.command == "prepare":
            tokenizer_file = None if args.tokenizer == "bytes" else Path(args.tokenizer)
            tokenizer = (ByteTokenizer() if tokenizer_file is None
                         else BPETokenizer.load(tokenizer_file))
            if args.documents:
                documents, _ = prepare_documents(read_documents(args.documents))
                text, name = join_documents(documents), args.documents
            else:
                text, name = load_text(args.text), args.text or "the built-in generated corpus"
            manifest = prepare(text, tokenizer, tokenizer_file, args.num_shards,
                               Path(args.out), name, args.overwrite)
            print(f"{name}: {manifest['characters']:,} characters -> "
                  f"{manifest['total_tokens']:,} tokens ({manifest['tokenizer']['kind']}, "
                  f"vocab {tokenizer.vocab_size:,}, {np.dtype(manifest['dtype']).name})")
            for shard in manifest["shards"]:
                print(f"  {shard['file']}  {shard['tokens']:>7,} tokens  "
                      f"sha256 {shard['sha256'][:12]}...")
            print(f"wrote {Path(args.out) / MANIFEST}")
        else:
            try:
                rank = int(os.environ.get("RANK", 0))
                world_size = int(os.environ.get("WORLD_SIZE", 1))
            except ValueError:
                raise DataError("RANK and WORLD_SIZE must be whole numbers (torchrun sets "
                                "them), got RANK={RANK!r} WORLD_SIZE={WORLD_SIZE!r}"
                                .format(**{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")})
                                ) from None
            files, tokens = read_rank_tokens(args.manifest, rank, world_size)
            text = load_tokenizer(args.manifest).decode(tokens[:12].tolist())
            print(f"rank {rank} of {world_size}: {', '.join(files)}: {len(tokens):,} tokens, "
                  f"checksums verified; first tokens decode to {text!r}")
    except (DataError, FileExistsError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
