"""Kill the checkpoint writer at every step of its write sequence, then resume.

A kill leaves the disk as it was at that instant. So one instrumented run of the trainer copies
its run directory just before every file operation of one checkpoint save (the temp file's
write, each fsync, each rename, each delete; and once mid-write, with the temp file half
there): each copy is what a run killed at that point would leave behind. Resuming from each
copy must pick the newest good checkpoint without calling anything damaged, and end
bit-identical to the unbroken run.
"""

import json
import logging
import os
import re
import shutil

import pytest
import torch

from snippets.training import checkpoint as ckpt
from snippets.scripts import train_tiny_transformer as tiny

pytestmark = pytest.mark.kernel_independent("a killed writer and the resume that follows, compared inside one machine")

ARGS = ["--config", "tiny", "--batch-size", "2", "--context-length", "16", "--epochs", "1",
        "--steps-per-epoch", "8", "--ckpt-every", "2", "--keep-last", "2", "--eval-every", "0",
        "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "100", "--device", "cpu",
        "--threads", "1"]
KILLED_SAVE = 6  # the save that also prunes (keep-last 2 drops step 2); step 4 is the one before


def _name(arg) -> str:
    """The file an operation is on: 'ckpt-00000006.pt', or 'temp latest' for its temp file."""
    if isinstance(arg, int):  # a file descriptor
        arg = os.readlink(f"/proc/self/fd/{arg}")
    name = os.path.basename(getattr(arg, "name", arg))
    temp = re.fullmatch(r"\.(.+)\.\d+\.[0-9a-f]{8}\.tmp", name)
    return f"temp {temp.group(1)}" if temp else name


class KillPoints:
    """Copies the run directory before each file operation of the save of KILLED_SAVE."""

    def __init__(self, run_dir, copies_dir, monkeypatch):
        self.run_dir, self.copies_dir = run_dir, copies_dir
        self.armed = False
        self.copies = []  # (label, directory)
        for module, name in [(os, "fsync"), (os, "replace"), (os, "unlink"), (torch, "save")]:
            monkeypatch.setattr(module, name, self._hook(name, getattr(module, name)))
        real_save = ckpt.CheckpointManager.save

        def save(manager, step, state):
            self.armed = step == KILLED_SAVE
            try:
                return real_save(manager, step, state)
            finally:
                if self.armed:
                    self.copy("after the whole save")
                self.armed = False

        monkeypatch.setattr(ckpt.CheckpointManager, "save", save)

    def copy(self, label: str):
        target = self.copies_dir / f"kill-{len(self.copies):02d}"
        armed, self.armed = self.armed, False  # copying must not trigger the hooks
        shutil.copytree(self.run_dir, target)
        self.armed = armed
        self.copies.append((label, target))
        return target

    def _hook(self, name, real):
        def hooked(*args, **kwargs):
            if not self.armed:
                return real(*args, **kwargs)
            if name == "save":  # torch.save(state, file)
                self.copy(f"before writing {_name(args[1])}")
                result = real(*args, **kwargs)
                args[1].flush()
                target = self.copy(f"while writing {_name(args[1])} (half of it on disk)")
                for tmp in target.rglob("*.tmp"):
                    tmp.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])
                return result
            self.copy(f"before {name}({', '.join(_name(a) for a in args[:2])})")
            return real(*args, **kwargs)
        return hooked


def _train_losses(run_dir):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def _final_state(run_dir):
    return ckpt.load_checkpoint(run_dir / "checkpoints" / "ckpt-00000008.pt")


