"""Three ways to get a NaN loss, each reproduced on the CPU, each with its fix.

    python -m snippets.debugging.nan_loss          # about 5 s of CPU time

1. Attention scores overflow in fp16: a dot product above 65504 becomes inf, and softmax of a
   row of infs is NaN. Fixes: scale q before the matmul, or use bf16.
2. fp16 gradients overflow under a fixed loss scale: one inf gradient reaches AdamW and every
   weight it touches becomes NaN. Fix: a dynamic loss scaler that skips that step.
3. A learning rate too high for plain SGD: the loss grows step by step, then inf, then NaN.
   Gradient clipping bounds each step and keeps it finite; a lower learning rate is the fix.
"""

from __future__ import annotations

import math

import torch

from snippets.models.gpt import shift_for_next_token
from snippets.scratch.precision import DynamicLossScaler
from snippets.scripts.precision_and_accumulation import model_and_batch
from snippets.machine import set_threads


# --8<-- [start:attention-overflow]
def attention_scores(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype,
                     scale_first: bool = False) -> torch.Tensor:
    """Softmax of q @ k^T / sqrt(head_dim), computed in `dtype`. With scale_first, q is
    divided by sqrt(head_dim) *before* the matmul, so the sum of products never gets large."""
    head_dim = q.shape[-1]
    q, k = q.to(dtype), k.to(dtype)
    if scale_first:
        scores = (q / math.sqrt(head_dim)) @ k.transpose(-2, -1)
    else:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)  # q @ k^T may already be inf
    return torch.softmax(scores.float(), dim=-1)


def attention_overflow_demo(value: float = 32.0, head_dim: int = 64) -> dict:
    """Queries and keys whose entries are all `value`: q . k = value^2 * head_dim, which for
    32 and 64 is 65536, just above fp16's largest number, 65504."""
    q = torch.full((4, head_dim), value)
    k = torch.full((4, head_dim), value)
    runs = {"fp16": (torch.float16, False), "fp16, q scaled first": (torch.float16, True),
            "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False)}
    return {name: attention_scores(q, k, dtype, scale_first)
            for name, (dtype, scale_first) in runs.items()}
# --8<-- [end:attention-overflow]


# --8<-- [start:fixed-loss-scale]
def train_fp16(steps: int, loss_scale: float, dynamic: bool) -> list[dict]:
    """The tiny GPT under fp16 autocast with the loss multiplied by `loss_scale`. With a fixed
    scale the gradients are divided back and the optimizer steps, whatever they hold; with
    `dynamic`, the course's DynamicLossScaler skips a step whose gradients are not finite
    and halves the scale (torch.amp.GradScaler does the same)."""
    model, sampler = model_and_batch("tiny", 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = DynamicLossScaler(init_scale=loss_scale, growth_interval=1000)
    log = []
    for step in range(1, steps + 1):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(inputs, targets)
        scale = scaler.scale
        (loss * scale).backward()
        grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if dynamic:
            stepped = scaler.step(optimizer)  # unscales; skips the step if any grad is inf/nan
        else:
            for p in model.parameters():
                p.grad.div_(scale)
            optimizer.step()  # an inf gradient makes Adam's moments inf, and inf / inf = NaN
            stepped = True
        optimizer.zero_grad(set_to_none=True)
        weights_finite = all(torch.isfinite(p).all() for p in model.parameters())
        log.append({"step": step, "loss": loss.item(), "scale": scale,
                    "grads_finite": bool(grads_finite), "stepped": stepped,
                    "weights_finite": bool(weights_finite)})
    return log
# --8<-- [end:fixed-loss-scale]


# --8<-- [start:high-lr]
def train_sgd(steps: int, lr: float, clip_norm: float | None = None) -> list[dict]:
    """The tiny GPT in fp32 with plain SGD, optionally clipping the gradient norm.

    SGD's step is lr * gradient: when a step lands somewhere steeper, the next gradient is
    larger, the next step larger still, and the loss runs away. Clipping rescales the gradient
    to norm `clip_norm` whenever it is longer, so no single step is longer than lr * clip_norm.
    (AdamW divides by a running gradient size, so its steps are about lr long anyway: the
    same runaway needs a far larger lr there.)"""
    model, sampler = model_and_batch("tiny", 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    log = []
    for step in range(1, steps + 1):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        _, loss = model(inputs, targets)
        loss.backward()
        # Returns the norm *before* clipping: log it, it is the early warning.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step, "loss": loss.item(), "grad_norm": norm.item()})
    return log
# --8<-- [end:high-lr]


def first_nan_step(log: list[dict]) -> int | None:
    return next((r["step"] for r in log if not math.isfinite(r["loss"])), None)


def main() -> None:
    set_threads(1, "a tiny model gains nothing from more")
    print("== 1. attention scores of q = k = 32.0 (head_dim 64): one row of softmax ==")
    for name, probs in attention_overflow_demo().items():
        print(f"  {name:<21} {probs[0].tolist()}")

    print("\n== 2. fp16 autocast, initial loss scale 2^20 ==")
    for dynamic, steps in ((False, 3), (True, 5)):
        print("  dynamic loss scaler (skip + halve):" if dynamic else
              "  fixed scale, optimizer steps anyway:")
        for r in train_fp16(steps=steps, loss_scale=2.0**20, dynamic=dynamic):
            print(f"    step {r['step']}: loss {r['loss']:.4f}  scale 2^{int(math.log2(r['scale']))}"
                  f"  grads finite {r['grads_finite']!s:<5}  "
                  f"{'stepped' if r['stepped'] else 'skipped'}  "
                  f"weights finite {r['weights_finite']}")

    print("\n== 3. plain SGD, 12 steps ==")
    # A run that diverges amplifies every last-bit difference between CPUs' kernels: its digits
    # after a few steps are this machine's own. What it shows holds on any machine.
    last4 = {}
    for lr, clip in ((3.0, None), (3.0, 1.0), (0.5, None)):
        log = train_sgd(steps=12, lr=lr, clip_norm=clip)
        norms = [r["grad_norm"] for r in log if math.isfinite(r["loss"])]
        last4[lr, clip] = sum(r["loss"] for r in log[-4:]) / 4
        print(f"  lr {lr}, clip {clip}: NaN within 12 steps: {first_nan_step(log) is not None!s:<5}  "
              f"largest gradient norm above 1e6: {max(norms) > 1e6!s:<5}  "
              f"below 100: {max(norms) < 100}")
    print("  mean loss of steps 9-12, lr 0.5 without clipping below lr 3.0 with it: "
          f"{last4[0.5, None] < last4[3.0, 1.0]}")

if __name__ == "__main__":
    main()
