"""The fused path: the same GPT and the same weights, in fewer, larger operations.

`fuse(model)` converts a readable GPT (snippets/models/gpt.py) in place:

- q, k and v projections become one matmul, `qkv_proj`, whose weight is the three stacked, with
  q's and k's rows reordered within each head so that the pairs RoPE rotates sit side by side
  (q and k reordered alike leave every q . k, and so the attention, unchanged);
- SwiGLU's gate and up projections become one matmul, `gate_up_proj`, the same way;
- RMSNorm becomes RMSNormFunction, a torch.autograd.Function whose backward is LayerNorm's
  backward kernel (told the mean is 0) plus the one term that kernel adds for the mean, where
  autograd would walk back through pow, mean, add, rsqrt and two muls;
- RoPE becomes RotaryQKV: each pair as a complex number times e^(i angle), one multiplication
  for q and k together instead of rotate_half's chunk, neg and cat (or a flip); its backward is
  the rotation back, saving only the table, and writes q's, k's and v's gradients into one
  tensor, with no cat;
- SwiGLU becomes SwiGLUFunction: silu(gate) * up, whose backward computes the gradients of gate
  and up together from the saved gate_up, straight into the halves of one tensor.

The three Functions also keep fewer tensors from forward to backward (about as many bytes as
nanoGPT's step at the same shapes): fewer fresh buffers per step, fewer passes over memory the
cache does not hold, fewer page faults. Cross-entropy needs nothing: on fp32 logits the
readable model's `.float()` returns the tensor itself, and the loss is under 1 % of the step at a
vocabulary of 256. The path is written for fp32, as the benchmark runs it.

The outputs equal the readable model's up to the order of floating-point sums
(tests/test_fused.py, which also checks each hand-written backward with gradcheck).
`compile_model` adds torch.compile, which on the CPU generates C++ loops that fuse the
elementwise chains the eager operators cannot. Under it the three modules take plain operators
instead of their Functions (F.rms_norm; silu(gate) * up; RoPE as rotate_pairs, the same
multiplication in real arithmetic, since Inductor has no complex numbers): Inductor derives and
fuses their backward itself, and in one bench run on 2 cores a hand-written backward inside the
compiled graph cost 4-7 % against the plain operators. The readable model
stays the default everywhere else in the course, and the exercises check its functions.

To time eager, fused and nanoGPT and see where the time goes (about 15 s on 2 cores):
    python -m snippets.bench.fused_profile
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.models.gpt import GPT, MLP, CausalSelfAttention, RMSNorm


# --8<-- [start:fused-modules]
def stacked_linear(*weights: torch.Tensor) -> nn.Linear:
    """One Linear computing several at once: their weights stacked along the output. A matmul
    with 3h outputs does the same FLOPs as three with h each, in one call that reads the
    input once."""
    weight = torch.cat([w.detach() for w in weights])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
    return fused


def pairs_side_by_side(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A q or k projection's rows reordered within each head: rotate_half pairs feature i with
    feature i + head_dim / 2; after this, the pair is features 2i and 2i + 1."""
    rows, columns = weight.shape
    return weight.view(-1, 2, head_dim // 2, columns).transpose(1, 2).reshape(rows, columns)


def pairs_in_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of pairs_side_by_side: rows back in rotate_half's order."""
    rows, columns = weight.shape
    return weight.view(-1, head_dim // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


class FusedRMSNorm(nn.Module):
    """RMSNorm through RMSNormFunction, keeping the readable module's weight and eps."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # Inductor fuses the plain ops, backward included
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return RMSNormFunction.apply(x, self.weight, self.eps)


class FusedMLP(nn.Module):
    def __init__(self, mlp: MLP):
        super().__init__()
        self.gate_up_proj = stacked_linear(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if torch.compiler.is_compiling():  # Inductor fuses the plain ops, backward included
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(SwiGLUFunction.apply(gate_up))


class FusedAttention(nn.Module):
    def __init__(self, attn: CausalSelfAttention):
        super().__init__()
        if attn.attn_implementation != "sdpa":
            raise ValueError("the fused path uses scaled_dot_product_attention only; build "
                             "the model with attn_implementation='sdpa'")
        self.head_dim = head_dim = attn.head_dim
        # q and k with the pairs RoPE rotates side by side. Both are reordered alike, so every
        # q . k, and with it the attention, is unchanged; v and o_proj keep their order.
        self.qkv_proj = stacked_linear(pairs_side_by_side(attn.q_proj.weight, head_dim),
                                       pairs_side_by_side(attn.k_proj.weight, head_dim),
                                       attn.v_proj.weight)
        self.o_proj = attn.o_proj
        # The rotation table stored like q: pairs (cos, sin) side by side, one row per head,
        # (positions, heads, head_dim). The readable tables repeat each angle in both halves.
        heads, half = attn.q_proj.out_features // head_dim, head_dim // 2
        cos_sin = torch.stack((attn.rope_cos[:, :half], attn.rope_sin[:, :half]), dim=-1)
        table = cos_sin.flatten(-2).unsqueeze(1).expand(-1, heads, -1).contiguous()
        self.register_buffer("rope_rotation", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, -1, self.head_dim)
        table = self.rope_rotation[:T].to(x.dtype)
        if torch.compiler.is_compiling() or qkv.dtype not in (torch.float32, torch.float64):
            # Inductor generates no code for complex numbers, and bf16 has none: the same
            # rotation in real arithmetic (under torch.compile fused into the loops around it).
            qkv = torch.cat((rotate_pairs(qkv[:, :, :2], table.unsqueeze(1)), qkv[:, :, 2:]), 2)
            q, k, v = qkv.transpose(1, 3).unbind(2)
        else:
            q, k, v = RotaryQKV.apply(qkv, table)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
# --8<-- [end:fused-modules]


# --8<-- [start:rmsnorm-function]
class RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), with a backward of two kernels
    instead of autograd's walk back through pow, mean, add, rsqrt and two muls.

    RMSNorm is LayerNorm without subtracting the mean. LayerNorm's backward kernel, told that
    the mean is 0, computes x's gradient but for one term (the mean of grad * weight, which
    only a subtracted mean puts there; added back here), and weight's gradient exactly."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        # vector_norm reads x once; x.pow(2).mean(-1) would write x^2 out and read it back.
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
        ctx.save_for_backward(x, weight, rstd)  # x is the residual stream's: no new tensor
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        mean = torch.zeros_like(rstd)
        grad_x, grad_weight, _ = torch.ops.aten.native_layer_norm_backward(
            grad, x, weight.shape, mean, rstd, weight, None, [True, True, False])
        grad_x.add_((grad @ weight).unsqueeze(-1).div_(x.shape[-1]).mul_(rstd))
        return grad_x, grad_weight, None
# --8<-- [end:rmsnorm-function]


# --8<-- [start:swiglu-function]
class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up from the stacked gate_up projection's output.

    It saves only gate_up, which autograd would keep anyway, and not silu(gate): backward
    computes silu(gate) again, one pass, in exchange for a tensor fewer held from forward to
    backward. The gradients of gate and up are written straight into the two halves of one
    tensor, which the stacked matmul's backward reads as it is: no cat joins them."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)  # views: writing them fills it
        torch.mul(grad, F.silu(gate), out=grad_up)
        # silu_backward is the kernel autograd runs for F.silu: it multiplies its first
        # argument by silu'(gate) = sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))). Here in
        # place, on grad * up already written where the result goes.
        torch.mul(grad, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate_up
# --8<-- [end:swiglu-function]


# --8<-- [start:rope-function]
def as_complex(x: torch.Tensor) -> torch.Tensor:
    """A view of x with each pair of neighbours (x[2i], x[2i + 1]) as one complex number."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The complex multiplication written out in real numbers: (x1 + i x2)(cos + i sin)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = table.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class RotaryQKV(torch.autograd.Function):
    """q, k and v from the stacked projection's output, q and k rotated by RoPE.

    With each pair as a complex number, rotating it by the angle a is multiplying it by
    e^(i a) = cos a + i sin a: one multiplication for q and k together, no flip, no cat. The
    backward of a rotation is the rotation back, by the conjugate: it saves only the table,
    and writes the gradients of q, k and v straight into one tensor shaped like qkv."""

    @staticmethod
    def forward(ctx, qkv, table):  # qkv: (B, T, 3, heads, head_dim); table: (T, heads, head_dim)
        ctx.save_for_backward(table)
        qk = as_complex(qkv[:, :, :2]) * as_complex(table).unsqueeze(1)
        q, k = torch.view_as_real(qk).flatten(-2).unbind(2)
        v = qkv[:, :, 2].clone()  # not a view: qkv itself is then freed
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        (table,) = ctx.saved_tensors
        back = as_complex(table).conj()
        B, heads, T, head_dim = grad_q.shape
        grad = grad_q.new_empty(B, T, 3, heads, head_dim)
        torch.mul(as_complex(grad_q.transpose(1, 2)), back, out=as_complex(grad[:, :, 0]))
        torch.mul(as_complex(grad_k.transpose(1, 2)), back, out=as_complex(grad[:, :, 1]))
        grad[:, :, 2] = grad_v.transpose(1, 2)
        return grad, None
# --8<-- [end:rope-function]


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


def readable_names(tensors: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """A fused model's tensors (its state_dict, or its gradients by parameter name) under the
    readable model's names: each stacked weight split back into its parts, q's and k's rows
    back in rotate_half's order. A fused checkpoint converted this way loads into the
    readable GPT."""
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("_orig_mod.")  # what torch.compile(model) prefixes
        for stacked, parts in (("qkv_proj.", ("q", "k", "v")), ("gate_up_proj.", ("gate", "up"))):
            prefix, found, leaf = name.rpartition(stacked)
            if found:
                for part, piece in zip(parts, tensor.chunk(len(parts))):
                    if part in ("q", "k"):
                        piece = pairs_in_halves(piece, head_dim)
                    out[f"{prefix}{part}_proj.{leaf}"] = piece
                break
        else:
            out[name] = tensor
    return out
# --8<-- [end:fuse]