def _leaves(obj, path="") -> dict:
    """Every tensor and number in nested dicts and lists, by its path ('.state.3.exp_avg')."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {path: obj}
    leaves = {}
    for key, value in items:
        leaves.update(_leaves(value, f"{path}.{key}"))
    return leaves


def _assert_same_state(a, b, where):
    assert a["step"] == b["step"] == 8, where
    for part in ("model", "optimizer"):
        leaves_a, leaves_b = _leaves(a[part]), _leaves(b[part])
        assert leaves_a.keys() == leaves_b.keys(), where
        for key, x in leaves_a.items():
            y = leaves_b[key]
            # Exact: the same operations on the same inputs, one thread, same order.
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (where, key)


@pytest.fixture
def args(monkeypatch, tmp_path):
    """A small text file instead of the generated corpus, and no loss plot: a run then takes
    about a quarter of a second."""
    monkeypatch.setattr(tiny, "plot_losses", lambda *args: None)
    text = tmp_path / "text.txt"
    text.write_text("record 17: the cat sat on the mat, and the dog ran to the sea.\n" * 40)
    return ARGS + ["--data", str(text)]


def test_kill_at_every_step_of_a_save_then_resume(tmp_path, args, monkeypatch, caplog, capsys):
    run_dir = tmp_path / "unbroken"
    with monkeypatch.context() as patches:
        points = KillPoints(run_dir, tmp_path, patches)
        tiny.train(tiny.parse_args(args + ["--out", str(run_dir)]))
    labels = [label for label, _ in points.copies]
    # The write sequence, in order.
    assert labels == [
        "before writing temp ckpt-00000006.pt",
        "while writing temp ckpt-00000006.pt (half of it on disk)",
        "before fsync(temp ckpt-00000006.pt)",
        "before unlink(ckpt-00000006.pt.json)",  # a stale checksum never meets the new file
        "before replace(temp ckpt-00000006.pt, ckpt-00000006.pt)",
        "before fsync(checkpoints)",  # the rename itself made durable
        "before fsync(temp ckpt-00000006.pt.json)",  # the checksum, after the file
        "before replace(temp ckpt-00000006.pt.json, ckpt-00000006.pt.json)",
        "before fsync(checkpoints)",
        "before fsync(temp latest)",  # the latest pointer
        "before replace(temp latest, latest)",
        "before fsync(checkpoints)",
        "before unlink(ckpt-00000002.pt)",  # keep-last 2: step 2, which this run wrote, goes
        "before unlink(ckpt-00000002.pt.json)",
        "after the whole save"]
    renamed = labels.index("before replace(temp ckpt-00000006.pt, ckpt-00000006.pt)")
    reference, reference_losses = _final_state(run_dir), _train_losses(run_dir)
    capsys.readouterr()
    # The resumed runs need no durable writes (the kill points above test those): skip the
    # fsyncs, a third of each run's time.
    monkeypatch.setattr(os, "fsync", lambda fd: None)

    for i, (label, killed) in enumerate(points.copies):
        where = f"killed {label}"
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tiny.train(tiny.parse_args(args + ["--out", str(killed), "--resume"]))
        newest_good = 6 if i > renamed else 4
        assert f"ckpt-{newest_good:08d}.pt at step {newest_good}" in capsys.readouterr().out, \
            where
        # No file under its final name is damaged. (Killed between a file's rename and its
        # checksum, the file has no sidecar yet: the loader says so and checks it by loading.)
        assert not [m for m in caplog.messages if "falling back" in m], where
        _assert_same_state(_final_state(killed), reference, where)
        assert _train_losses(killed) == reference_losses, where
        assert (killed / "checkpoints" / "latest").read_text() == "ckpt-00000008.pt\n", where
        assert not list(killed.rglob("*.tmp")), where  # a killed save's temp file is gone


def test_damaged_newest_is_reported_in_one_line_and_skipped(tmp_path, args, caplog, capsys):
    unbroken, damaged = tmp_path / "unbroken", tmp_path / "damaged"
    tiny.train(tiny.parse_args(args + ["--out", str(unbroken)]))
    tiny.train(tiny.parse_args(args + ["--out", str(damaged), "--max-steps", "6"]))
    newest = damaged / "checkpoints" / "ckpt-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a disk error, a bad copy...
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        tiny.train(tiny.parse_args(args + ["--out", str(damaged), "--resume"]))
    [message] = caplog.messages
    assert "\n" not in message and str(newest) in message and "truncated" in message
    assert "ckpt-00000004.pt at step 4" in capsys.readouterr().out
    _assert_same_state(_final_state(damaged), _final_state(unbroken), "damaged newest")
    assert _train_losses(damaged) == _train_losses(unbroken)
