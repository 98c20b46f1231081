"""torch.distributed.checkpoint: the demo's save on 2 ranks (sync and async) loads, bit for bit, on
4 ranks with another layout and in one plain process; and what a crash mid-save leaves, checked
against DCP's own FileSystemWriter in one process (no process group)."""

import contextlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

from snippets.library import dcp_checkpoint

pytestmark = pytest.mark.kernel_independent("checkpoint bytes copied and compared inside one run")


def test_saved_on_two_ranks_loads_equal_on_four_and_on_one(tmp_path, capsys):
    dcp_checkpoint.main(["--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "dcp.save wrote" in out and ".metadata, __0_0.distcp, __1_0.distcp" in out
    assert "state at save: 21 model tensors, 60 optimizer tensors" in out
    assert "each stores q_proj as (16, 64)" in out  # a quarter: the layout did change
    assert "loaded step-1.dcp, equal to the state at save: True" in out
    assert "no process group: dcp_to_torch_save" in out and out.count("state at save: True") == 3
    # async_save staged a copy before returning: step 2 did not leak into the checkpoint.
    assert "to the state after step 2: False" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-1-async.dcp", "step-1-async.pt", "step-1.dcp", "step-1.pt"]  # no .tmp left


def test_refuses_an_earlier_run_without_overwrite(tmp_path, capsys):
    (tmp_path / "step-1.dcp").mkdir()
    (tmp_path / "notes.txt").write_text("the learner's")
    with pytest.raises(SystemExit) as exit_info:
        dcp_checkpoint.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and (f"argument --out: an earlier run left step-1.dcp in "
                                           f"{tmp_path}: pass another --out to keep it, or "
                                           "--overwrite to replace it") in err
    dcp_checkpoint.prepare(tmp_path)  # what --overwrite does before saving
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@contextlib.contextmanager
def crash_at(method: str, call: int):
    """Make FileSystem.<method> raise on its `call`-th call, as if the process died there."""
    original, calls = getattr(filesystem.FileSystem, method), []

    def dying(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise KeyboardInterrupt(f"killed in FileSystem.{method}")
        return original(self, *args, **kwargs)

    setattr(filesystem.FileSystem, method, dying)
    try:
        yield
    finally:
        setattr(filesystem.FileSystem, method, original)


@pytest.fixture(autouse=True)
def one_process():
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended here
        warnings.simplefilter("ignore", UserWarning)
        yield


# --8<-- [start:crash]
def test_a_crash_before_the_metadata_leaves_an_unreadable_directory(tmp_path):
    with crash_at("rename", 1), pytest.raises(dcp.api.CheckpointException):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path)  # dies renaming .metadata.tmp
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata.tmp", "__0_0.distcp"]
    with pytest.raises(dcp.api.CheckpointException):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=tmp_path)  # no .metadata: refused


def test_a_crash_while_overwriting_mixes_two_saves_silently(tmp_path):
    def writer():  # one file per tensor, to have two files to write (as two ranks would)
        return dcp.FileSystemWriter(tmp_path, single_file_per_rank=False)

    dcp.save({"a": torch.zeros(4), "b": torch.zeros(4)}, storage_writer=writer())
    with crash_at("create_stream", 2), pytest.raises(dcp.api.CheckpointException):
        dcp.save({"a": torch.ones(4), "b": torch.ones(4)}, storage_writer=writer())  # overwrite=True
    state = {"a": torch.full((4,), -1.0), "b": torch.full((4,), -1.0)}
    dcp.load(state, checkpoint_id=tmp_path)  # no error: the old .metadata is still there
    assert state["a"].tolist() == [1.0] * 4 and state["b"].tolist() == [0.0] * 4  # half new, half old
# --8<-- [end:crash]
