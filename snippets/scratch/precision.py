"""Dynamic loss scaling from scratch: what torch.amp.GradScaler does for fp16 training.

fp16 has 5 exponent bits: values below ~6e-8 flush to zero and above 65504 overflow. Small
gradients (typical late in training) underflow to zero, so the loss is multiplied by a large
scale S before backward, which multiplies every gradient by S; the optimizer then divides them
by S again (in fp32). If S is too large some gradient overflows to inf: that step is skipped and
S halved. After `growth_interval` clean steps, S doubles, to stay as large as is safe.

bf16 keeps fp32's 8 exponent bits (range ~1e-38 to 3e38), so it needs no loss scaling.

FP8, simulated: the two 8-bit formats of FP8 training (e4m3 for weights and activations, e5m2 for
gradients), per-tensor scaling (multiply by a scale so the tensor's largest magnitude lands on
the format's largest value), delayed scaling, and a linear layer whose matmul sees only FP8
values. `scaled_mm_linear` computes the same with torch._scaled_mm, the real FP8 matmul (it runs
on H100-class GPUs, and in torch 2.13 also on the CPU, without the speed).
"""

import math

import torch
from torch import nn


# --8<-- [start:loss-scaler]
class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # consecutive steps without inf/nan since the last change

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient by the scale; return True if any is inf or nan."""
        found_inf = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)
                    found_inf |= not torch.isfinite(p.grad).all().item()
        return found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, step unless a gradient overflowed, and adapt the scale. Returns whether the
        optimizer stepped."""
        found_inf = self.unscale_(optimizer)
        if found_inf:
            # The gradients are garbage: skip the update, and back off so the next step fits.
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return False
        optimizer.step()
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor  # long enough without overflow: try a larger scale
            self.clean_steps = 0
        return True
# --8<-- [end:loss-scaler]


# --8<-- [start:formats]
def describe_formats() -> list[str]:
    """Range and resolution of the floating-point formats used in training."""
    lines = [f"{'dtype':<10} {'max':>10} {'smallest normal':>16} {'eps (1.0 -> next)':>18}"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        lines.append(f"{str(dtype).removeprefix('torch.'):<10} {info.max:>10.3g} "
                     f"{info.tiny:>16.3g} {info.eps:>18.3g}")
    return lines
# --8<-- [end:formats]


# --8<-- [start:format-table]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def mantissa_bits(dtype: torch.dtype) -> int:
    """Stored mantissa (fraction) bits: eps, the gap after 1.0, is 2**-mantissa_bits."""
    return round(-math.log2(torch.finfo(dtype).eps))


def format_table() -> list[str]:
    """Bits, range and resolution of every format, FP8 included, all read from torch.finfo.

    Rounding to nearest moves a normal number by at most half a step, and steps are eps times
    the power of two below the number: the relative round-off is at most eps / 2."""
    lines = [f"{'dtype':<14}{'s/e/m bits':>11}{'max':>10}{'min normal':>11}{'min subnormal':>14}"
             f"{'eps':>9}{'max rel. round-off':>19}"]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, E4M3, E5M2):
        info, m = torch.finfo(dtype), mantissa_bits(dtype)
        e = info.bits - 1 - m  # what is left after the sign and the mantissa
        lines.append(f"{str(dtype).removeprefix('torch.'):<14}{f'1/{e}/{m}':>11}"
                     f"{info.max:>10.4g}{info.smallest_normal:>11.3g}"
                     f"{info.smallest_normal * info.eps:>14.3g}{info.eps:>9.3g}"
                     f"{info.eps / 2:>19.3g}")
    return lines
# --8<-- [end:format-table]


