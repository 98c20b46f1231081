"""The local workflow: a BPE tokenizer, token shards with a manifest, real text, and logging to
TensorBoard and W&B (offline) from one training run."""

import gzip
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from snippets.data.bpe import END_OF_TEXT, BPETokenizer, compare
from snippets.data.corpus import DataError, generate_corpus
from snippets.data.real_text import clean, join_documents, prepare_documents, read_documents
from snippets.data.shards import (
    MANIFEST,
    ShardError,
    load_manifest,
    load_tokenizer,
    prepare,
    read_rank_tokens,
    read_shard,
    shards_for_rank,
)
from snippets.data.tokenizer import ByteTokenizer
from snippets.tools.read_logs import main as read_logs_main
from snippets.tools.read_logs import metrics_records, tensorboard_scalars, wandb_history
from snippets.scripts.train_tiny_transformer import main

REPO = Path(__file__).resolve().parents[1]
TEXT = generate_corpus(target_bytes=40_000)  # a seventh of the built-in corpus: fast to train on


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train([TEXT], vocab_size=400)


def _prepared(tmp_path, bpe, num_shards=4):
    bpe.save(tmp_path / "src" / "tokenizer.json")
    out = tmp_path / "data"
    prepare(TEXT, bpe, tmp_path / "src" / "tokenizer.json", num_shards, out, "test text")
    return out / MANIFEST


def test_bpe_is_lossless_deterministic_and_compresses(bpe):
    assert bpe.vocab_size == 400
    text = "naïve café — 東京 🚀\n\tthe cats see a red ball." + END_OF_TEXT + "next"
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text  # byte-level: no unknown tokens, even for unseen characters
    assert ids.count(bpe.end_of_text_id) == 1  # the separator is one token, not 13 bytes
    again = BPETokenizer.train([TEXT], vocab_size=400)
    assert again.tokenizer.to_str() == bpe.tokenizer.to_str()  # same text, same merges
    rows = {r["tokenizer"]: r for r in compare(TEXT, {"bytes": ByteTokenizer(), "bpe": bpe})}
    assert rows["bytes"]["tokens"] == len(TEXT.encode()) and rows["bytes"]["parameters"] == 115_520
    assert rows["bytes"]["embedding_share"] == 256 * 64 / 115_520
    assert rows["bpe"]["tokens"] < 0.5 * rows["bytes"]["tokens"]
    assert rows["bpe"]["parameters"] == 115_520 + (400 - 256) * 64  # only the embedding grows


def test_tokenizer_saved_atomically_and_never_over_another(tmp_path, bpe):
    path = tmp_path / "tokenizer.json"
    bpe.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temporary left
    assert stat.S_IMODE(path.stat().st_mode) & 0o044  # readable by others, as files usually are
    assert BPETokenizer.load(path).encode(TEXT[:500]) == bpe.encode(TEXT[:500])
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        bpe.save(path)
    with pytest.raises(DataError, match="cannot load the tokenizer"):
        BPETokenizer.load(tmp_path / "missing.json")


def test_shards_hold_the_text_and_ranks_read_disjoint_files(tmp_path, bpe):
    manifest_path = _prepared(tmp_path, bpe)
    manifest = json.loads(manifest_path.read_text())
    ids = bpe.encode(TEXT)
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"]["vocab_size"] == 400
    assert [s["tokens"] for s in manifest["shards"]] == [len(p) for p in np.array_split(ids, 4)]
    _, everything = read_rank_tokens(manifest_path)  # rank 0 of 1 reads every shard
    assert everything.tolist() == ids
    assert load_tokenizer(manifest_path).decode(everything) == TEXT
    for world_size in (1, 2, 3, 4):
        per_rank = [shards_for_rank(4, rank, world_size) for rank in range(world_size)]
        assert sorted(sum(per_rank, [])) == [0, 1, 2, 3]  # disjoint, and all of them
    files, tokens = read_rank_tokens(manifest_path, rank=1, world_size=2)
    assert files == ["shard-00001-of-00004.bin", "shard-00003-of-00004.bin"]
    assert tokens.tolist() == np.concatenate([read_shard(manifest_path, i) for i in (1, 3)]).tolist()
    with pytest.raises(DataError, match="5 ranks but only 4 shards"):
        shards_for_rank(4, 0, 5)
    with pytest.raises(DataError, match="not a course-token-shards/1 manifest"):
        load_manifest(manifest_path.parent / "tokenizer.json")  # JSON, but not a manifest
    (tmp_path / "text.json").write_text("plain text")
    with pytest.raises(DataError, match="not a course-token-shards/1 manifest"):
        load_manifest(tmp_path / "text.json")


def test_a_changed_shard_is_refused_by_name(tmp_path, bpe):
    manifest_path = _prepared(tmp_path, bpe)
    shard = manifest_path.parent / "shard-00002-of-00004.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # one flipped bit: same size, different content
    shard.write_bytes(bytes(data))
    read_rank_tokens(manifest_path, rank=1, world_size=2)  # shards 1 and 3: untouched
    with pytest.raises(ShardError, match=r"shard-00002-of-00004\.bin: sha256 .* does not match"):
        read_rank_tokens(manifest_path, rank=0, world_size=2)
    shard.write_bytes(bytes(data[:-2]))  # a truncated copy is caught by its size
    with pytest.raises(ShardError, match=r"shard-00002-of-00004\.bin: .* bytes, but"):
        read_shard(manifest_path, 2)
    # The trainer stops with the same one line, before it builds a model.
    assert main(["--data", str(manifest_path), "--out", str(tmp_path / "run")]) == 2


