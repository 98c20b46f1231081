"""Check of exercise 6: GPT._init_weights (snippets/models/gpt.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn as nn

from snippets.exercises.checks._tensors import _fmt
from snippets.exercises.checks._tiny_gpt import _config
from snippets.exercises.runner import CheckFailed


def _weight_stats(w: torch.Tensor) -> tuple[float, float, float]:
    w = w.detach().float().flatten()
    std = w.std().item()
    beyond_two_std = (w.abs() > 2 * std).float().mean().item()
    return w.mean().item(), std, beyond_two_std


def check_init_weights(learner: ModuleType) -> list[str]:
    layers = 4
    # Untied, so the embedding's init is seen on its own: a tied lm_head (an nn.Linear) would
    # re-initialise the shared matrix and hide a missing nn.Embedding branch.
    config = _config(learner, vocab_size=256, hidden_size=64, intermediate_size=172,
                     num_hidden_layers=layers, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = learner.GPT(config)
    base = config.initializer_range
    residual = base / math.sqrt(2 * layers)
    passed = []

    def expect_std(name: str, w: torch.Tensor, std: float, why: str):
        mean, got, tails = _weight_stats(w)
        if not (0.9 * std < got < 1.1 * std):
            hint = why
            if abs(got - 1.0) < 0.1:
                hint = ("that is PyTorch's default N(0, 1) for nn.Embedding: initialise it with "
                        f"nn.init.normal_(module.weight, mean=0.0, std={base})")
            elif abs(got - 1 / math.sqrt(3 * w.shape[-1])) < 0.1 / math.sqrt(3 * w.shape[-1]):
                hint = ("that is PyTorch's default (Kaiming uniform) for nn.Linear: your "
                        "_init_weights did not initialise this Linear")
            elif abs(got - residual) < 0.1 * residual and std == base:
                hint = ("only the residual outputs (module.is_residual_output) get the smaller "
                        f"std; this one takes initializer_range = {base}")
            raise CheckFailed(f"{name} has std {got:.4f}, expected {std:.4f}: {hint}")
        if abs(mean) > 0.1 * std:
            raise CheckFailed(f"{name} has mean {mean:.4f}, expected 0: use mean=0.0")
        if tails < 0.02:
            raise CheckFailed(
                f"{name} has no values beyond 2 standard deviations ({tails:.1%}; a normal "
                "distribution has 4.6%): it looks uniform; draw from a normal distribution "
                "with nn.init.normal_")

    expect_std("embed_tokens.weight", model.embed_tokens.weight, base,
               f"nn.init.normal_(module.weight, mean=0.0, std=initializer_range={base})")
    passed.append(f"embedding ~ N(0, {base})")
    block = model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        expect_std(f"layers.0.{name}.weight", block.get_submodule(name).weight, base,
                   f"linears that do not end a residual branch use initializer_range = {base}")
    expect_std("lm_head.weight", model.lm_head.weight, base,
               f"the output projection is a plain nn.Linear: std initializer_range = {base}")
    passed.append(f"q, k, v, gate, up and lm_head projections ~ N(0, {base})")
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        expect_std(f"layers.0.{name}.weight", block.get_submodule(name).weight, residual,
                   f"{base}/sqrt(2*{layers}): linears marked is_residual_output add into the "
                   "residual stream, 2 per block; divide their std by "
                   "math.sqrt(2 * num_hidden_layers) so the stream's variance stays put")
    passed.append(f"o_proj and down_proj ~ N(0, {base}/sqrt(2 * {layers}) = {residual:.4f})")

    norm = learner.RMSNorm(8)
    biased = nn.Linear(8, 8, bias=True)
    with torch.no_grad():
        norm.weight.fill_(0.5)
        biased.bias.fill_(0.5)
    model._init_weights(norm)
    model._init_weights(biased)
    if not torch.equal(norm.weight, torch.ones(8)):
        raise CheckFailed("_init_weights(an RMSNorm whose weight is 0.5) left weight at "
                          f"{_fmt(norm.weight[:3])}...: set RMSNorm weights to 1 with "
                          "nn.init.ones_(module.weight), so the norm starts as a pure rescale")
    if not torch.equal(biased.bias, torch.zeros(8)):
        raise CheckFailed("_init_weights(nn.Linear(8, 8, bias=True)) left the bias at "
                          f"{_fmt(biased.bias[:3])}...: zero a Linear's bias when it has one "
                          "(if module.bias is not None: nn.init.zeros_(module.bias))")
    passed.append("RMSNorm weights set to 1, Linear biases to 0")
    return passed
