"""Check of exercise 1: RMSNorm.forward (snippets/models/gpt.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from snippets.exercises.checks._tensors import _close, _expect_tensor, _max_diff
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def check_rmsnorm(learner: ModuleType) -> list[str]:
    passed = []
    torch.manual_seed(0)
    norm = learner.RMSNorm(16, eps=1e-5)
    x = 3.0 * torch.randn(2, 5, 16) + 0.5
    with torch.no_grad():
        out = _expect_tensor(norm(x), "RMSNorm.forward")
    if out.shape != x.shape:
        raise CheckFailed(
            f"for an input of shape {tuple(x.shape)} your RMSNorm returned shape "
            f"{tuple(out.shape)}; it must keep the shape: take the mean over the last dimension "
            "with keepdim=True, so the (…, 1) result broadcasts over each vector")
    rms = out.float().pow(2).mean(-1).sqrt()
    if not torch.allclose(rms, torch.ones_like(rms), atol=1e-3):
        raise CheckFailed(
            f"your RMSNorm output has RMS {rms.mean().item():.3g} per row, expected 1.0 with "
            "weight=1: did you divide by the root mean square (multiply by torch.rsqrt of the "
            "mean of squares + eps, over the last dimension)?")
    expected = ref.RMSNorm(16, eps=1e-5)(x)
    if not _close(out, expected):
        centred = x - x.mean(-1, keepdim=True)
        if _close(out, centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)):
            raise CheckFailed("your RMSNorm subtracts the mean first: that is LayerNorm. "
                              "RMSNorm only divides by the root mean square, it does not centre")
        raise CheckFailed(f"your RMSNorm differs from x * rsqrt(mean(x**2) + eps) * weight by up "
                          f"to {_max_diff(out, expected):.3g}")
    passed.append("every row of the output has RMS 1.0 with weight = 1")

    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
        out = norm(x)
        expected_w = expected * norm.weight
    if not _close(out, expected_w):
        if _close(out, expected):
            raise CheckFailed("your RMSNorm ignores self.weight: multiply the normalised vector "
                              "by the learned per-channel gain self.weight")
        raise CheckFailed(f"with weight = linspace(0.5, 2, 16) your RMSNorm differs from "
                          f"x * rsqrt(mean(x**2) + eps) * weight by up to "
                          f"{_max_diff(out, expected_w):.3g}")
    passed.append("multiplies by the learned gain self.weight")

    fresh = learner.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        zeros = fresh(torch.zeros(1, 16))
        small = fresh(torch.full((1, 16), 1e-3))
    if not torch.isfinite(zeros).all():
        raise CheckFailed("for an all-zero vector your RMSNorm returns nan or inf: add self.eps "
                          "to the mean of squares inside the rsqrt, so it never divides by 0")
    expected_small = 1e-3 / math.sqrt(1e-6 + 1e-5)
    if abs(small[0, 0].item() - expected_small) > 1e-3:
        raise CheckFailed(
            f"for a vector of 1e-3s your RMSNorm returns {small[0, 0].item():.4g}, expected "
            f"{expected_small:.4g} = 1e-3 / sqrt(1e-6 + eps): add self.eps to the mean of "
            "squares, inside the square root (not outside it, and not to x)")
    passed.append("an all-zero vector stays finite: eps is inside the square root")

    with torch.no_grad():
        half = fresh(torch.full((1, 16), 300.0, dtype=torch.float16))
        bf16 = fresh(x.bfloat16())
    if half.dtype != torch.float16 or bf16.dtype != torch.bfloat16:
        got = half.dtype if half.dtype != torch.float16 else bf16.dtype
        raise CheckFailed(
            f"for a {'float16' if half.dtype != torch.float16 else 'bfloat16'} input your "
            f"RMSNorm returns {str(got).removeprefix('torch.')}: compute in float32 and cast "
            "back with out.to(x.dtype), so "
            "the activations keep the precision they came in with")
    if not torch.isfinite(half).all() or abs(half[0, 0].item() - 1.0) > 1e-2:
        raise CheckFailed(
            f"for a float16 vector of 300s your RMSNorm returns {half[0, 0].item()}, expected "
            "1.0: 300**2 = 90000 overflows float16 (largest value 65504); compute the mean of "
            "squares in float32 (xf = x.float()) and cast the result back")
    passed.append("float16/bfloat16 inputs: computed in float32, returned in the input's dtype")
    return passed
