"""The fused path: the same GPT and the same weights, in fewer, larger operations.

`fuse(model)` converts a readable GPT (snippets/models/gpt.py) in place:

- q, k and v projections become one matmul, `qkv_proj`, whose weight is the three stacked;
- SwiGLU's gate and up projections become one matmul, `gate_up_proj`, the same way;
- RMSNorm becomes `F.rms_norm`, with the same weight and eps;
- RoPE rotates q and k together, in one pass, without rotate_half's chunk, neg and cat: the sign
  lives in a precomputed table, and the halves swap with one `flip`.

The outputs equal the readable model's up to the order of floating-point sums
(tests/test_fused.py). `compile_model` adds torch.compile, which on the CPU generates C++ loops
that fuse the elementwise chains the eager operators cannot. The readable model stays the
default everywhere else in the course, and the exercises check its functions.

Run it directly to time eager against fused and see where the time goes (about 10 s on 2 cores):
    python snippets/models/fused.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from snippets.machine import cpu_model, set_threads
from snippets.models.gpt import (GPT, MLP, CausalSelfAttention, RMSNorm, get_config,
                                 shift_for_next_token)
from snippets.scripts.precision_and_accumulation import median_seconds


# --8<-- [start:fused-modules]
def stacked_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear computing all of `linears` at once: their weights stacked along the output.
    A matmul with 3h outputs does the same FLOPs as three with h each, in one call that
    reads the input once."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
    return fused


class FusedRMSNorm(nn.Module):
    """RMSNorm through F.rms_norm, keeping the readable module's weight and eps."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class FusedMLP(nn.Module):
    def __init__(self, mlp: MLP):
        super().__init__()
        self.gate_up_proj = stacked_linear(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedAttention(nn.Module):
    def __init__(self, attn: CausalSelfAttention):
        super().__init__()
        if attn.attn_implementation != "sdpa":
            raise ValueError("the fused path uses scaled_dot_product_attention only; build "
                             "the model with attn_implementation='sdpa'")
        self.head_dim = attn.head_dim
        self.qkv_proj = stacked_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = attn.o_proj
        # rotate_half(x) * sin = (-x2 * sin, x1 * sin) = flip(halves of x) * (-sin, +sin):
        # put the sign in the table once, instead of a neg and a cat on every call. Rows are
        # positions; the two 1s broadcast over "q or k" and heads; then (half, head_dim / 2).
        half = self.head_dim // 2
        cos, sin = attn.rope_cos, attn.rope_sin  # (positions, head_dim): (c, c) and (s, s)
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        shape = (cos.shape[0], 1, 1, 2, half)
        self.register_buffer("rope_cos", cos.reshape(shape), persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin.reshape(shape), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, -1, 2, self.head_dim // 2)
        qk, v = qkv.split((2, 1), dim=2)  # backward: one cat, where slices would zero-fill
        # RoPE on q and k at once: each head's two halves are dimension -2 of size 2.
        cos, sin = self.rope_cos[:T].to(x.dtype), self.rope_signed_sin[:T].to(x.dtype)
        qk = qk * cos + qk.flip(-2) * sin
        q, k = qk.flatten(-2).transpose(1, 3).unbind(2)  # (B, heads, T, head_dim) each
        v = v.squeeze(2).flatten(-2).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
# --8<-- [end:fused-modules]


# --8<-- [start:fuse]
def fuse(model: GPT) -> GPT:
    """Convert a readable GPT to the fused path, in place, with the same weights; returns it.
    Norm weights, o_proj and down_proj are the readable model's own parameters; qkv_proj and
    gate_up_proj are new ones holding copies of the weights they replace."""
    for block in model.layers:
        block.input_layernorm = FusedRMSNorm(block.input_layernorm)
        block.self_attn = FusedAttention(block.self_attn)
        block.post_attention_layernorm = FusedRMSNorm(block.post_attention_layernorm)
        block.mlp = FusedMLP(block.mlp)
    model.norm = FusedRMSNorm(model.norm)
    return model


def compile_model(model: nn.Module) -> nn.Module:
    """torch.compile, in place. On the CPU, Inductor writes C++ for each run of elementwise
    operations between matmuls and compiles it with the system's C++ compiler (the first
    step takes tens of seconds); dynamic=False, since every step has the same shapes."""
    model.compile(dynamic=False)
    return model


def readable_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fused model's tensors (its state_dict, or its gradients by parameter name) under the
    readable model's names: each stacked weight split back into its parts. A fused
    checkpoint converted this way loads into the readable GPT."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("_orig_mod.")  # what torch.compile(model) prefixes
        for stacked, parts in (("qkv_proj.", ("q", "k", "v")), ("gate_up_proj.", ("gate", "up"))):
            prefix, found, leaf = name.rpartition(stacked)
            if found:
                for part, piece in zip(parts, tensor.chunk(len(parts))):
                    out[f"{prefix}{part}_proj.{leaf}"] = piece
                break
        else:
            out[name] = tensor
    return out
# --8<-- [end:fuse]


def training_step(model, optimizer, inputs, targets) -> None:
    _, loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def operator_table(model, optimizer, inputs, targets, steps: int = 3,
                   rows: int = 8) -> list[tuple]:
    """(operator, calls per step, share of the time) of the busiest operators of a few
    training steps.

    The profiler times operators by the wall clock, so on a busy machine another process's
    turn on the core lands in whichever operator was running. Shares of the total are less
    disturbed than milliseconds: the interruptions fall on each operator about in proportion
    to its time."""
    training_step(model, optimizer, inputs, targets)  # warm-up, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            training_step(model, optimizer, inputs, targets)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.count // steps, e.self_cpu_time_total / total) for e in events[:rows]]


def main(config_name: str = "small", batch_size: int = 8, repeats: int = 5) -> None:
    set_threads(1, "the profile compares operators, not parallel speed-up")
    config = get_config(config_name)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.max_position_embeddings + 1))
    inputs, targets = shift_for_next_token(tokens)
    models = {}
    for label in ("eager", "fused"):
        torch.manual_seed(0)
        models[label] = GPT(config) if label == "eager" else fuse(GPT(config))
    with torch.no_grad():
        difference = (models["eager"](inputs)[0] - models["fused"](inputs)[0]).abs().max()
    optimizers = {label: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
                  for label, m in models.items()}
    steps = {label: (lambda m=m, o=optimizers[label]: training_step(m, o, inputs, targets))
             for label, m in models.items()}
    seconds = median_seconds(steps, repeats=repeats, warmup=1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread")
    print(f"{config_name} GPT, batch {batch_size} x {config.max_position_embeddings} tokens, "
          f"largest logit difference {difference:.1e}")
    print(f"training step (forward + backward + AdamW), median of {repeats}: "
          f"eager {1e3 * seconds['eager']:.1f} ms, fused {1e3 * seconds['fused']:.1f} ms, "
          f"fused at {seconds['eager'] / seconds['fused']:.2f}x eager's speed")
    for label, model in models.items():
        print(f"\n{label}: busiest operators of 3 steps (torch.profiler, share of self time)")
        for name, calls, share in operator_table(model, optimizers[label], inputs, targets):
            print(f"  {name:<58} {calls:>4} calls/step {share:>6.1%}")


if __name__ == "__main__":
    main()
