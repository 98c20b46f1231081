"""The debugging reproductions of docs/reference/debugging.md: each bug appears, each fix works."""

import math

import pytest
import torch

from snippets.debugging.mismatched_collectives import run_mismatch
from snippets.debugging.nan_loss import attention_overflow_demo, first_nan_step, train_fp16, train_sgd
from snippets.debugging.out_of_memory import checkpointing_cost, estimate
from snippets.debugging.slow_data import timed_training
from snippets.dist import spawn


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_attention_scores_overflow_fp16_and_the_fixes_do_not():
    probs = attention_overflow_demo()
    assert torch.isnan(probs["fp16"]).all()  # 32 * 32 * 64 = 65536 > 65504: inf - inf in softmax
    uniform = torch.full((4, 4), 0.25)  # equal scores everywhere: every key gets 1/4
    for name in ("fp16, q scaled first", "bf16", "fp32"):
        assert torch.equal(probs[name], uniform), name  # exact: equal inputs, equal outputs


def test_fixed_loss_scale_poisons_weights_and_dynamic_scaler_skips():
    fixed = train_fp16(steps=2, loss_scale=2.0**20, dynamic=False)
    assert not fixed[0]["grads_finite"] and not fixed[0]["weights_finite"]
    assert math.isnan(fixed[1]["loss"])  # NaN weights give a NaN loss from the next step on

    dynamic = train_fp16(steps=3, loss_scale=2.0**20, dynamic=True)
    assert all(r["weights_finite"] for r in dynamic)
    assert not dynamic[0]["stepped"] and dynamic[1]["scale"] == dynamic[0]["scale"] / 2
    assert any(r["stepped"] for r in dynamic), "the scaler never found a scale that fits"


def test_high_learning_rate_diverges_and_clipping_keeps_it_finite():
    assert first_nan_step(train_sgd(steps=12, lr=3.0)) is not None
    clipped = train_sgd(steps=12, lr=3.0, clip_norm=1.0)
    assert first_nan_step(clipped) is None
    assert max(r["loss"] for r in clipped) < 20  # bounded, not merely finite (ln 256 = 5.5 at start)


def test_checkpointing_and_micro_batch_shrink_activations_not_gradients():
    plain, checkpointed = estimate("small", 2, False), estimate("small", 2, True)
    assert plain["model_state"] == checkpointed["model_state"]
    assert checkpointed["activations"] < 0.2 * plain["activations"]
    # Activations scale with the micro-batch; 2 % allows for the few per-step constants.
    half = estimate("small", 1, False)
    assert abs(2 * half["activations"] / plain["activations"] - 1) < 0.02
    # Recomputation runs the same CPU kernels on the same inputs: bit-identical gradients.
    assert checkpointing_cost("tiny", 2, repeats=1)["max_grad_difference"] == 0.0


def test_mismatched_collectives_time_out_or_are_named():
    # Timeout 1 s: long enough for 2 processes on a loaded machine to start the collective,
    # short enough to keep the test quick. The spawn limit is generous; the check is the error.
    timed_out = spawn(run_mismatch, 2, False, 1.0, timeout_s=120)
    # The first rank to time out leaves, and the other may see its connection close first.
    assert any("Timed out" in (r["error"] or "") for r in timed_out), timed_out
    for r in timed_out:
        assert r["error"] and ("Timed out" in r["error"] or "Connection closed" in r["error"]), r
        assert 0.9 < r["seconds"] < 60, r
    detail = spawn(run_mismatch, 2, True, 1.0, timeout_s=120)
    for r in detail:
        assert r["error"].startswith("Detected mismatch between collectives"), r
        assert "ALLREDUCE" in r["error"] and "BROADCAST" in r["error"], r
        assert r["seconds"] < 0.9, r  # reported before the timeout, not by it


def test_loader_workers_change_the_timing_not_the_batches():
    serial = timed_training(num_workers=0, steps=2, delay_ms=1.0)
    parallel = timed_training(num_workers=2, steps=2, delay_ms=1.0)
    assert [r["first_tokens"] for r in serial] == [r["first_tokens"] for r in parallel]
    assert [r["loss"] for r in serial] == [r["loss"] for r in parallel]  # same data, same model
