"""Atomic saves, rotation, corruption detection with fallback, weights-only loading."""

import logging

import pytest
import torch

from snippets.training import checkpoint as ckpt
from snippets.training.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    NoCheckpointError,
    load_checkpoint,
    save_checkpoint,
    unwrap_model,
)

pytestmark = pytest.mark.kernel_independent("file writes, rotation and corruption detection")


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"step": step, "weights": torch.randn(64, 64), "rng": torch.get_rng_state(),
            "meta": {"name": "tiny", "lr": 1e-3, "betas": (0.9, 0.95), "extra": None}}


def test_atomic_save_round_trip_leaves_no_temp_files(tmp_path):
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.json"]
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["weights"], _state(1)["weights"])
    assert loaded["meta"]["betas"] == (0.9, 0.95)


def test_failed_save_keeps_the_old_file_and_cleans_up(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, _state(2))
    assert path.read_bytes() == before  # the old checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.json"]


def test_keep_last_k(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=2)
    with pytest.raises(NoCheckpointError, match="no checkpoint to resume from"):
        manager.load_latest()
    assert manager.latest() is None
    for step in (10, 20, 30, 40):
        manager.save(step, _state(step))
    assert [s for s, _ in manager.checkpoints()] == [30, 40]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "ckpt-00000030.pt", "ckpt-00000030.pt.json", "ckpt-00000040.pt", "ckpt-00000040.pt.json",
        "latest"]
    assert manager.latest() == manager.path_for(40)
    assert (tmp_path / "ckpts" / "latest").read_text() == "ckpt-00000040.pt\n"
    leftover = tmp_path / "ckpts" / ".ckpt-00000050.pt.1234.deadbeef.tmp"  # a killed save
    leftover.write_bytes(b"half a checkpoint")
    manager.save(50, _state(50))
    assert not leftover.exists()
    assert [s for s, _ in manager.checkpoints()] == [40, 50]
    loaded = manager.load_latest()
    assert loaded.step == 50 and loaded.state["step"] == 50
    assert manager.remove_all() == 2 and list((tmp_path / "ckpts").iterdir()) == []


def test_prunes_only_what_this_run_wrote(tmp_path):
    # An earlier run kept every checkpoint (Lab 1's --keep-last 11); a resumed run with the
    # default keep_last=3 must leave them all, and rotate only its own.
    earlier = CheckpointManager(tmp_path, keep_last=10)
    for step in (10, 20, 30, 40, 50):
        earlier.save(step, _state(step))
    resumed = CheckpointManager(tmp_path, keep_last=3)
    for step in (60, 70, 80, 90):
        resumed.save(step, _state(step))
    assert [s for s, _ in resumed.checkpoints()] == [10, 20, 30, 40, 50, 70, 80, 90]


def test_overwriting_a_name_never_pairs_a_file_with_an_old_checksum(tmp_path, monkeypatch):
    # A crash after the new file is renamed into place but before its checksum is written
    # must leave a loadable checkpoint: the old sidecar describes the old bytes.
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    real_write = ckpt._write_atomic

    def crash(target, write):
        raise KeyboardInterrupt("killed")  # stands in for a kill between the two writes

    monkeypatch.setattr(ckpt, "_write_atomic", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _state(2))
    monkeypatch.setattr(ckpt, "_write_atomic", real_write)
    assert not (tmp_path / "a.pt.json").exists()
    assert load_checkpoint(path)["step"] == 2  # checked by loading, and it is the new one


def test_truncated_newest_falls_back_to_previous(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20):
        manager.save(step, _state(step))
    newest = manager.path_for(20)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a crash mid-copy, a full disk, ...

    with pytest.raises(CorruptCheckpointError, match=r"ckpt-00000020\.pt is \d+ bytes but was "
                                                     r"written as \d+ bytes \(truncated"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        loaded = manager.load_latest()
    assert loaded.step == 10 and loaded.path == manager.path_for(10)
    assert torch.equal(loaded.state["weights"], _state(10)["weights"])
    # One line: which file, what is wrong, and that an older one is used.
    [message] = caplog.messages
    assert "\n" not in message
    assert "ckpt-00000020.pt" in message and "truncated" in message
    assert "falling back to the checkpoint before it" in message


def test_truncated_without_sidecar_is_caught_by_load(tmp_path):
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    (tmp_path / "a.pt.json").unlink()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"a\.pt .*cannot be read by torch\.load"):
        load_checkpoint(path)


def test_bit_flip_is_caught_by_checksum(tmp_path):
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="SHA-256 does not match"):
        load_checkpoint(path)


def test_all_damaged_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        manager.save(step, _state(step))
        manager.path_for(step).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="all 2 checkpoints .* are damaged"):
        manager.load_latest()


def test_loads_use_weights_only(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "a.pt", _state(1))
    seen = []
    real_load = torch.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "load", spy)
    load_checkpoint(path)
    CheckpointManager(tmp_path).save(5, _state(5))
    CheckpointManager(tmp_path).load_latest()
    assert seen == [True, True]


class Arbitrary:
    """Stands in for any pickled object: unpickling it could run code."""


def test_pickled_object_is_refused(tmp_path):
    # save_checkpoint refuses it up front...
    with pytest.raises(TypeError, match=r"state\['obj'\] is a .*Arbitrary"):
        save_checkpoint(tmp_path / "a.pt", {"obj": Arbitrary()})
    # ...and a file written some other way is refused at load time.
    evil = tmp_path / "evil.pt"
    torch.save({"obj": Arbitrary()}, evil)
    with pytest.raises(CheckpointError, match=r"evil\.pt holds a .*Arbitrary.*weights_only=True"):
        load_checkpoint(evil)


def test_unwrap_model():
    model = torch.nn.Linear(2, 2)
    wrapper = torch.nn.DataParallel(model)  # same .module attribute as DDP, no process group
    assert unwrap_model(wrapper) is model
    assert unwrap_model(model) is model
    assert list(unwrap_model(wrapper).state_dict()) == ["weight", "bias"]  # no "module." prefix
