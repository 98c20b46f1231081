"""Checkpoints that survive crashes: atomic writes, verification, rotation, fallback.

* ``save_checkpoint`` never leaves a half-written file under the final name:
  it writes a temporary file in the same directory, flushes and fsyncs it,
  and only then renames it into place with ``os.replace`` (atomic on POSIX
  and Windows when source and target are on the same filesystem).
* Next to every ``ckpt-00000020.pt`` sits ``ckpt-00000020.pt.json`` with the
  file's size and SHA-256, written (atomically too) *after* the checkpoint is
  in place: a crash in between leaves a good file with no checksum, which is
  then checked by loading it, never a good file with someone else's checksum.
  Loading checks both, so a truncated or bit-flipped file is reported
  instead of being half-loaded.
* Loading always uses ``torch.load(..., weights_only=True)``: unpickling an
  arbitrary file can run arbitrary code, and weights-only loading accepts only
  tensors and plain containers/numbers/strings. ``save_checkpoint`` checks the
  state against that rule up front, so an unloadable checkpoint is caught at
  save time, not at resume time.
* ``CheckpointManager`` writes step-numbered files and a ``latest`` pointer,
  keeps the last K of the checkpoints *it* wrote (never one it did not), and,
  when the newest one is damaged, says so in one line and falls back to the
  previous good one.
* ``refuse_earlier_run`` is the rule every command that writes a run follows: a
  fresh start never writes over an earlier run's files unless --overwrite says so,
  and the refusal names the way on in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import torch

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


class CorruptCheckpointError(CheckpointError):
    """The file exists but is damaged (truncated, wrong checksum, unreadable)."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """There is no checkpoint to resume from."""


class RunExistsError(CheckpointError):
    """A fresh run was pointed at a directory that holds an earlier run."""


def refuse_earlier_run(found, where: str | Path | None = None, *, overwrite: bool,
                       keep: str = "--out", resume: bool = False) -> None:
    """Refuse to start a fresh run over what an earlier run left, unless --overwrite.

    The one rule of every command that writes a run: `found` names what an earlier run left
    where this one would write (its files, or a description such as "2 checkpoints (steps
    2-4)"), in the folder `where` when they are not full paths. Nothing found, or --overwrite
    passed: return, and the caller deletes what it found, never more than its own kinds of file.
    Otherwise raise RunExistsError, one line that names the way on: --resume to continue the run
    (for a command that can), another `keep` (the flag or argument that names the output) to
    keep it, or --overwrite to replace it.
    """
    if not found or overwrite:
        return
    names = [str(name) for name in found]
    listing = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if where is not None:
        listing += f" in {where}"
    continue_it = "--resume to continue it, " if resume else ""
    raise RunExistsError(f"an earlier run left {listing}: pass {continue_it}another {keep} to "
                         "keep it, or --overwrite to replace it")


def changed_fields(saved: dict, now: dict) -> list[str]:
    """The names of the fields whose values differ, in order."""
    return [key for key in {**saved, **now} if saved.get(key) != now.get(key)]


def config_diff(saved: dict, now: dict) -> str:
    """The fields that differ, as 'name saved -> now', comma-separated ('' if none)."""
    return ", ".join(f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
                     for key in changed_fields(saved, now))


# --8<-- [start:unwrap-model]
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside a DistributedDataParallel (or DataParallel) wrapper.

    Saving ``ddp_model.state_dict()`` would prefix every key with ``module.``,
    and the checkpoint would then only load into another wrapped model.
    """
    return model.module if hasattr(model, "module") else model
# --8<-- [end:unwrap-model]


_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype,
                torch.device, torch.Size)