def test_prepare_replaces_only_its_own_files(tmp_path, bpe):
    manifest_path = _prepared(tmp_path, bpe)
    out = manifest_path.parent
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        prepare(TEXT, bpe, None, 2, out, "again")
    prepare(TEXT, ByteTokenizer(), None, 2, out, "again", overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST, "notes.txt", "shard-00000-of-00002.bin",
                     "shard-00001-of-00002.bin", "tokenizer.json"]  # the 4 old shards are gone
    stranger = tmp_path / "other"
    stranger.mkdir()
    (stranger / "shard-00000-of-00001.bin").write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="no manifest.json lists it"):
        prepare(TEXT, bpe, None, 1, stranger, "x", overwrite=True)
    assert (stranger / "shard-00000-of-00001.bin").read_bytes() == b"not ours"
    (stranger / "tokenizer.json").write_text("{}")  # someone else's tokenizer: refused, kept
    with pytest.raises(FileExistsError, match="is another tokenizer"):
        prepare(TEXT, bpe, tmp_path / "src" / "tokenizer.json", 2, stranger, "x")
    assert (stranger / "tokenizer.json").read_text() == "{}"
    # out's manifest (bytes) lists no tokenizer, so its tokenizer.json is not one to replace;
    # the refusal comes before any deletion and leaves the prepared folder whole.
    other = BPETokenizer.train([TEXT[:5000]], vocab_size=300)
    other.save(tmp_path / "other.json")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="is another tokenizer"):
        prepare(TEXT, other, tmp_path / "other.json", 2, out, "x", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_real_text_loader(tmp_path):
    assert clean("a\r\nb  \n\n\n\nc\x00" + END_OF_TEXT + "\n") == "a\nb\n\nc"
    docs, stats = prepare_documents(["x" * 300, "short", "x" * 300 + "\r\n", "y" * 300])
    assert docs == ["x" * 300, "y" * 300]
    assert stats == {"read": 4, "too_short": 1, "duplicates": 1}
    assert join_documents(docs).count(END_OF_TEXT) == 2
    folder = tmp_path / "owt"
    folder.mkdir()
    (folder / "b.txt").write_text("second")
    (folder / "a.txt").write_text("first")
    assert list(read_documents(folder)) == ["first", "second"]  # sorted: reproducible shards
    rows = tmp_path / "owt.jsonl.gz"
    with gzip.open(rows, "wt") as f:
        f.write('{"text": "one"}\n\n{"text": "two"}\n')
    assert list(read_documents(rows)) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object"):
        list(read_documents(bad))
    pydoc, _ = prepare_documents(read_documents("pydoc"))
    assert len(pydoc) > 50 and all(END_OF_TEXT not in d for d in pydoc)


def test_one_run_from_bpe_shards_logs_the_same_numbers_to_tensorboard_and_wandb(tmp_path, bpe):
    """A real run with both loggers (W&B offline, no network, no account), read back three ways."""
    manifest_path = _prepared(tmp_path, bpe, num_shards=2)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = tmp_path / "run"
    subprocess.run([sys.executable, str(REPO / "snippets/scripts/train_tiny_transformer.py"),
                    "--data", str(manifest_path), "--config", "tiny", "--batch-size", "8",
                    "--context-length", "32", "--steps-per-epoch", "6", "--eval-every", "3",
                    "--eval-batches", "2", "--sample-tokens", "5", "--device", "cpu",
                    "--tensorboard", "--wandb", "--out", str(out)],
                   check=True, env=env, cwd=REPO, capture_output=True, timeout=120)
    records = metrics_records(out)
    train_records = [r for r in records if r["kind"] == "train"]
    assert train_records[0]["loss"] == pytest.approx(math.log(400), abs=0.2)  # uniform guess
    assert json.loads((out / "run.json").read_text())["model"]["vocab_size"] == 400

    scalars = tensorboard_scalars(out)  # TensorBoard's own EventAccumulator
    assert scalars["train/loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-6)  # float32
                                     for r in train_records}
    assert sorted(scalars["eval/val_loss"]) == [3, 6]

    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and (out / "wandb" / "latest-run").resolve() == runs[0].resolve()
    (run_file,) = runs[0].glob("run-*.wandb")  # the records `wandb sync` uploads later
    history = wandb_history(run_file)
    assert [row["train/loss"] for row in history] == [r["loss"] for r in train_records]
    assert [row["eval/val_loss"] for row in history if "eval/val_loss" in row] == [
        r["val_loss"] for r in records if r["kind"] == "eval"]
    assert read_logs_main([str(out)]) == 0

    dry = subprocess.run([str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run",
                          str(runs[0])], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert "Would sync 1 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr
