"""The single-process DistributedTrainer: parameter groups, lr schedule, gradient accumulation,
clipping, exact checkpoint resumption (also from a wrapped model), the CLI, and the exercise
markers the stub generator relies on."""

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snippets.dist import LaunchError
import torch

from snippets.models.gpt import get_config
from snippets.training.checkpoint import CheckpointError
from snippets.machine import DeviceError
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig, main, pick_trainer_device

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "snippets" / "training" / "ddp_trainer.py"
SEQ = 32  # short sequences keep every step here to a few milliseconds


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # CI runs on 2 cores shared with other jobs. Two OpenMP threads per process then spin
    # against the other jobs' threads and a step can take 10x longer; one thread is faster
    # there and changes nothing these tests check. Restored afterwards for other modules.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_trainer(model="tiny", cls=DistributedTrainer, **overrides) -> DistributedTrainer:
    settings = {"batch_size": 4, "seq_len": SEQ, "max_steps": 50, "warmup_steps": 5,
                "data": "dummy", **overrides}
    return cls(get_config(model), TrainConfig(**settings), "cpu")


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.raw_model.named_parameters()}


# ------------------------------------------------------------------ exercise 8: param groups


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_groups(tied):
    config = get_config("tiny", tie_word_embeddings=tied)
    trainer = DistributedTrainer(config, TrainConfig(seq_len=SEQ, data="dummy"), "cpu")
    model = trainer.raw_model
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decay_ids = [id(p) for p in decay["params"]]
    no_decay_ids = [id(p) for p in no_decay["params"]]

    # Every trainable parameter in exactly one group, none listed twice.
    all_ids = decay_ids + no_decay_ids
    assert len(all_ids) == len(set(all_ids))
    assert set(all_ids) == {id(p) for p in model.parameters()}
    # The tied matrix is one tensor under two names, and it is in the groups once.
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert all_ids.count(id(model.embed_tokens.weight)) == 1
    assert all_ids.count(id(model.lm_head.weight)) == 1

    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() >= 2:
            assert id(p) in decay_ids, name
        else:
            assert id(p) in no_decay_ids, name
            assert "norm" in name, name  # the model has no biases: only RMSNorm gains
    assert len(no_decay_ids) == 2 * config.num_hidden_layers + 1  # two norms per block + final
    # Matrices: 4 attention + 3 MLP per block, the embedding, and lm_head only if untied.
    assert len(decay_ids) == 7 * config.num_hidden_layers + 1 + (0 if tied else 1)

    sizes = [sum(p.numel() for p in g["params"]) for g in trainer.optimizer.param_groups]
    assert sum(sizes) == model.num_parameters()


# ------------------------------------------------------------------ exercise 9: lr schedule


def test_lr_schedule():
    lr, min_lr, warmup, max_steps = 1e-3, 1e-4, 10, 110
    trainer = make_trainer(lr=lr, min_lr=min_lr, warmup_steps=warmup, max_steps=max_steps)
    get_lr = trainer.get_lr

    assert get_lr(0) == pytest.approx(lr / warmup)        # step 0 already moves, a little
    assert get_lr(4) == pytest.approx(5 * lr / warmup)    # linear
    assert get_lr(warmup - 1) == pytest.approx(lr)        # warmup ends at the peak...
    assert get_lr(warmup) == pytest.approx(lr)            # ...where the cosine starts
    midpoint = warmup + (max_steps - warmup) // 2
    assert get_lr(midpoint) == pytest.approx((lr + min_lr) / 2, rel=1e-12)
    # cos(pi/4) at a quarter of the way: the exact cosine, not some other smooth decay.
    quarter = warmup + (max_steps - warmup) // 4
    assert get_lr(quarter) == pytest.approx(
        min_lr + 0.5 * (1 + math.cos(math.pi / 4)) * (lr - min_lr), rel=1e-12)
    assert get_lr(max_steps) == pytest.approx(min_lr)
    assert get_lr(max_steps + 1) == get_lr(10 * max_steps) == pytest.approx(min_lr)

    warm = [get_lr(s) for s in range(warmup)]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    decay = [get_lr(s) for s in range(warmup, max_steps + 1)]
    assert all(a > b for a, b in zip(decay, decay[1:]))   # strictly decreasing to min_lr

    assert TrainConfig(lr=3e-3).min_lr == pytest.approx(3e-4)  # default floor: lr / 10
    assert make_trainer(warmup_steps=0, lr=lr).get_lr(0) == pytest.approx(lr)


def test_session_a_schedule_is_the_same_curve(tmp_path):
    """Session A's script and the trainer take the schedule from the one lr_at in optim.py: the
    script as LambdaLR's factor (a peak of 1, a floor of 0.1), the trainer as get_lr with its
    default floor, lr / 10. Every step of a script run uses the trainer's learning rate."""
    from snippets.scripts.train_tiny_transformer import parse_args, train

    lr, warmup, steps = 1e-3, 3, 12
    records = train(parse_args([
        "--config", "tiny", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
        "--threads", "1", "--epochs", "1", "--steps-per-epoch", str(steps), "--lr", str(lr),
        "--warmup-steps", str(warmup), "--eval-every", "0", "--eval-batches", "1",
        "--ckpt-every", "0", "--sample-tokens", "0", "--out", str(tmp_path / "run")]))
    used = [r["lr"] for r in records if r["kind"] == "train"]
    trainer = make_trainer(lr=lr, warmup_steps=warmup, max_steps=steps)
    assert len(used) == steps
    for step, rate in enumerate(used):
        assert rate == pytest.approx(trainer.get_lr(step), rel=1e-12), step


def test_train_step_uses_the_schedule():
    trainer = make_trainer(lr=1e-3, warmup_steps=5)
    batches = trainer.micro_batches()
    for step in range(7):
        stats = trainer.train_step(batches)
        assert stats["lr"] == trainer.get_lr(step)
        assert all(g["lr"] == stats["lr"] for g in trainer.optimizer.param_groups)
    assert trainer.step == 7


# ------------------------------------------------------- exercise 10: gradient accumulation


def grads_at_step(trainer, monkeypatch) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees (after accumulation and clipping), kept as it steps."""
    seen, step = {}, trainer.optimizer.step

    def keep_then_step(*args, **kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.raw_model.named_parameters()})
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", keep_then_step)
    return seen


def test_gradient_accumulation_matches_one_big_batch(monkeypatch):
    batch = torch.randint(0, 256, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    lr = 1e-3
    big = make_trainer(batch_size=8, grad_accum_steps=1, warmup_steps=0, lr=lr)
    accum = make_trainer(batch_size=4, grad_accum_steps=2, warmup_steps=0, lr=lr)
    before = params(big)
    assert all(torch.equal(before[n], p) for n, p in params(accum).items())  # same seed
    g_big, g_accum = grads_at_step(big, monkeypatch), grads_at_step(accum, monkeypatch)

    stats_big = big.train_step(iter([batch]))
    stats_accum = accum.train_step(iter([batch[:4], batch[4:]]))

    # Mean of the two half-batch means = the mean over all 8 x SEQ tokens (equal token counts),
    # up to summation order: a sum of n = 8 * SEQ terms in float32 is within n * 2^-24 of its
    # size, on any CPU's kernels; twice that for the per-token losses, whose logits come from
    # batches of another size. A missing `/ accum` doubles the loss.
    n = 8 * SEQ
    assert stats_accum["loss"] == pytest.approx(stats_big["loss"],
                                                abs=2 * n * 2**-24 * stats_big["loss"])
    # The norm catches a missing `/ accum`: the summed gradient would be twice as large.
    # (The weights would not: Adam's first step is invariant to the gradient's scale.)
    assert stats_accum["grad_norm"] == pytest.approx(stats_big["grad_norm"], rel=1e-5)
    assert stats_accum["tokens"] == stats_big["tokens"] == 8 * SEQ

    # Not bit-identical: summing two half-batch gradients adds the same fp32 numbers in a
    # different order than one backward over 8 sequences. Adam's first step moves each weight
    # by lr * g / (|g| + eps) (its moments are g and g^2 after bias correction), so the weights
    # differ by lr times the change in that ratio, which is large only where |g| is near eps
    # (1e-8): there the last bits of g, which differ between CPUs' kernels, matter most. The
    # bound: that difference, plus float32 rounding of the update (lr * 2^-20) and of the
    # weight (2^-23 of it).
    eps = big.optimizer.param_groups[0]["eps"]
    after_big, after_accum = params(big), params(accum)
    for name in after_big:
        ratio_big = g_big[name] / (g_big[name].abs() + eps)
        ratio_accum = g_accum[name] / (g_accum[name].abs() + eps)
        bound = (lr * (ratio_big - ratio_accum).abs() + lr * 2**-20
                 + 2**-23 * after_big[name].abs())
        assert ((after_accum[name] - after_big[name]).abs() <= bound).all(), name
    moved = max((after_big[n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-4  # the step really changed the weights, so the comparison means something


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("grad_clip", [0.01, 0.0])
def test_grad_clip_caps_the_norm_the_optimizer_sees(grad_clip, monkeypatch):
    trainer = make_trainer(grad_clip=grad_clip)
    seen = []
    original_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads = [p.grad for g in trainer.optimizer.param_groups for p in g["params"]]
        seen.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads if g is not None])).item())
        return original_step(*args, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", recording_step)
    stats = trainer.train_step(trainer.micro_batches())
    assert stats["grad_norm"] > 0.5  # the pre-clip norm of an untrained model, reported
    if grad_clip:
        assert seen[0] == pytest.approx(grad_clip, rel=1e-3)  # scaled down to the cap
    else:
        assert seen[0] == pytest.approx(stats["grad_norm"], rel=1e-6)  # 0 = no clipping
    assert all(p.grad is None for p in trainer.raw_model.parameters())  # set_to_none


# ---------------------------------------------------------------- exercise 11: checkpoints


def test_checkpoint_round_trip_is_exact(tmp_path):
    # The built-in corpus and its sampler: the data position must survive the round trip.
    settings = {"data": "builtin", "max_steps": 15, "warmup_steps": 3}
    first = make_trainer(**settings)
    batches = first.micro_batches()
    for _ in range(10):
        first.train_step(batches)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    losses_a = [first.train_step(batches)["loss"] for _ in range(5)]

    second = make_trainer(**settings)
    second.load_checkpoint(tmp_path / "ckpt.pt")
    assert second.step == 10
    batches = second.micro_batches()
    losses_b = [second.train_step(batches)["loss"] for _ in range(5)]

    # Exact, not approx: on CPU the same ops on the same inputs with the same thread count run
    # the same instructions in the same order, and the checkpoint restored every input of a
    # step (weights, AdamW moments, lr position, sampler generator). Any missing piece of
    # state shows up as a difference.
    assert losses_b == losses_a
    assert all(torch.equal(p, params(first)[n]) for n, p in params(second).items())

    # A checkpoint holds only what torch.load(weights_only=True) accepts.
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert {"model", "optimizer", "step", "sampler", "rng", "model_config",
            "train_config"} <= set(state)
    assert state["train_config"]["max_steps"] == 15


class Wrapper(torch.nn.Module):
    """Stands in for DistributedDataParallel: holds the real model as `.module`."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class WrappedTrainer(DistributedTrainer):
    def _wrap_model(self, model):
        return Wrapper(model)


def test_checkpoint_from_a_wrapped_model_has_bare_keys(tmp_path):
    wrapped = make_trainer(cls=WrappedTrainer)
    assert isinstance(wrapped.model, Wrapper)
    assert all(k.startswith("module.") for k in wrapped.model.state_dict())  # the pitfall
    batches = wrapped.micro_batches()
    for _ in range(3):
        wrapped.train_step(batches)
    wrapped.save_checkpoint(tmp_path / "ckpt.pt")

    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    assert set(state["model"]) == set(wrapped.raw_model.state_dict())

    plain = make_trainer()  # loads into an unwrapped model...
    plain.load_checkpoint(tmp_path / "ckpt.pt")
    assert all(torch.equal(p, params(wrapped)[n]) for n, p in params(plain).items())
    rewrapped = make_trainer(cls=WrappedTrainer)  # ...and into a wrapped one
    rewrapped.load_checkpoint(tmp_path / "ckpt.pt")
    assert all(torch.equal(p, params(wrapped)[n]) for n, p in params(rewrapped).items())
    # Both continue identically from there.
    assert (plain.train_step(plain.micro_batches())["loss"]
            == rewrapped.train_step(rewrapped.micro_batches())["loss"])


def test_loading_a_different_model_is_a_clear_error(tmp_path):
    make_trainer("tiny").save_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="different model"):
        make_trainer("small").load_checkpoint(tmp_path / "ckpt.pt")


# --------------------------------------------------------------------- the DDP seams


def test_half_set_launch_environment_is_a_clear_error(monkeypatch):
    # WORLD_SIZE says "distributed" but nothing says where rank 0 is: name what is missing.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        make_trainer()


@pytest.mark.parametrize("world_size,expected", [(None, "mps"), ("1", "mps"), ("2", "cpu")])
def test_auto_device_avoids_mps_with_several_processes(monkeypatch, world_size, expected):
    # A Mac without CUDA, alone or under torchrun: gloo carries CPU and CUDA tensors only.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    device, note = pick_trainer_device("auto")
    assert device.type == expected
    assert (note is not None) == (expected == "cpu")
    if world_size == "2":
        with pytest.raises(DeviceError, match="--device mps works in one process only"):
            pick_trainer_device("mps")


def test_effective_batch_counts_accumulation_and_processes():
    trainer = make_trainer(batch_size=3, grad_accum_steps=5)
    assert (trainer.rank, trainer.world_size) == (0, 1)
    assert trainer.tokens_per_step == 3 * 5 * 1 * SEQ
    stats = trainer.train_step(trainer.micro_batches())
    assert stats["tokens"] == trainer.tokens_per_step


def test_dummy_data_loss_starts_near_a_uniform_guess():
    trainer = make_trainer(data="dummy")
    loss = trainer.train_step(trainer.micro_batches())["loss"]
    assert loss == pytest.approx(math.log(256), abs=0.1)


# ---------------------------------------------------------------------------- the CLI


