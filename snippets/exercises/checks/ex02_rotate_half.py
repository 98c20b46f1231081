"""Check of exercise 2: rotate_half (snippets/models/gpt.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.checks._tensors import _expect_tensor, _fmt
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def check_rotate_half(learner: ModuleType) -> list[str]:
    x = torch.tensor([1, 2, 3, 4])
    got = _expect_tensor(learner.rotate_half(x), "rotate_half")
    expected = torch.tensor([-3, -4, 1, 2])
    if got.shape != expected.shape or not torch.equal(got, expected):
        why = {
            (3, 4, 1, 2): "you swapped the halves but forgot the sign: the first half of the "
                          "output must be the NEGATED second half of the input",
            (3, 4, -1, -2): "the first half of the output must be the NEGATED second half of "
                            "the input; you negated the first half instead",
            (-2, 1, -4, 3): "you rotated neighbouring pairs (x0, x1), (x2, x3), as in GPT-J; "
                            "this model pairs dimension i with i + d/2: split the last dimension "
                            "into two halves with x.chunk(2, dim=-1)",
            (1, 2, 3, 4): "the output is the input: split it into halves x1, x2 and return "
                          "cat((-x2, x1))",
        }.get(tuple(got.flatten().tolist()), "the first half of the output must be the NEGATED "
                                             "second half of the input, the second half the first")
        raise CheckFailed(f"rotate_half([1, 2, 3, 4]) returned {_fmt(got)}; expected "
                          f"[-3, -4, 1, 2]: {why}")
    passed = ["rotate_half([1, 2, 3, 4]) = [-3, -4, 1, 2]"]

    torch.manual_seed(0)
    q = torch.randn(2, 3, 5, 8)  # (batch, heads, T, head_dim)
    got = _expect_tensor(learner.rotate_half(q), "rotate_half")
    if got.shape != q.shape or not torch.equal(got, ref.rotate_half(q)):
        what = ("the wrong values" if got.shape == q.shape
                else f"shape {tuple(got.shape)}")
        raise CheckFailed(
            f"on a (batch, heads, T, head_dim) = {tuple(q.shape)} tensor your rotate_half "
            f"returned {what}: split and concatenate along the LAST dimension (dim=-1), "
            "whatever the number of dimensions in front of it")
    passed.append("rotates the last dimension of a (batch, heads, T, head_dim) tensor")
    return passed