def _check_weights_only_safe(obj: Any, where: str = "state") -> None:
    """Raise TypeError if ``obj`` holds anything ``torch.load(weights_only=True)`` may refuse."""
    if isinstance(obj, _SAFE_LEAVES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_weights_only_safe(key, f"{where} key {key!r}")
            _check_weights_only_safe(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):  # not namedtuples
        for i, value in enumerate(obj):
            _check_weights_only_safe(value, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint "
                    "may hold only tensors, dicts, lists, tuples, numbers, strings and None, "
                    "so that it loads with torch.load(weights_only=True). Convert it first "
                    "(e.g. numpy array -> torch.from_numpy, RNG state -> tensor or list).")


def fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX). Not possible, nor needed, on Windows."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_path(path: Path) -> Path:
    """A fresh hidden name in the same directory (same filesystem, so os.replace is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _write_atomic(path: Path, write) -> None:
    """Run ``write(file)`` on a temp file next to ``path``, fsync it, rename it to ``path``."""
    tmp = _temp_path(path)
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


# --8<-- [start:atomic-save]
def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` to ``path`` atomically, then its size + SHA-256 sidecar."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_weights_only_safe(state)
    tmp = _temp_path(path)
    try:
        with open(tmp, "xb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before any name points at them
        meta = {"file": path.name, "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
        # A sidecar may only ever describe the file beside it: an old one goes first.
        _sidecar(path).unlink(missing_ok=True)
        os.replace(tmp, path)  # atomic: the old file or the new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    # The checksum goes in last: a crash before this line leaves a complete file with no
    # sidecar (checked by loading it), never a good file with a checksum that is not its own.
    _write_atomic(_sidecar(path), lambda f: f.write(json.dumps(meta).encode()))
    return path
# --8<-- [end:atomic-save]


# --8<-- [start:verified-load]
def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Verify ``path`` against its sidecar, then load it with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise NoCheckpointError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    sidecar = _sidecar(path)
    if sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
            want_bytes, want_sha = int(meta["bytes"]), meta["sha256"]
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpointError(f"{sidecar}: unreadable checksum file ({err})") from None
        if size != want_bytes:
            raise CorruptCheckpointError(
                f"{path} is {size} bytes but was written as {want_bytes} bytes "
                f"(truncated or overwritten: {size / max(want_bytes, 1):.0%} of it is there)")
        if _sha256(path) != want_sha:
            raise CorruptCheckpointError(f"{path}: SHA-256 does not match {sidecar.name} "
                                         "(the file is corrupted)")
    else:  # e.g. a checkpoint copied by hand; loading is the only check left
        log.warning("%s has no checksum file %s; verifying by loading only", path, sidecar.name)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        text = str(err)
        if text.startswith("Weights only load failed"):
            detail = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            raise CheckpointError(
                f"{path} holds a {detail.group(1) if detail else 'Python object'}, which "
                "torch.load(weights_only=True) refuses to unpickle (unpickling can run "
                "arbitrary code); it was not written by save_checkpoint") from None
        first_line = text.splitlines()[0] if text else ""
        raise CorruptCheckpointError(f"{path} ({size} bytes) cannot be read by torch.load: "
                                     f"{type(err).__name__}: {first_line}") from None
# --8<-- [end:verified-load]


@dataclass
class LoadedCheckpoint:
    step: int
    path: Path
    state: dict


class CheckpointManager:
    """``ckpt-<step>.pt`` files in one directory, a ``latest`` pointer to the newest, and the
    newest ``keep_last`` of the checkpoints this manager wrote.

    ``suffix=".dcp"`` manages checkpoint *directories* (torch.distributed.checkpoint) instead.
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, suffix: str = ".pt"):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.suffix = suffix
        self.pattern = re.compile(rf"^ckpt-(\d+){re.escape(suffix)}$")
        self.written: list[Path] = []  # what this run wrote: the only checkpoints it deletes

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:08d}{self.suffix}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = self.pattern.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest checkpoint file (not yet verified), or None."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def describe(self) -> str:
        """'3 checkpoints (steps 50-150)', for messages; '' when there are none."""
        steps = [step for step, _ in self.checkpoints()]
        if not steps:
            return ""
        if len(steps) == 1:
            return f"1 checkpoint (step {steps[0]})"
        return f"{len(steps)} checkpoints (steps {steps[0]}-{steps[-1]})"

    # --8<-- [start:rotate]
    def save(self, step: int, state: dict) -> Path:
        return self.commit(save_checkpoint(self.path_for(step), state))

    def commit(self, path: Path) -> Path:
        """``path`` is complete on disk: point ``latest`` at it, then drop this run's old ones."""
        _write_atomic(self.directory / "latest", lambda f: f.write(f"{path.name}\n".encode()))
        self.written = [p for p in self.written if p != path] + [path]
        # Only now that the new file is safely in place may old ones go, and only the ones
        # this run wrote: checkpoints from before a --resume are the learner's to delete.
        for old in self.written[: -self.keep_last]:
            self._remove(old)
        self.written = self.written[-self.keep_last:]
        for pattern in (f".ckpt-*{self.suffix}*.tmp", ".latest.*.tmp"):  # from a killed save
            for leftover in self.directory.glob(pattern):
                self._remove(leftover)
        return path
    # --8<-- [end:rotate]

    def remove_all(self) -> int:
        """Delete every checkpoint and the pointer (for --overwrite); returns the count."""
        found = self.checkpoints()
        for _, path in found:
            self._remove(path)
        (self.directory / "latest").unlink(missing_ok=True)
        return len(found)

    @staticmethod
    def _remove(path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
            _sidecar(path).unlink(missing_ok=True)

    # --8<-- [start:load-latest]
    def load_newest_good(self, load):
        """``(step, path, load(path))`` for the newest checkpoint ``load`` accepts. A damaged
        one (``load`` raises CorruptCheckpointError) is reported in one line and skipped."""
        found = self.checkpoints()
        if not found:
            raise NoCheckpointError(f"no checkpoint to resume from in {self.directory} "
                                    f"(looked for ckpt-*{self.suffix}); start a run without "
                                    "--resume first")
        problems = []
        for step, path in reversed(found):
            try:
                return step, path, load(path)
            except CorruptCheckpointError as err:
                problems.append(str(err))
                log.warning("%s; falling back to the checkpoint before it", err)
        raise CorruptCheckpointError(f"all {len(found)} checkpoints in {self.directory} are "
                                     "damaged:\n  " + "\n  ".join(problems))

    def load_latest(self, map_location: str | torch.device = "cpu") -> LoadedCheckpoint:
        """The newest checkpoint that verifies and loads; damaged ones are skipped."""
        step, path, state = self.load_newest_good(
            lambda p: load_checkpoint(p, map_location=map_location))
        return LoadedCheckpoint(step=step, path=path, state=state)
    # --8<-- [end:load-latest]


# Random-number state: a resumed run must draw the same numbers an unbroken run would have.
# --8<-- [start:seed]
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CPU generator and every CUDA/MPS device too
# --8<-- [end:seed]


# --8<-- [start:rng-state]
def capture_rng_state() -> dict:
    """Every global RNG as tensors/lists, so the checkpoint loads with weights_only=True."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),  # a tuple of ints
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])
# --8<-- [end:rng-state]
