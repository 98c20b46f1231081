"""The single-device trainer: it learns, it writes its outputs, and --resume is exact."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from snippets.machine import pick_device
from snippets.scripts import train_tiny_transformer as trainer
from snippets.scripts.train_tiny_transformer import main, parse_args, train

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "snippets" / "scripts" / "train_tiny_transformer.py"
# Small batches and short sequences keep every run here to a second or two on 2 CPU cores;
# one thread, because two threads slow to a crawl when other jobs share those cores.
FAST = ["--config", "tiny", "--batch-size", "8", "--context-length", "32", "--device", "cpu",
        "--eval-batches", "4", "--sample-tokens", "20", "--threads", "1"]


def _read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_short_run_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    records = train(parse_args(FAST + ["--epochs", "1", "--steps-per-epoch", "60",
                                       "--eval-every", "20", "--ckpt-every", "20",
                                       "--keep-last", "2", "--out", str(out)]))
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 60
    assert losses[0] == pytest.approx(5.55, abs=0.2)  # ln(256): a uniform guess over bytes
    assert losses[-1] < 0.8 * losses[0], losses[::10]

    assert _read_metrics(out) == records
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    step_record = records[0]
    assert set(step_record) == {"kind", "step", "epoch", "loss", "lr", "grad_norm",
                                "tokens_per_s"}
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt"))
    assert ckpts == ["ckpt-00000040.pt", "ckpt-00000060.pt"]  # keep-last 2


def test_resume_is_bit_exact(tmp_path, monkeypatch):
    common = FAST + ["--epochs", "1", "--steps-per-epoch", "40", "--eval-every", "10",
                     "--ckpt-every", "10"]
    unbroken = train(parse_args(common + ["--out", str(tmp_path / "unbroken")]))

    class CrashesAtStep26(trainer.RandomWindowSampler):
        def next_batch(self):
            if self.batches_drawn == 25:
                raise RuntimeError("the job was killed")
            return super().next_batch()

    # Killed during step 26: the newest checkpoint is step 20, so steps 21-25 are redone.
    crashed = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "RandomWindowSampler", CrashesAtStep26)
        with pytest.raises(RuntimeError, match="killed"):
            train(parse_args(common + ["--out", str(crashed)]))
    first = _read_metrics(crashed)
    assert [r["step"] for r in first if r["kind"] == "train"][-1] == 25
    resumed = train(parse_args(common + ["--out", str(crashed), "--resume"]))
    # Stopped by --max-steps after step 25: it saves a checkpoint there, and nothing is redone.
    stopped = tmp_path / "stopped"
    train(parse_args(common + ["--out", str(stopped), "--max-steps", "25"]))
    continued = train(parse_args(common + ["--out", str(stopped), "--resume"]))

    def losses(records, lo, hi):
        return {r["step"]: r["loss"] for r in records
                if r["kind"] == "train" and lo <= r["step"] <= hi}

    assert sorted(losses(resumed, 0, 99)) == list(range(21, 41))
    assert sorted(losses(continued, 0, 99)) == list(range(26, 41))
    # Exact equality, not approx: on CPU the same ops on the same inputs with the same
    # thread count run the same instructions in the same order, and the checkpoint
    # restores every input of a step exactly (weights, AdamW moments, scheduler position,
    # sampler generator, global RNGs). Any difference means some state was not restored.
    assert losses(resumed, 21, 40) == losses(unbroken, 21, 40)
    assert losses(continued, 26, 40) == losses(unbroken, 26, 40)
    assert losses(first, 1, 20) == losses(unbroken, 1, 20)
    val = lambda recs: [(r["step"], r["val_loss"]) for r in recs if r["kind"] == "eval"]
    assert val(resumed) == [v for v in val(unbroken) if v[0] > 20]

    # metrics.jsonl was rolled back to step 20 before resuming: no duplicated steps, and
    # the file (written as JSON, which round-trips floats exactly) matches the unbroken run.
    def logged_losses(run_dir):
        return [(r["step"], r["loss"]) for r in _read_metrics(run_dir) if r["kind"] == "train"]

    assert [s for s, _ in logged_losses(crashed)] == list(range(1, 41))
    assert logged_losses(crashed) == logged_losses(tmp_path / "unbroken")
    assert logged_losses(stopped) == logged_losses(tmp_path / "unbroken")


@pytest.mark.parametrize("stop, flags, kept", [
    (50, [], [50]),  # before the first checkpoint of the default --ckpt-every 100
    (130, ["--ckpt-every", "50", "--keep-last", "2"], [100, 130]),  # between two of them
])
def test_max_steps_saves_a_checkpoint_that_resume_continues_from(stop, flags, kept, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    total = stop + 10
    run = FAST + ["--epochs", "1", "--steps-per-epoch", str(total), "--eval-every", "20",
                  "--out", str(out), *flags]
    assert main(run + ["--max-steps", str(stop)]) == 0
    assert f"stopped at step {stop} (--max-steps)" in capsys.readouterr().out
    assert sorted(int(p.stem[5:]) for p in (out / "checkpoints").glob("ckpt-*.pt")) == kept
    assert main(run + ["--resume"]) == 0
    assert f"ckpt-{stop:08d}.pt at step {stop}\n" in capsys.readouterr().out
    logged = _read_metrics(out)
    assert [r["step"] for r in logged if r["kind"] == "train"] == list(range(1, total + 1))
    evals = [r["step"] for r in logged if r["kind"] == "eval"]
    assert evals == sorted(set(evals)) and evals[-1] == total


def test_a_rerun_never_destroys_the_earlier_run(tmp_path, capsys):
    out = tmp_path / "run"
    short = FAST + ["--epochs", "1", "--steps-per-epoch", "4", "--eval-every", "0",
                    "--ckpt-every", "2", "--out", str(out)]
    assert main(short) == 0
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    # The same command again: refused, in one line saying what is there and the three ways
    # on, and nothing is touched. (Another config: tests/test_lab1.py.)
    assert main(short) == 2
    err = capsys.readouterr().err
    assert err == ("error: an earlier run left 2 checkpoints (steps 2-4), metrics.jsonl, "
                   f"run.json, loss.png in {out}: pass --resume to continue it, another --out "
                   "to keep it, or --overwrite to replace it\n")
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # --overwrite deletes only what this script writes.
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "best.pt").write_bytes(b"kept by hand")
    assert main(short + ["--overwrite", "--seed", "1"]) == 0
    assert "--overwrite: removed the earlier run" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "checkpoints" / "best.pt").read_bytes() == b"kept by hand"
    assert (out / "checkpoints" / "ckpt-00000004.pt").read_bytes() != before["ckpt-00000004.pt"]


def test_resume_prunes_only_its_own_checkpoints(tmp_path):
    # Lab 1 keeps every checkpoint (--keep-last 11); a later --resume with the default
    # --keep-last 3 must not delete them.
    out = str(tmp_path / "run")
    common = FAST + ["--epochs", "1", "--steps-per-epoch", "12", "--eval-every", "0",
                     "--ckpt-every", "1", "--out", out]
    train(parse_args(common + ["--keep-last", "11", "--max-steps", "6"]))
    train(parse_args(common + ["--resume"]))
    steps = sorted(int(p.stem[5:]) for p in (tmp_path / "run" / "checkpoints").glob("*.pt"))
    assert steps == [1, 2, 3, 4, 5, 6, 10, 11, 12]  # the first run's 6, the resumed run's last 3
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "ckpt-00000012.pt\n"


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_unavailable_device_is_a_clear_error(device, tmp_path, capsys):
    available = torch.cuda.is_available() if device == "cuda" else torch.backends.mps.is_available()
    if available:
        pytest.skip(f"{device} is available here")
    assert main(["--device", device, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--device {device} was requested, but {device.upper()} is not available" in err
    assert "--device cpu" in err
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type in ("cpu", "cuda", "mps")


def test_clear_errors_for_data_and_resume(tmp_path, capsys):
    assert main(FAST + ["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    assert "data file not found" in capsys.readouterr().err
    assert main(FAST + ["--resume", "--out", str(tmp_path / "empty")]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err


def test_missing_optional_logger_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    assert main(FAST + ["--tensorboard", "--out", str(tmp_path)]) == 2
    assert "--tensorboard needs the tensorboard package: pip install tensorboard" in (
        capsys.readouterr().err)
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before touching the run dir


def test_tensorboard_logs_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(parse_args(FAST + ["--tensorboard", "--epochs", "1", "--steps-per-epoch", "3",
                             "--out", str(tmp_path)]))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/val_loss"} <= set(tags)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_wandb_logs_offline(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, sorted(data)))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", os.environ.get("WANDB_MODE"), kwargs["config"]["model"]["hidden_size"]))
        return FakeRun()

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "unset-by-test")
    monkeypatch.delenv("WANDB_MODE")
    train(parse_args(FAST + ["--wandb", "--epochs", "1", "--steps-per-epoch", "2",
                             "--out", str(tmp_path)]))
    assert calls[0] == ("init", "offline", 64)
    assert calls[1] == ("log", 1, ["train/grad_norm", "train/loss", "train/lr",
                                   "train/tokens_per_s"])
    assert ("log", 2, ["eval/val_loss"]) in calls and calls[-1] == ("finish",)


def test_trains_on_a_local_text_file(tmp_path):
    text = tmp_path / "poem.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    records = train(parse_args(FAST + ["--data", str(text), "--epochs", "1",
                                       "--steps-per-epoch", "5", "--out", str(tmp_path / "r")]))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [5]


def test_cli_runs_from_the_repo_root(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), *FAST, "--epochs", "1",
         "--steps-per-epoch", "5", "--out", str(tmp_path / "cli")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "val loss at step 5" in result.stdout
    assert "greedy sample" in result.stdout
