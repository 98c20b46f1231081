"""Simulated FP8: round-trip error bounds derived from the mantissa bits, per-tensor scaling
against overflow and underflow, and the FP8 linear layer's error on the tiny GPT's matmuls."""

import math

import pytest
import torch

from snippets.models.gpt import GPT, get_config
from snippets.scratch.precision import (E4M3, E5M2, DelayedScaling, Fp8Matmul, dequantize_fp8,
                                        fp8_round_trip, fp8_scale, mantissa_bits,
                                        quantization_error, scaled_mm_linear)
from snippets.scripts.low_precision import linear_inputs

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# --8<-- [start:round-trip]
@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_bounded_by_the_mantissa_bits(name):
    dtype = FORMATS[name]
    info, m = torch.finfo(dtype), mantissa_bits(dtype)
    assert (m, info.eps) == ({"e4m3": 3, "e5m2": 2}[name], 2.0**-m)
    # In [2^e, 2^(e+1)) the representable numbers are 2^e * eps apart. Rounding to nearest
    # moves x by at most half of that, u * 2^e with u = 2^-(m+1), and x >= 2^e, so the
    # relative error is at most u. The worst case is x = 2^e * (1 + u), halfway between the
    # first two numbers of a binade: error u * 2^e, relative u / (1 + u).
    u = 2.0**-(m + 1)
    worst = u / (1 + u)
    g = torch.Generator().manual_seed(0)
    exponent = torch.empty(200_000).uniform_(math.log2(info.smallest_normal),
                                             math.log2(info.max), generator=g)
    x = 2.0**exponent * torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    relative = ((x.to(dtype).float() - x).abs() / x.abs()).max().item()
    assert 0.99 * worst <= relative <= worst  # the bound holds, and is reached
    # Below the smallest normal number the steps stop shrinking: they are all
    # smallest_normal * eps wide (subnormals), so the bound becomes absolute, half a step.
    step = info.smallest_normal * info.eps
    tiny = torch.empty(10_000).uniform_(-info.smallest_normal, info.smallest_normal, generator=g)
    assert (tiny.to(dtype).float() - tiny).abs().max().item() <= step / 2
# --8<-- [end:round-trip]


# --8<-- [start:scaling]
def test_per_tensor_scaling_prevents_overflow_and_underflow():
    g = torch.Generator().manual_seed(0)
    activations = torch.randn(4096, generator=g) * 300  # amax ~ 1200: beyond e4m3's 448
    activations[0] = 1e5  # an outlier beyond e5m2's 57344 too
    gradients = torch.randn(4096, generator=g) * 1e-7  # below both formats' subnormals
    # Unscaled, e4m3 clips everything above 448 to 448 (it has no inf), e5m2 overflows to inf,
    # and tiny gradients flush to zero in both.
    assert quantization_error(activations, E4M3, scaled=False)["overflowed"] > 0.1
    assert quantization_error(activations, E5M2, scaled=False)["relative_error"] == math.inf
    for dtype in (E4M3, E5M2):
        assert quantization_error(gradients, dtype, scaled=False)["flushed_to_zero"] == 1.0
    # Scaled, nothing overflows and the error is what the mantissa allows: the round-trip
    # bound u for each value, so at most u for the whole tensor's norm, except for the few
    # values the scale pushes below the smallest normal number (at most half a subnormal step).
    for dtype in (E4M3, E5M2):
        u = 2.0**-(mantissa_bits(dtype) + 1)
        for x in (activations, gradients):
            r = quantization_error(x, dtype, scaled=True)
            assert r["overflowed"] == 0 and r["relative_error"] <= u
            assert r["flushed_to_zero"] < 0.01
# --8<-- [end:scaling]


def test_delayed_scaling_clips_an_outlier_the_history_has_not_seen():
    scaler, g = DelayedScaling(E4M3, history=4), torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(1000, generator=g)
        q, scale = scaler.quantize(x)
        assert (dequantize_fp8(q, scale) - x).norm() <= 2**-4 * x.norm()  # within the bound
    spike = torch.randn(1000, generator=g)
    spike[0] = 100 * spike.abs().max()  # 100x larger than anything in the history
    q, scale = scaler.quantize(spike)
    assert dequantize_fp8(q, scale)[0].item() < spike[0].item() / 10  # clipped to 448 / scale
    assert (fp8_round_trip(spike, E4M3) - spike)[0].abs() <= 2**-4 * spike[0]  # current: fine


# --8<-- [start:fp8-linear]
def rounding_error_bound(x: torch.Tensor, dtype) -> torch.Tensor:
    """Per element, how far the scaled FP8 round trip may move x: relative u for normal
    numbers, half a subnormal step (in x's units, so divided by the scale) below them."""
    info, scale = torch.finfo(dtype), fp8_scale(x, dtype)
    u = 2.0**-(mantissa_bits(dtype) + 1)
    return torch.maximum(u * x.abs(), info.smallest_normal * info.eps / 2 / scale)


def matmul_error_bound(a, b, dtype_a, dtype_b):
    """|a'b' - ab| <= |a' - a||b'| + |a||b' - b| summed over k, for a' b' the FP8 round trips;
    plus fp32's own rounding of the sums (1e-5 of the sum of |products|: K * 2^-24 for K=172)."""
    b_fp8 = fp8_round_trip(b, dtype_b)
    return (rounding_error_bound(a, dtype_a) @ b_fp8.abs()
            + a.abs() @ rounding_error_bound(b, dtype_b) + 1e-5 * (a.abs() @ b.abs()))


def test_fp8_linear_error_on_the_tiny_gpt_is_within_its_bound():
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    inputs = torch.randint(0, 256, (2, 16))
    for name, x in linear_inputs(model, inputs).items():
        weight = model.get_submodule(name).weight.detach()
        x2 = x.reshape(-1, x.shape[-1]).clone().requires_grad_()
        y = Fp8Matmul.apply(x2, weight)  # forward: x and weight in e4m3
        exact = x2.detach() @ weight.t()
        assert ((y - exact).abs() <= matmul_error_bound(x2.detach(), weight.t(), E4M3, E4M3)).all()
        # Typical error: a few percent of the output (each factor off by up to 6.25%, signs
        # random, so errors partly cancel). Not zero: the quantisation really happened.
        relative = ((y - exact).norm() / exact.norm()).item()
        assert 0.005 < relative < 0.0625, (name, relative)
        # Backward: the gradient from above in e5m2, the weight in e4m3.
        grad_out = torch.randn_like(y)
        y.backward(grad_out)
        exact_grad = grad_out @ weight
        bound = matmul_error_bound(grad_out, weight, E5M2, E4M3)
        assert ((x2.grad - exact_grad).abs() <= bound).all(), name
        # The real FP8 matmul (torch._scaled_mm, here on the CPU) computes the same numbers.
        real = scaled_mm_linear(x2.detach(), weight, out_dtype=torch.float32)
        torch.testing.assert_close(real, y.detach(), rtol=1e-5, atol=1e-6)
# --8<-- [end:fp8-linear]
