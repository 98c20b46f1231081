"""Check of exercise 3: apply_rotary_pos_emb (snippets/models/gpt.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.checks._tensors import _close, _expect_tensor, _max_diff
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def check_apply_rotary_pos_emb(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    T, d = 6, 8
    q, k = torch.randn(2, 3, T, d), torch.randn(2, 3, T, d)
    cos, sin = ref.precompute_rope(d, T)
    result = learner.apply_rotary_pos_emb(q, k, cos, sin)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CheckFailed(f"apply_rotary_pos_emb returned {type(result).__name__}; it must "
                          "return the pair (rotated q, rotated k)")
    q_got, k_got = (_expect_tensor(t, "apply_rotary_pos_emb") for t in result)
    q_exp, k_exp = ref.apply_rotary_pos_emb(q, k, cos, sin)
    if q_got.shape != q.shape or k_got.shape != k.shape:
        raise CheckFailed(f"apply_rotary_pos_emb returned shapes {tuple(q_got.shape)} and "
                          f"{tuple(k_got.shape)}; q and k keep their shape {tuple(q.shape)}: "
                          "cos and sin (T, head_dim) broadcast over batch and heads")
    for name, got, exp, x in (("q", q_got, q_exp, q), ("k", k_got, k_exp, k)):
        if _close(got, exp):
            continue
        if _close(got, x):
            raise CheckFailed(f"your rotated {name} is {name} unchanged: rotate both q and k, "
                              f"{name} * cos + rotate_half({name}) * sin")
        if _close(got, x * cos - ref.rotate_half(x) * sin):
            raise CheckFailed(f"your {name} rotates the wrong way (- sin where + sin belongs): "
                              f"{name} * cos + rotate_half({name}) * sin; rotate_half already "
                              "carries the minus sign")
        if _close(got, (x * cos + x * sin)) or _close(got, x * sin + ref.rotate_half(x) * cos):
            raise CheckFailed(f"your {name} uses cos and sin with the wrong partners: "
                              f"{name} * cos + rotate_half({name}) * sin")
        if name == "q" and _close(got, k_exp):
            raise CheckFailed("you return (k, q) rotated: return them in the order (q, k)")
        raise CheckFailed(f"your rotated {name} differs from {name} * cos + rotate_half({name}) "
                          f"* sin by up to {_max_diff(got, exp):.3g}")
    passed = ["q and k rotated as x * cos + rotate_half(x) * sin"]

    # What RoPE is for: the score between a query at m and a key at n depends on m - n only.
    one_q, one_k = torch.randn(d), torch.randn(d)
    qs, ks = learner.apply_rotary_pos_emb(one_q.expand(T, d), one_k.expand(T, d), cos, sin)
    scores = qs @ ks.T
    if not torch.allclose(scores[3, 1], scores[5, 3], atol=1e-4):
        raise CheckFailed("the same query and key give different scores at positions (3, 1) and "
                          "(5, 3): after RoPE the score must depend on the distance only")
    passed.append("q·k depends only on the distance between positions (3-1 = 5-3)")
    return passed