def test_cli_trains_and_resumes(tmp_path):
    out = tmp_path / "run"
    # The learning guide's command, with a smaller micro-batch (4 x 64 tokens instead of
    # 8 x 128) so it takes seconds here; the guide's exact command also runs, just longer.
    result = subprocess.run(
        [sys.executable, str(SCRIPT.relative_to(REPO)), "--model_size", "small",
         "--max_steps", "50", "--batch_size", "4", "--seq_len", "64", "--device", "cpu",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # see one_thread above
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "= 256 tokens per optimizer step" in text  # 4 x 1 x 1 x 64, printed once
    assert re.search(r"step +10/50 \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.]+ \| "
                     r"[\d,]+ tokens/s", text), text
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first - 1.0, text  # from ~ln(256) = 5.5 to well below
    assert (out / "latest").read_text() == "ckpt-00000050.pt\n"
    assert torch.load(out / "ckpt-00000050.pt", weights_only=True)["step"] == 50

    # --resume continues from step 50; a longer --max_steps stretches the schedule (warned).
    args = ["--model_size", "small", "--batch_size", "4", "--seq_len", "64", "--device", "cpu",
            "--out", str(out), "--resume", "--max_steps", "52"]
    assert main(args) == 0
    assert torch.load(out / "ckpt-00000052.pt", weights_only=True)["step"] == 52
    assert (out / "latest").read_text() == "ckpt-00000052.pt\n"
    assert (out / "ckpt-00000050.pt").is_file()  # the earlier run's checkpoint stays
    assert main(args) == 0  # nothing left to do


TINY_RUN = ["--model_size", "tiny", "--max_steps", "2", "--batch_size", "2", "--seq_len", "16",
            "--device", "cpu", "--data", "dummy"]


def test_cli_never_writes_over_an_earlier_run(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(TINY_RUN + ["--out", out]) == 0
    before = (tmp_path / "run" / "ckpt-00000002.pt").read_bytes()
    capsys.readouterr()
    # Again without --resume (here with another model size): refused, in one line.
    assert main([*TINY_RUN[:1], "small", *TINY_RUN[2:], "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an earlier run left 1 checkpoint (step 2) in " in err
    assert "--resume" in err and "another --out" in err and "--overwrite" in err
    assert (tmp_path / "run" / "ckpt-00000002.pt").read_bytes() == before
    # --resume into another model size: refused, naming the fields that differ.
    assert main([*TINY_RUN[:1], "small", *TINY_RUN[2:], "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds a different model (checkpoint -> now: hidden_size 64 -> 128" in err, err
    assert (tmp_path / "run" / "ckpt-00000002.pt").read_bytes() == before
    # --overwrite replaces it, deleting only the checkpoints (a learner's notes stay).
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert main(TINY_RUN + ["--out", out, "--overwrite", "--seed", "7"]) == 0
    assert (tmp_path / "run" / "ckpt-00000002.pt").read_bytes() != before
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_cli_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    assert main(TINY_RUN + ["--out", str(out), "--ckpt_every", "1"]) == 0
    (out / "ckpt-00000002.pt").write_bytes(b"half a file")
    capsys.readouterr()
    assert main([*TINY_RUN[:2], "--max_steps", "3", *TINY_RUN[4:], "--out", str(out),
                 "--resume"]) == 0
    assert f"resumed from {out / 'ckpt-00000001.pt'} at step 1" in capsys.readouterr().out
    [warning] = caplog.messages  # one line: which file, what is wrong
    assert "\n" not in warning and str(out / "ckpt-00000002.pt") in warning
    assert "truncated" in warning and "falling back to the checkpoint before it" in warning
    assert torch.load(out / "ckpt-00000003.pt", weights_only=True)["step"] == 3


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["--model_size", "huge", "--out", str(tmp_path)]) == 2
    assert "unknown config 'huge'" in capsys.readouterr().err
    assert main(["--model_size", "tiny", "--resume", "--out", str(tmp_path / "none")]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert main(["--model_size", "tiny", "--seq_len", "1000", "--out", str(tmp_path)]) == 2
    assert "exceeds the model's max_position_embeddings" in capsys.readouterr().err


# -------------------------------------------------------------- sections and exercise stubs


SECTIONS = ["train-config", "dummy-data", "trainer-init", "wrap-model", "train-step",
            "checkpoint", "main", "training-loop"]
EXERCISES = ["exercise-10", "exercise-10-forward-backward", "exercise-10-clip",
             "exercise-11-save", "exercise-11-load"]


def test_sections_are_balanced_and_lines_short():
    text = SCRIPT.read_text()
    for name in SECTIONS + EXERCISES:
        assert text.count(f"# --8<-- [start:{name}]") == 1, name
        assert text.count(f"# --8<-- [end:{name}]") == 1, name
        assert text.index(f"[start:{name}]") < text.index(f"[end:{name}]"), name
    assert not [n for n, line in enumerate(text.splitlines(), 1) if len(line) > 100]


def test_exercise_sections_can_be_replaced_by_a_raise():
    # What the stub generator does: the start marker's indentation, a raise, nothing else.
    out, skipping = [], False
    for line in SCRIPT.read_text().splitlines():
        start = re.match(r"(\s*)# --8<-- \[start:(exercise-[\w-]+)\]", line)
        if start:
            out.append(f"{start.group(1)}raise NotImplementedError('{start.group(2)}')")
            skipping = True
        elif re.match(r"\s*# --8<-- \[end:exercise-[\w-]+\]", line):
            skipping = False
        elif not skipping:
            out.append(line)
    stub = "\n".join(out)
    tree = ast.parse(stub)
    assert stub.count("raise NotImplementedError('exercise-") == len(EXERCISES)
    # Each raise is the whole body (after the docstring) of the method it belongs to.
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for name in ["train_step", "forward_backward", "clip_gradients", "save_checkpoint",
                 "load_checkpoint"]:
        body = [s for s in methods[name].body
                if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(body) == 1 and isinstance(body[0], ast.Raise), name


@pytest.mark.parametrize("processes,gpus,expected", [("1", 1, "cuda"), ("2", 2, "cuda"),
                                                     ("2", 1, "cpu"), ("4", 2, "cpu")])
def test_fewer_gpus_than_processes_falls_back_to_the_cpu(monkeypatch, processes, gpus, expected):
    """NCCL runs one process per GPU: two processes on a one-GPU machine gave rank 1 cuda:1
    ("invalid device ordinal", seen on an H100 machine running the CPU pages). With fewer GPUs
    than processes, 'auto' and the default backend take the CPU and gloo; 'cuda' is refused."""
    from snippets.dist import default_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", processes)
    monkeypatch.setenv("WORLD_SIZE", processes)
    device, note = pick_trainer_device("auto")
    assert device.type == expected
    assert default_backend() == ("nccl" if expected == "cuda" else "gloo")
    if expected == "cpu":
        assert note == (f"note: --device auto chose cpu: {processes} processes but {gpus} GPU(s), "
                        "and NCCL needs one GPU per process")
        with pytest.raises(DeviceError, match=f"--device cuda: {processes} processes on this "
                                              f"machine but {gpus} GPU"):
            pick_trainer_device("cuda")
    else:
        assert note is None and pick_trainer_device("cuda")[0].type == "cuda"
