"""Comparing and showing tensors in the checks of the model and the trainers: the tolerance, the
largest difference, a few values printed, and a value that is not a tensor named.
"""

from __future__ import annotations

import torch

from snippets.exercises.runner import CheckFailed


def _fmt(t: torch.Tensor) -> str:
    values = t.tolist()
    if t.is_floating_point():
        values = [round(v, 4) for v in values]
    return "[" + ", ".join(str(v) for v in values) + "]"


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _expect_tensor(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{what} returned {type(value).__name__}, expected a torch.Tensor: "
                          "did you forget the return statement?")
    return value
