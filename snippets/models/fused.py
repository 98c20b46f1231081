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

To time eager against fused and see where the time goes (about 10 s on 2 cores):
    python -m snippets.bench.fused_profile
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.models.gpt import GPT, MLP, CausalSelfAttention, RMSNorm


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
