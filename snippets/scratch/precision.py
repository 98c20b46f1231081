"""Dynamic loss scaling from scratch: what torch.amp.GradScaler does for fp16 training.

fp16 has 5 exponent bits: values below ~6e-8 flush to zero and above 65504 overflow. Small
gradients (typical late in training) underflow to zero, so the loss is multiplied by a large
scale S before backward, which multiplies every gradient by S; the optimizer then divides them
by S again (in fp32). If S is too large some gradient overflows to inf: that step is skipped and
S halved. After `growth_interval` clean steps, S doubles, to stay as large as is safe.

bf16 keeps fp32's 8 exponent bits (range ~1e-38 to 3e38), so it needs no loss scaling.
"""

import torch


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


if __name__ == "__main__":
    print("\n".join(describe_formats()))
    small_gradient = torch.tensor(1e-8)
    print(f"a gradient of 1e-8 in fp16: {small_gradient.half().item()} (underflows to zero)")
    print(f"scaled by 2**16 first:      {(small_gradient * 2**16).half().item():.3e} (survives)")
