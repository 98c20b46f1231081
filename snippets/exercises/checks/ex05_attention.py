"""Check of exercise 5: CausalSelfAttention.forward (eager branch) (snippets/models/gpt.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn as nn

from snippets.exercises.checks._tensors import _close, _expect_tensor, _max_diff
from snippets.exercises.checks._tiny_gpt import _config
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def _attention_variant(attn: nn.Module, x: torch.Tensor, *, scale=True, mask="-inf",
                       softmax_dim=-1) -> torch.Tensor:
    """The solution's attention with one thing changed: the learner's likely mistakes."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    q, k = ref.apply_rotary_pos_emb(q, k, attn.rope_cos[:T], attn.rope_sin[:T])
    scores = q @ k.transpose(-2, -1)
    if scale:
        scores = scores / math.sqrt(attn.head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if mask == "-inf":
        scores = scores.masked_fill(~causal, float("-inf"))
    elif mask == "zero":
        scores = scores.masked_fill(~causal, 0.0)
    probs = torch.softmax(scores, dim=softmax_dim)
    if mask == "after":
        probs = probs * causal
    y = (probs @ v).transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(y)


def check_attention(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.CausalSelfAttention(_config(ref, attn_implementation="eager"))
    # eager: the branch the learner writes; "sdpa" would run PyTorch's fused kernel instead.
    attn = learner.CausalSelfAttention(_config(learner, attn_implementation="eager"))
    attn.load_state_dict(solution.state_dict())
    T = 8  # shorter than max_position_embeddings: the mask must be built for T, not the maximum
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        got = _expect_tensor(attn(x), "CausalSelfAttention.forward")
    if got.shape != x.shape:
        raise CheckFailed(f"your attention maps {tuple(x.shape)} to {tuple(got.shape)}: y = probs "
                          "@ v must be (batch, heads, T, head_dim) before the heads are joined")
    if torch.isnan(got).any():
        raise CheckFailed("your attention output contains nan: a row of scores that is all -inf "
                          "has no softmax; mask only positions AFTER the query (tril keeps the "
                          "diagonal, so every query sees at least itself)")
    passed = []

    changed = x.clone()
    changed[:, 5] = torch.randn(2, 32)
    with torch.no_grad():
        got_changed = attn(changed)
    leaks = [t for t in range(5) if not torch.allclose(got[:, t], got_changed[:, t], atol=1e-6)]
    if leaks:
        why = "apply the causal mask before softmax: scores of keys after the query set to -inf"
        with torch.no_grad():
            if _close(got, _attention_variant(solution, x, mask="zero")):
                why = ("you set future scores to 0, but exp(0) = 1 still gives them weight; "
                       "masked_fill them with float('-inf'), so that exp(-inf) = 0")
            elif _close(got, _attention_variant(solution, x, mask="after")):
                why = ("you masked after the softmax: its denominator still sums over the future "
                       "keys, and the weights left no longer sum to 1; set the future scores to "
                       "-inf BEFORE the softmax, which then renormalises over the past")
            elif _close(got, _attention_variant(solution, x, mask="-inf", softmax_dim=-2)):
                why = ("your softmax normalises over the queries (dim=-2); each query's row of "
                       "scores over the keys must sum to 1: softmax(scores, dim=-1)")
        raise CheckFailed(f"your attention leaks the future: changing token 5 changed the output "
                          f"at position {leaks[0]}: {why}")
    passed.append("causal: changing token 5 leaves positions 0-4 unchanged")

    with torch.no_grad():
        expected = solution(x)
        mistakes = [
            (_attention_variant(solution, x, scale=False),
             "you did not scale the scores: divide q @ k^T by math.sqrt(self.head_dim), or the "
             "softmax saturates as head_dim grows"),
        ]
    if not _close(got, expected):
        for wrong, why in mistakes:
            if _close(got, wrong):
                raise CheckFailed(f"your attention is causal but computes the wrong weights: {why}")
        raise CheckFailed(f"your attention differs from softmax(q @ k^T / sqrt(head_dim), "
                          f"future masked to -inf) @ v by up to {_max_diff(got, expected):.3g}")
    passed.append("matches softmax(q k^T / sqrt(head_dim) + causal mask) v")
    with torch.no_grad():
        fused = ref.CausalSelfAttention(_config(ref))
        fused.load_state_dict(solution.state_dict())
        sdpa = fused(x)
    if not _close(got, sdpa, tol=1e-4):
        raise CheckFailed(f"your attention differs from PyTorch's fused kernel by up to "
                          f"{_max_diff(got, sdpa):.3g}")
    passed.append("agrees with PyTorch's fused F.scaled_dot_product_attention(is_causal=True)")
    return passed
