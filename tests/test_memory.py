"""Model-state formula and the activation counter behind the Session A memory table."""

import pytest
import torch

from snippets.models.gpt import GPT, get_config
from snippets.planner.memory import measure_activation_bytes, model_state_bytes


def test_adamw_costs_16_bytes_per_parameter_in_fp32_and_mixed_precision():
    assert model_state_bytes(1000, "fp32")["total"] == 16_000
    assert model_state_bytes(1000, "mixed")["total"] == 16_000
    assert model_state_bytes(1000, "mixed")["weights"] == 2_000
    with pytest.raises(ValueError, match="precision='fp8'"):
        model_state_bytes(1000, "fp8")


def activations(batch, **overrides):
    config = get_config("tiny", **overrides)
    torch.manual_seed(0)
    model = GPT(config).train()
    tokens = torch.randint(0, config.vocab_size, (batch, config.max_position_embeddings + 1))
    return measure_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])


def test_activations_grow_linearly_with_batch():
    one, four = activations(1), activations(4)
    # Within 1%: a few saved tensors (the loss's scalars, kernel workspaces) do not scale.
    assert four / one == pytest.approx(4.0, rel=0.01)


def test_activation_checkpointing_keeps_only_block_inputs():
    full = activations(4)
    recomputed = activations(4, gradient_checkpointing=True)
    assert recomputed < 0.5 * full, (recomputed, full)
