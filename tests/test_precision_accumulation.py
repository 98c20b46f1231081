"""The deterministic claims of the Session B slides: accumulated gradients equal one large
batch's, the effective-batch formula, what autocast runs in which dtype, what loss scaling fixes,
and that fused AdamW computes what the for-loop AdamW does."""

import pytest
import torch

from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.ddp_trainer import DistributedTrainer, TrainConfig
from snippets.scripts.precision_and_accumulation import (
    ACCUMULATION_TOLERANCE,
    accumulated_gradients,
    accumulation_report,
    effective_batch,
    effective_batch_table,
    forward_backward,
    gradient_errors,
    median_seconds,
    optimizers_agree,
    train_fp16_with_scaler,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny_model_and_batch(batch_size=8, seed=0):
    config = get_config("tiny")
    torch.manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.max_position_embeddings + 1))
    return GPT(config), tokens


def test_accumulated_gradients_equal_one_large_batch():
    model, batch = tiny_model_and_batch(8)
    whole = accumulated_gradients(model, batch, 1)
    for micro_batches in (2, 4, 8):
        pieces = accumulated_gradients(model, batch, micro_batches)
        largest = max(g.abs().max().item() for g in whole)
        difference = max((a - b).abs().max().item() for a, b in zip(whole, pieces))
        # Same sums in a different order: a few fp32 roundings of the largest value, no more.
        assert difference <= ACCUMULATION_TOLERANCE * largest, (micro_batches, difference)


def test_accumulation_refuses_unequal_slices():
    model, batch = tiny_model_and_batch(6)
    with pytest.raises(ValueError, match="equal slices"):
        accumulated_gradients(model, batch, 4)


def test_accumulation_report_quarter_memory_same_gradients():
    report = accumulation_report()
    memory = report["activation_bytes"]
    # Activations scale with the micro-batch: within 1%, a few saved scalars do not scale.
    assert memory[1] / memory[4] == pytest.approx(4.0, rel=0.01)
    assert report["max_abs_difference"] <= ACCUMULATION_TOLERANCE * report["largest_gradient"]


def test_effective_batch_formula_matches_the_trainer():
    assert effective_batch(8, 4, 2, 128) == {"sequences": 64, "tokens": 8192}
    trainer = DistributedTrainer(get_config("tiny"),
                                 TrainConfig(batch_size=2, grad_accum_steps=4, max_steps=1))
    assert trainer.tokens_per_step == effective_batch(2, 4, 1, 64)["tokens"] == 512


def test_effective_batch_table_same_batch_memory_follows_micro_batch():
    rows = effective_batch_table("tiny", layouts=((8, 1, 1), (2, 4, 1), (2, 1, 4)))
    assert {r["sequences"] for r in rows} == {8}
    assert rows[0]["activation_bytes"] / rows[1]["activation_bytes"] == pytest.approx(4, rel=0.01)
    assert rows[1]["activation_bytes"] == rows[2]["activation_bytes"]  # same micro-batch


def test_autocast_runs_matmuls_in_bf16_and_keeps_weights_and_loss_in_fp32():
    model, batch = tiny_model_and_batch(2)
    inputs, targets = shift_for_next_token(batch)
    seen = {}
    linear = model.layers[0].mlp.gate_proj
    linear.register_forward_hook(lambda module, args, out: seen.update(out=out.dtype))
    loss = forward_backward(model, inputs, targets, torch.bfloat16)
    assert seen["out"] == torch.bfloat16  # the matmul ran in bf16
    assert loss.dtype == torch.float32  # cross-entropy is on autocast's fp32 list
    assert linear.weight.dtype == torch.float32  # autocast casts copies, not the weights
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    forward_backward(model, inputs, targets)  # without a dtype: plain fp32
    assert seen["out"] == torch.float32


def test_loss_scaling_rescues_fp16_underflow_and_too_large_a_scale_overflows():
    rows = {(r["dtype"], r["scale"]): r for r in gradient_errors()}
    unscaled, scaled, too_large = (rows["fp16", s] for s in (1.0, 2.0**16, 2.0**24))
    assert unscaled["flushed_to_zero"] > 0 and unscaled["not_finite"] == 0
    assert scaled["flushed_to_zero"] == 0 and scaled["not_finite"] == 0
    assert scaled["relative_error"] < unscaled["relative_error"]
    assert too_large["not_finite"] > 0
    bf16 = rows["bf16", 1.0]  # fp32's exponent range: nothing underflows, no scale needed
    assert bf16["flushed_to_zero"] == 0 and bf16["not_finite"] == 0


def test_dynamic_loss_scaler_backs_off_until_fp16_gradients_fit():
    log = train_fp16_with_scaler(steps=6, init_scale=2.0**20)
    assert not log[0]["stepped"]  # gradients x 2^20 overflow fp16's 65504
    assert log[1]["scale"] == log[0]["scale"] / 2  # skipped, and the scale halved
    first = next(i for i, r in enumerate(log) if r["stepped"])
    assert first < len(log) - 1, [(r["scale"], r["stepped"]) for r in log]
    assert log[first + 1]["loss"] < log[first]["loss"]  # once the scale fits, it trains


def test_fused_adamw_matches_the_for_loop():
    # Same formula, different order of floating-point operations: ~1e-8 on weights of ~0.02.
    assert optimizers_agree("tiny") < 1e-6


def test_median_seconds_times_every_candidate():
    calls = []
    result = median_seconds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                            repeats=3, warmup=1)
    assert set(result) == {"a", "b"}
    assert calls == ["a", "b"] * 4  # interleaved, warm-up round included


def test_median_seconds_stops_once_over_budget():
    ticks = iter(range(1000))  # a fake clock: every call takes one second
    calls = []
    result = median_seconds({"slow": lambda: calls.append(1)}, repeats=15, warmup=1,
                            clock=lambda: next(ticks), budget_s=2.5)
    assert len(calls) == 3 and result == {"slow": 1}  # warm-up + 2 measured (3 s > 2.5), not 15
    ticks = iter(range(1000))
    calls.clear()
    result = median_seconds({"slow": lambda: calls.append(1)}, repeats=15, warmup=1,
                            clock=lambda: next(ticks), budget_s=0.5)
    assert len(calls) == 1 and result == {"slow": 1}  # the warm-up alone is over budget: it is the measurement
    ticks = iter(range(1000))
    calls.clear()
    median_seconds({"fast": lambda: calls.append(1)}, repeats=15, warmup=1,
                   clock=lambda: next(ticks) * 1e-3, budget_s=2.5)
    assert len(calls) == 16  # within budget: every round runs