# --8<-- [start:fp8-cast]
def fp8_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor scale: x * scale has its largest magnitude (amax) on the format's max, so
    the whole tensor uses the format's range, whatever its own range was."""
    amax = x.detach().abs().max().float()
    return torch.finfo(dtype).max / amax.clamp(min=1e-12)  # an all-zero tensor: any scale


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x * scale rounded to the nearest value of the FP8 format (what the hardware stores)."""
    return (x.float() * scale).to(dtype)


def dequantize_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_fp8.float() / scale


def fp8_round_trip(x: torch.Tensor, dtype: torch.dtype, scaled: bool = True) -> torch.Tensor:
    """x as it comes back from FP8: with a per-tensor scale, or cast as it is."""
    scale = fp8_scale(x, dtype) if scaled else torch.ones((), device=x.device)
    return dequantize_fp8(quantize_fp8(x, dtype, scale), scale)
# --8<-- [end:fp8-cast]


# --8<-- [start:quantization-error]
def quantization_error(x: torch.Tensor, dtype: torch.dtype, scaled: bool) -> dict:
    """How much of x survives the FP8 round trip: relative error, the fraction of values
    flushed to zero, and the fraction that overflowed: beyond the format's max and moved by
    more than rounding can explain (e4m3 clips them to 448, e5m2 makes them inf)."""
    info = torch.finfo(dtype)
    scale = fp8_scale(x, dtype) if scaled else torch.ones((), device=x.device)
    on_grid = x.float() * scale  # the values the cast sees
    cast = on_grid.to(dtype).float()
    u = info.eps / 2
    overflowed = (on_grid.abs() > info.max) & ~((cast - on_grid).abs() <= u * on_grid.abs())
    y = cast / scale
    return {
        "relative_error": ((y - x).norm() / x.norm()).item(),  # inf once anything is inf
        "flushed_to_zero": ((y == 0) & (x != 0)).float().mean().item(),
        "overflowed": overflowed.float().mean().item(),
    }
# --8<-- [end:quantization-error]


# --8<-- [start:delayed-scaling]
class DelayedScaling:
    """Scale from the amax of the last `history` steps instead of the current tensor.

    Finding a tensor's amax is a full pass over it, before the cast can start; a fused FP8
    kernel would rather cast as it computes. Transformer Engine therefore scales with the
    largest amax seen recently and records this step's amax for the next ones. Cheaper, but a
    sudden outlier larger than anything in the history overflows (e4m3: clips to 448)."""

    def __init__(self, dtype: torch.dtype = E4M3, history: int = 16):
        self.dtype, self.history, self.amaxes = dtype, history, []

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        amax = x.detach().abs().max().float()
        known = max(self.amaxes) if self.amaxes else amax  # first step: nothing to delay
        scale = torch.finfo(self.dtype).max / known.clamp(min=1e-12)
        self.amaxes = (self.amaxes + [amax])[-self.history:]
        return quantize_fp8(x, self.dtype, scale), scale
# --8<-- [end:delayed-scaling]


# --8<-- [start:fp8-linear]
class Fp8Matmul(torch.autograd.Function):
    """y = x @ w.T where the matmul sees only FP8 values, forward and backward.

    The recipe of FP8 training: inputs and weights in e4m3 (more precision), the gradient
    arriving from above in e5m2 (more range: gradients span more orders of magnitude), each
    tensor with its own scale. Products of FP8 values are exact in fp32 and accumulated in
    fp32, as FP8 tensor cores accumulate in higher precision; the scales are divided out after.
    """

    @staticmethod
    def forward(ctx, x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        sx, sw = fp8_scale(x2, E4M3), fp8_scale(weight, E4M3)
        xq, wq = quantize_fp8(x2, E4M3, sx), quantize_fp8(weight, E4M3, sw)
        ctx.save_for_backward(xq, wq, sx, sw)  # saved in FP8: a quarter of fp32's memory
        ctx.x_shape = x.shape
        y = (xq.float() @ wq.float().t()) / (sx * sw)
        return y.view(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xq, wq, sx, sw = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        sg = fp8_scale(g, E5M2)
        gq = quantize_fp8(g, E5M2, sg).float()
        grad_x = (gq @ wq.float()) / (sg * sw)  # (N, out) @ (out, in)
        grad_w = (gq.t() @ xq.float()) / (sg * sx)  # (out, N) @ (N, in)
        return grad_x.view(ctx.x_shape).to(grad_out.dtype), grad_w.to(grad_out.dtype)


class Fp8Linear(nn.Linear):
    """nn.Linear with its matmul in simulated FP8. The weight stays in fp32 (the master copy
    the optimizer updates); it is quantised afresh on every call."""

    def forward(self, x):
        y = Fp8Matmul.apply(x, self.weight)
        return y if self.bias is None else y + self.bias


def swap_linears_for_fp8(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace the model's nn.Linear layers by Fp8Linear sharing the same weights, in place.
    The output layer is skipped by default: FP8 recipes keep the first and last layers in
    higher precision, where errors reach the loss most directly."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and child_name not in skip and full not in skip:
                fp8 = Fp8Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                device=child.weight.device)
                fp8.weight = child.weight  # same Parameter: same optimizer state, same ties
                fp8.bias = child.bias
                setattr(module, child_name, fp8)
    return model
# --8<-- [end:fp8-linear]


# --8<-- [start:scaled-mm]
def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x (N, in) @ weight (out, in).T as a real FP8 matmul: torch._scaled_mm.

    It takes both operands in FP8 and the factors that undo their scales (1 / scale), and
    writes the result in out_dtype. On CUDA the second operand must be column-major: the
    transpose of a row-major (out, in) weight is exactly that, with no copy. Dimensions must
    be multiples of 16."""
    sx, sw = fp8_scale(x, E4M3), fp8_scale(weight, E4M3)
    xq, wq = quantize_fp8(x, E4M3, sx), quantize_fp8(weight, E4M3, sw)
    return torch._scaled_mm(xq, wq.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                            out_dtype=out_dtype)
# --8<-- [end:scaled-mm]


# --8<-- [start:overflow-demo]
def unscaled_cast_examples() -> list[str]:
    """What each FP8 format makes of values outside its range, cast with no scale."""
    values = [448.0, 500.0, 1e5, math.inf, math.nan, 1e-3, 1e-6]
    lines = [f"{'value':>8} " + " ".join(f"{v:>9.3g}" for v in values)]
    for name, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
        cast = torch.tensor(values).to(dtype).float().tolist()
        lines.append(f"{name:>8} " + " ".join(f"{v:>9.4g}" for v in cast))
    return lines
# --8<-- [end:overflow-demo]


if __name__ == "__main__":
    print("\n".join(describe_formats()))
    small_gradient = torch.tensor(1e-8)
    print(f"a gradient of 1e-8 in fp16: {small_gradient.half().item()} (underflows to zero)")
    print(f"scaled by 2**16 first:      {(small_gradient * 2**16).half().item():.3e} (survives)")
    print()
    print("\n".join(format_table()))
    print()
    print("\n".join(unscaled_cast_examples()))
