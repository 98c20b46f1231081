"""The byte tokenizer, the generated corpus, the split and the samplers."""

import pytest
import torch

from snippets.data.corpus import BUILTIN_TARGET_BYTES, DataError, generate_corpus, load_text
from snippets.data.dataset import (
    RandomWindowSampler,
    load_tokens,
    sequential_batches,
    train_val_split,
)
from snippets.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.kernel_independent("tokenizers and integer token ids")


def test_tokenizer_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀 plain ascii\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size == 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # multi-byte characters
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text  # tensors of ids work too


def test_tokenizer_decodes_invalid_utf8_without_crashing():
    tok = ByteTokenizer()
    half_an_e_acute = tok.encode("é")[:1]
    assert tok.decode(half_an_e_acute + tok.encode("x")) == "\ufffdx"


def test_corpus_is_deterministic_and_structured():
    a, b = generate_corpus(), generate_corpus()
    assert a == b
    assert generate_corpus(seed=1) != a
    assert BUILTIN_TARGET_BYTES <= len(a.encode()) < BUILTIN_TARGET_BYTES + 200
    lines = a.splitlines()
    arithmetic = [line for line in lines if " = " in line]
    assert arithmetic and all(eval(l.split(" = ")[0]) == int(l.split(" = ")[1]) for l in arithmetic)
    records = [line for line in lines if line.startswith("record ")]
    for line in records:  # the "check" part copies the id, name and city
        rid = line.split()[1].rstrip(":")
        name = line.split("name=")[1].split()[0]
        assert line.endswith(f"| check {rid} -> {name} {line.split('city=')[1].split()[0]}")
    assert " cats see " in a or " cats like " in a
    assert " cats sees " not in a and " cat see " not in a  # agreement holds
    assert " an apple" in a and " a apple" not in a and " a old " not in a
    assert " their hat." not in a and " boxs" not in a
    assert load_text(None) == a


def test_split_is_contiguous_with_no_overlap():
    positions = torch.arange(1000)  # token i is just its position, so overlap is visible
    train, val = train_val_split(positions, val_fraction=0.1, context_length=8)
    assert (len(train), len(val)) == (900, 100)
    assert torch.equal(torch.cat([train, val]), positions)  # the tail is held out, in order
    assert set(train.tolist()).isdisjoint(val.tolist())
    # Windows drawn for training never reach into the validation tail.
    sampler = RandomWindowSampler(train, batch_size=64, context_length=8, seed=0)
    drawn = torch.cat([sampler.next_batch() for _ in range(200)])
    assert drawn.shape == (12800, 9) and int(drawn.max()) < 900
    assert int(drawn.max()) == 899  # ...but do reach its last token


def test_sampler_reproducible_from_saved_state():
    tokens = load_tokens(None, context_length=32)
    sampler = RandomWindowSampler(tokens, batch_size=4, context_length=32, seed=7)
    for _ in range(3):
        sampler.next_batch()
    saved = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(5)]

    fresh = RandomWindowSampler(tokens, batch_size=4, context_length=32, seed=999)
    fresh.load_state_dict(saved)
    assert fresh.batches_drawn == 3
    for want in expected:
        assert torch.equal(fresh.next_batch(), want)
    # And the same seed gives the same stream from the start.
    s1 = RandomWindowSampler(tokens, 4, 32, seed=7)
    s2 = RandomWindowSampler(tokens, 4, 32, seed=7)
    assert torch.equal(s1.next_batch(), s2.next_batch())


def test_sequential_batches_cover_every_token_once():
    tokens = torch.arange(100) % 256
    windows = torch.cat(list(sequential_batches(tokens, batch_size=3, context_length=10)))
    assert windows.shape == (9, 11) and windows.dtype == torch.int64
    targets = windows[:, 1:].reshape(-1)
    assert torch.equal(targets, torch.arange(1, 91))  # each target exactly once, in order
    assert len(list(sequential_batches(tokens, 3, 10, max_batches=2))) == 2


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"not found: .*nope\.txt"):
        load_tokens(missing, context_length=16)


def test_short_file_names_file_and_sizes(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("héllo", encoding="utf-8")  # 6 bytes
    with pytest.raises(DataError, match=r"short\.txt is too short: 6 tokens.* = 17 tokens"):
        load_tokens(short, context_length=16)


def test_file_too_short_to_split_names_file(tmp_path):
    f = tmp_path / "forty.txt"
    f.write_text("x" * 40)
    tokens = load_tokens(f, context_length=32)  # one window fits...
    with pytest.raises(DataError, match=r"forty\.txt has 40 tokens; split 36/4"):
        train_val_split(tokens, 0.1, context_length=32, source=str(f))  # ...but not two


def test_any_utf8_file_works_and_non_utf8_is_reported(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("ünïcode " * 10, encoding="utf-8")
    tokens = load_tokens(f, context_length=16)
    assert tokens.dtype == torch.uint8
    assert ByteTokenizer().decode(tokens.tolist()) == "ünïcode " * 10
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1") * 20)
    with pytest.raises(DataError, match="not UTF-8"):
        load_tokens(bad, context_length=16)
