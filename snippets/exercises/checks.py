"""One check per exercise: run the learner's code and say, in learner terms, what is wrong.

Each check takes the learner's module (their copy of the file, imported by path) and returns
the list of things it verified; on the first problem it raises CheckFailed with a message that
says what the code did, what was expected, and the likely cause. Checks compare with the
solution modules in snippets/ (same seeds, same weights) and recognise the usual mistakes by
computing them: a result that equals "the right formula without the scaling" is reported as
that, not as "wrong numbers".
"""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.models import gpt as ref


class CheckFailed(AssertionError):
    """The learner's code runs but does the wrong thing; the message says what and why."""


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


def _config(module: ModuleType, **fields):
    """The same small config in the learner's module and in the solution's."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=16)
    base.update(fields)
    return module.GPTConfig(**base)


# ---------------------------------------------------------------- exercise 1: RMSNorm


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


# ---------------------------------------------------------------- exercise 2: rotate_half


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


# ---------------------------------------------------------------- exercise 3: RoPE


def check_apply_rotary_pos_emb(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    T, d = 6, 8
    q, k = torch.randn(2, 3, T, d), torch.randn(2, 3, T, d)
    cos, sin = ref.precompute_rope(d, T)
    result = learner.apply_rotary_pos_emb(q, k, cos, sin)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CheckFailed(f"apply_rotary_pos_emb returned {type(result).__name__}; it must "
                          "return the pair (rotated q, rotated k)")
    q_got, k_got = (_expect_tensor(t, "apply_rotary_pos_emb") for t in result)
    q_exp, k_exp = ref.apply_rotary_pos_emb(q, k, cos, sin)
    if q_got.shape != q.shape or k_got.shape != k.shape:
        raise CheckFailed(f"apply_rotary_pos_emb returned shapes {tuple(q_got.shape)} and "
                          f"{tuple(k_got.shape)}; q and k keep their shape {tuple(q.shape)}: "
                          "cos and sin (T, head_dim) broadcast over batch and heads")
    for name, got, exp, x in (("q", q_got, q_exp, q), ("k", k_got, k_exp, k)):
        if _close(got, exp):
            continue
        if _close(got, x):
            raise CheckFailed(f"your rotated {name} is {name} unchanged: rotate both q and k, "
                              f"{name} * cos + rotate_half({name}) * sin")
        if _close(got, x * cos - ref.rotate_half(x) * sin):
            raise CheckFailed(f"your {name} rotates the wrong way (- sin where + sin belongs): "
                              f"{name} * cos + rotate_half({name}) * sin; rotate_half already "
                              "carries the minus sign")
        if _close(got, (x * cos + x * sin)) or _close(got, x * sin + ref.rotate_half(x) * cos):
            raise CheckFailed(f"your {name} uses cos and sin with the wrong partners: "
                              f"{name} * cos + rotate_half({name}) * sin")
        if name == "q" and _close(got, k_exp):
            raise CheckFailed("you return (k, q) rotated: return them in the order (q, k)")
        raise CheckFailed(f"your rotated {name} differs from {name} * cos + rotate_half({name}) "
                          f"* sin by up to {_max_diff(got, exp):.3g}")
    passed = ["q and k rotated as x * cos + rotate_half(x) * sin"]

    # What RoPE is for: the score between a query at m and a key at n depends on m - n only.
    one_q, one_k = torch.randn(d), torch.randn(d)
    qs, ks = learner.apply_rotary_pos_emb(one_q.expand(T, d), one_k.expand(T, d), cos, sin)
    scores = qs @ ks.T
    if not torch.allclose(scores[3, 1], scores[5, 3], atol=1e-4):
        raise CheckFailed("the same query and key give different scores at positions (3, 1) and "
                          "(5, 3): after RoPE the score must depend on the distance only")
    passed.append("q·k depends only on the distance between positions (3-1 = 5-3)")
    return passed


# ---------------------------------------------------------------- exercise 4: SwiGLU MLP


def check_mlp(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.MLP(_config(ref))
    mlp = learner.MLP(_config(learner))
    mlp.load_state_dict(solution.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = _expect_tensor(mlp(x), "MLP.forward")
        expected = solution(x)
        gate, up, down = solution.gate_proj(x), solution.up_proj(x), solution.down_proj
    if got.shape != x.shape:
        raise CheckFailed(
            f"your MLP maps shape {tuple(x.shape)} to {tuple(got.shape)}; it must return "
            f"{tuple(x.shape)}: finish with down_proj, from intermediate_size back to hidden_size")
    if _close(got, expected):
        return ["matches down_proj(silu(gate_proj(x)) * up_proj(x))"]
    with torch.no_grad():
        mistakes = [
            (down(F.gelu(gate) * up), "you used GELU; SwiGLU gates with SiLU: F.silu"),
            (down(F.gelu(gate, approximate="tanh") * up),
             "you used GELU; SwiGLU gates with SiLU: F.silu"),
            (down(F.relu(gate) * up), "you used ReLU; SwiGLU gates with SiLU: F.silu"),
            (down(torch.sigmoid(gate) * up),
             "you used sigmoid(gate); SiLU is gate * sigmoid(gate): F.silu"),
            (down(gate * F.silu(up)), "SiLU goes on gate_proj(x), not on up_proj(x)"),
            (down(F.silu(gate)), "you dropped up_proj: the SiLU-gated projection must be "
                                 "multiplied element-wise by up_proj(x)"),
            (down(F.silu(gate) + up), "you added the two projections; SwiGLU multiplies them "
                                      "element-wise: silu(gate_proj(x)) * up_proj(x)"),
            (down(F.silu(gate * up)), "apply SiLU to gate_proj(x) alone, then multiply by "
                                      "up_proj(x)"),
        ]
    for wrong, why in mistakes:
        if _close(got, wrong):
            raise CheckFailed(f"your MLP computes the wrong function: {why}")
    raise CheckFailed(f"your MLP differs from down_proj(silu(gate_proj(x)) * up_proj(x)) by up to "
                      f"{_max_diff(got, expected):.3g}")


# ---------------------------------------------------------------- exercise 5: attention


def _attention_variant(attn: nn.Module, x: torch.Tensor, *, scale=True, mask="-inf",
                       softmax_dim=-1) -> torch.Tensor:
    """The solution's attention with one thing changed: the learner's likely mistakes."""
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
    q, k = ref.apply_rotary_pos_emb(q, k, attn.rope_cos[:T], attn.rope_sin[:T])
    scores = q @ k.transpose(-2, -1)
    if scale:
        scores = scores / math.sqrt(attn.head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if mask == "-inf":
        scores = scores.masked_fill(~causal, float("-inf"))
    elif mask == "zero":
        scores = scores.masked_fill(~causal, 0.0)
    probs = torch.softmax(scores, dim=softmax_dim)
    if mask == "after":
        probs = probs * causal
    y = (probs @ v).transpose(1, 2).reshape(B, T, -1)
    return attn.o_proj(y)


def check_attention(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.CausalSelfAttention(_config(ref, attn_implementation="eager"))
    # eager: the branch the learner writes; "sdpa" would run PyTorch's fused kernel instead.
    attn = learner.CausalSelfAttention(_config(learner, attn_implementation="eager"))
    attn.load_state_dict(solution.state_dict())
    T = 8  # shorter than max_position_embeddings: the mask must be built for T, not the maximum
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        got = _expect_tensor(attn(x), "CausalSelfAttention.forward")
    if got.shape != x.shape:
        raise CheckFailed(f"your attention maps {tuple(x.shape)} to {tuple(got.shape)}: y = probs "
                          "@ v must be (batch, heads, T, head_dim) before the heads are joined")
    if torch.isnan(got).any():
        raise CheckFailed("your attention output contains nan: a row of scores that is all -inf "
                          "has no softmax; mask only positions AFTER the query (tril keeps the "
                          "diagonal, so every query sees at least itself)")
    passed = []

    changed = x.clone()
    changed[:, 5] = torch.randn(2, 32)
    with torch.no_grad():
        got_changed = attn(changed)
    leaks = [t for t in range(5) if not torch.allclose(got[:, t], got_changed[:, t], atol=1e-6)]
    if leaks:
        why = "apply the causal mask before softmax: scores of keys after the query set to -inf"
        with torch.no_grad():
            if _close(got, _attention_variant(solution, x, mask="zero")):
                why = ("you set future scores to 0, but exp(0) = 1 still gives them weight; "
                       "masked_fill them with float('-inf'), so that exp(-inf) = 0")
            elif _close(got, _attention_variant(solution, x, mask="after")):
                why = ("you masked after the softmax: its denominator still sums over the future "
                       "keys, and the weights left no longer sum to 1; set the future scores to "
                       "-inf BEFORE the softmax, which then renormalises over the past")
            elif _close(got, _attention_variant(solution, x, mask="-inf", softmax_dim=-2)):
                why = ("your softmax normalises over the queries (dim=-2); each query's row of "
                       "scores over the keys must sum to 1: softmax(scores, dim=-1)")
        raise CheckFailed(f"your attention leaks the future: changing token 5 changed the output "
                          f"at position {leaks[0]}: {why}")
    passed.append("causal: changing token 5 leaves positions 0-4 unchanged")

    with torch.no_grad():
        expected = solution(x)
        mistakes = [
            (_attention_variant(solution, x, scale=False),
             "you did not scale the scores: divide q @ k^T by math.sqrt(self.head_dim), or the "
             "softmax saturates as head_dim grows"),
        ]
    if not _close(got, expected):
        for wrong, why in mistakes:
            if _close(got, wrong):
                raise CheckFailed(f"your attention is causal but computes the wrong weights: {why}")
        raise CheckFailed(f"your attention differs from softmax(q @ k^T / sqrt(head_dim), "
                          f"future masked to -inf) @ v by up to {_max_diff(got, expected):.3g}")
    passed.append("matches softmax(q k^T / sqrt(head_dim) + causal mask) v")
    with torch.no_grad():
        fused = ref.CausalSelfAttention(_config(ref))
        fused.load_state_dict(solution.state_dict())
        sdpa = fused(x)
    if not _close(got, sdpa, tol=1e-4):
        raise CheckFailed(f"your attention differs from PyTorch's fused kernel by up to "
                          f"{_max_diff(got, sdpa):.3g}")
    passed.append("agrees with PyTorch's fused F.scaled_dot_product_attention(is_causal=True)")
    return passed


# ---------------------------------------------------------------- exercise 6: initialisation


def _weight_stats(w: torch.Tensor) -> tuple[float, float, float]:
    w = w.detach().float().flatten()
    std = w.std().item()
    beyond_two_std = (w.abs() > 2 * std).float().mean().item()
    return w.mean().item(), std, beyond_two_std


def check_init_weights(learner: ModuleType) -> list[str]:
    layers = 4
    # Untied, so the embedding's init is seen on its own: a tied lm_head (an nn.Linear) would
    # re-initialise the shared matrix and hide a missing nn.Embedding branch.
    config = _config(learner, vocab_size=256, hidden_size=64, intermediate_size=172,
                     num_hidden_layers=layers, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = learner.GPT(config)
    base = config.initializer_range
    residual = base / math.sqrt(2 * layers)
    passed = []

    def expect_std(name: str, w: torch.Tensor, std: float, why: str):
        mean, got, tails = _weight_stats(w)
        if not (0.9 * std < got < 1.1 * std):
            hint = why
            if abs(got - 1.0) < 0.1:
                hint = ("that is PyTorch's default N(0, 1) for nn.Embedding: initialise it with "
                        f"nn.init.normal_(module.weight, mean=0.0, std={base})")
            elif abs(got - 1 / math.sqrt(3 * w.shape[-1])) < 0.1 / math.sqrt(3 * w.shape[-1]):
                hint = ("that is PyTorch's default (Kaiming uniform) for nn.Linear: your "
                        "_init_weights did not initialise this Linear")
            elif abs(got - residual) < 0.1 * residual and std == base:
                hint = ("only the residual outputs (module.is_residual_output) get the smaller "
                        f"std; this one takes initializer_range = {base}")
            raise CheckFailed(f"{name} has std {got:.4f}, expected {std:.4f}: {hint}")
        if abs(mean) > 0.1 * std:
            raise CheckFailed(f"{name} has mean {mean:.4f}, expected 0: use mean=0.0")
        if tails < 0.02:
            raise CheckFailed(
                f"{name} has no values beyond 2 standard deviations ({tails:.1%}; a normal "
                "distribution has 4.6%): it looks uniform; draw from a normal distribution "
                "with nn.init.normal_")

    expect_std("embed_tokens.weight", model.embed_tokens.weight, base,
               f"nn.init.normal_(module.weight, mean=0.0, std=initializer_range={base})")
    passed.append(f"embedding ~ N(0, {base})")
    block = model.layers[0]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        expect_std(f"layers.0.{name}.weight", block.get_submodule(name).weight, base,
                   f"linears that do not end a residual branch use initializer_range = {base}")
    expect_std("lm_head.weight", model.lm_head.weight, base,
               f"the output projection is a plain nn.Linear: std initializer_range = {base}")
    passed.append(f"q, k, v, gate, up and lm_head projections ~ N(0, {base})")
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        expect_std(f"layers.0.{name}.weight", block.get_submodule(name).weight, residual,
                   f"{base}/sqrt(2*{layers}): linears marked is_residual_output add into the "
                   "residual stream, 2 per block; divide their std by "
                   "math.sqrt(2 * num_hidden_layers) so the stream's variance stays put")
    passed.append(f"o_proj and down_proj ~ N(0, {base}/sqrt(2 * {layers}) = {residual:.4f})")

    norm = learner.RMSNorm(8)
    biased = nn.Linear(8, 8, bias=True)
    with torch.no_grad():
        norm.weight.fill_(0.5)
        biased.bias.fill_(0.5)
    model._init_weights(norm)
    model._init_weights(biased)
    if not torch.equal(norm.weight, torch.ones(8)):
        raise CheckFailed("_init_weights(an RMSNorm whose weight is 0.5) left weight at "
                          f"{_fmt(norm.weight[:3])}...: set RMSNorm weights to 1 with "
                          "nn.init.ones_(module.weight), so the norm starts as a pure rescale")
    if not torch.equal(biased.bias, torch.zeros(8)):
        raise CheckFailed("_init_weights(nn.Linear(8, 8, bias=True)) left the bias at "
                          f"{_fmt(biased.bias[:3])}...: zero a Linear's bias when it has one "
                          "(if module.bias is not None: nn.init.zeros_(module.bias))")
    passed.append("RMSNorm weights set to 1, Linear biases to 0")
    return passed


# ---------------------------------------------------------------- exercise 7: GPT.forward


def check_gpt_forward(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.GPT(_config(ref))
    model = learner.GPT(_config(learner))
    # The solution's weights: this checks forward, whatever exercise 6 drew.
    model.load_state_dict(solution.state_dict())
    tokens = torch.randint(0, 64, (2, 11))
    input_ids, targets = ref.shift_for_next_token(tokens)
    B, T = input_ids.shape
    passed = []

    with torch.no_grad():
        result = model(input_ids, targets)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise CheckFailed(f"GPT.forward returned {type(result).__name__}; it must return the "
                              "pair (logits, loss)")
        logits, loss = result
        logits = _expect_tensor(logits, "GPT.forward (logits)")
        if logits.shape != (B, T, 64):
            raise CheckFailed(f"logits have shape {tuple(logits.shape)}, expected (batch, T, "
                              f"vocab_size) = {(B, T, 64)}: one score per vocabulary entry at "
                              "every position, from self.lm_head")
        expected_logits, expected_loss = solution(input_ids, targets)
        if not _close(logits, expected_logits, tol=1e-4):
            x = solution.embed_tokens(input_ids)
            no_blocks = solution.lm_head(solution.norm(x))
            for block in solution.layers:
                x = block(x)
            mistakes = [
                (solution.lm_head(x), "you skipped the final norm: apply self.norm to the output "
                                      "of the last block, before self.lm_head"),
                (no_blocks, "the blocks did not run: x = block(x) for each block in "
                            "self.layers, feeding each block's output to the next"),
            ]
            for wrong, why in mistakes:
                if _close(logits, wrong, tol=1e-4):
                    raise CheckFailed(f"your logits are wrong: {why}")
            raise CheckFailed(f"your logits differ from the solution's (same weights) by up to "
                              f"{_max_diff(logits, expected_logits):.3g}: embed, blocks, final "
                              "norm, lm_head")
        passed.append("logits: embed, every block, final norm, lm_head")

        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CheckFailed(f"with targets, loss must be a scalar tensor; got "
                              f"{type(loss).__name__}"
                              + (f" of shape {tuple(loss.shape)}" if hasattr(loss, "shape") else "")
                              + ": F.cross_entropy averages over all positions")
        if not _close(loss, expected_loss, tol=1e-4):
            flat = logits.float()
            shifted = F.cross_entropy(flat[:, :-1].reshape(-1, 64), targets[:, 1:].reshape(-1))
            why = "F.cross_entropy(logits.view(-1, vocab_size), targets.reshape(-1))"
            if _close(loss, shifted, tol=1e-4):
                why = ("you shifted the targets again; here the caller already did "
                       "(shift_for_next_token): targets[:, t] is the token after input_ids[:, t], "
                       "so compare logits[:, t] with targets[:, t] directly")
            elif _close(loss, F.cross_entropy(flat.reshape(-1, 64), targets.reshape(-1),
                                              reduction="sum"), tol=1e-4):
                why = "you summed the losses; take the mean over positions (the default)"
            raise CheckFailed(f"your loss is {loss.item():.4f}, expected "
                              f"{expected_loss.item():.4f}: {why}")
        passed.append(f"loss: mean next-token cross-entropy ({loss.item():.4f}, near "
                      f"ln(64) = {math.log(64):.4f} for random weights)")

        ignored = targets.clone()
        ignored[:, :4] = -100
        got_ignored = model(input_ids, ignored)[1]
        if not _close(got_ignored, solution(input_ids, ignored)[1], tol=1e-4):
            raise CheckFailed("targets of -100 must be left out of the loss (padding): "
                              "F.cross_entropy(..., ignore_index=-100)")
        passed.append("targets of -100 are ignored")

        no_targets = model(input_ids)
        if not (isinstance(no_targets, tuple) and len(no_targets) == 2
                and no_targets[1] is None):
            raise CheckFailed("without targets, forward must return (logits, None)")
        passed.append("without targets: (logits, None)")

    import torch.utils.checkpoint as torch_checkpoint

    calls = []
    original_module_fn, original_torch_fn = getattr(learner, "checkpoint", None), \
        torch_checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        return original_torch_fn(fn, *args, **kwargs)

    checkpointed = learner.GPT(_config(learner, gradient_checkpointing=True))
    checkpointed.load_state_dict(solution.state_dict())
    checkpointed.train()
    try:
        learner.checkpoint = counting
        torch_checkpoint.checkpoint = counting
        checkpointed(input_ids, targets)[1].backward()
    finally:
        torch_checkpoint.checkpoint = original_torch_fn
        if original_module_fn is not None:
            learner.checkpoint = original_module_fn
    if len(calls) != len(checkpointed.layers):
        raise CheckFailed(
            f"with config.gradient_checkpointing = True in training mode, checkpoint() ran "
            f"{len(calls)} times for {len(checkpointed.layers)} blocks: run each block as "
            "x = checkpoint(block, x, use_reentrant=False), so its activations are recomputed in "
            "backward instead of stored")
    solution.train()
    solution(input_ids, targets)[1].backward()
    grad, expected_grad = checkpointed.embed_tokens.weight.grad, solution.embed_tokens.weight.grad
    if grad is None or not _close(grad, expected_grad, tol=1e-4):
        raise CheckFailed("with gradient checkpointing the gradients differ from the plain "
                          "forward's: checkpointing must only trade memory for compute")
    passed.append("gradient checkpointing: each block through checkpoint(), same gradients")
    return passed


# ---------------------------------------------------------------- phase 2: the trainer
#
# Each check judges one method: the learner's trainer class is subclassed with the solution's
# version of every other exercise method, so a wrong get_lr cannot fail the train_step check.

TRAINER_EXERCISE_METHODS = ("_setup_optimizer", "get_lr", "train_step", "save_checkpoint",
                            "load_checkpoint")


def _ref_trainer() -> ModuleType:
    from snippets.training import ddp_trainer

    return ddp_trainer


def _trainer_class(learner: ModuleType, *mine: str, wrapper: type | None = None) -> type:
    """The learner's DistributedTrainer, their methods `mine`, the solution's for the others."""
    solution = _ref_trainer().DistributedTrainer
    namespace = {name: getattr(solution, name) for name in TRAINER_EXERCISE_METHODS
                 if name not in mine}
    namespace["log"] = lambda self, message: None  # the trainer's own progress lines
    if wrapper is not None:
        namespace["_wrap_model"] = lambda self, model: wrapper(model)
    return type("CheckedTrainer", (learner.DistributedTrainer,), namespace)


def _trainer(cls: type, module: ModuleType, **settings):
    train = dict(batch_size=4, seq_len=16, max_steps=20, warmup_steps=3, lr=1e-3,
                 data="dummy")
    train.update(settings)
    model_config = ref.get_config("tiny", max_position_embeddings=16)
    return cls(model_config, module.TrainConfig(**train), "cpu")


class _Wrapper(nn.Module):
    """Stands in for DistributedDataParallel: the real model is .module; counts forwards."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        self.forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return self.module(*args, **kwargs)


# ---------------------------------------------------------------- exercise 8: param groups


def check_setup_optimizer(learner: ModuleType) -> list[str]:
    cls = _trainer_class(learner, "_setup_optimizer")
    try:
        trainer = _trainer(cls, learner, weight_decay=0.05)
    except ValueError as err:
        if "more than one parameter group" in str(err):
            raise CheckFailed(
                "a parameter is in both groups (AdamW refuses that): the tied embed_tokens / "
                "lm_head matrix is ONE Parameter under two names; named_parameters() yields it "
                "once, so put each parameter it yields in exactly one group") from None
        raise
    optimizer = trainer.optimizer
    if not isinstance(optimizer, torch.optim.AdamW):
        why = ("torch.optim.Adam's weight_decay is added to the gradient and then rescaled by "
               "Adam's per-parameter step size, so the decay is uneven; AdamW shrinks the "
               "weights directly" if isinstance(optimizer, torch.optim.Adam) else "")
        raise CheckFailed(f"_setup_optimizer returned {type(optimizer).__name__}; return a "
                          f"torch.optim.AdamW{': ' + why if why else ''}")
    passed = ["returns torch.optim.AdamW"]

    model = trainer.raw_model
    names = {id(p): n for n, p in model.named_parameters()}
    decay_of: dict[int, list[float]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            decay_of.setdefault(id(p), []).append(group["weight_decay"])
    twice = [n for i, n in names.items() if len(decay_of.get(i, [])) > 1]
    if twice:
        raise CheckFailed(f"{twice[0]} is listed twice in the optimizer: the tied embed_tokens / "
                          "lm_head matrix is ONE Parameter under two names; iterate over "
                          "named_parameters() (it yields each Parameter once), not "
                          "named_parameters(remove_duplicate=False)")
    missing = [n for i, n in names.items() if i not in decay_of]
    if missing:
        raise CheckFailed(f"{len(missing)} parameters are in no group ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): every trainable parameter "
                          "must be in one of the two groups, or it never trains")
    passed.append("every parameter in exactly one group (the tied matrix once)")

    for name, p in model.named_parameters():
        wd = decay_of[id(p)][0]
        if p.dim() >= 2 and wd != 0.05:
            if wd == 0.1:
                raise CheckFailed(f"{name} has weight_decay 0.1 with TrainConfig("
                                  "weight_decay=0.05): read it from "
                                  "self.train_config.weight_decay instead of writing a number")
            raise CheckFailed(f"{name} (a matrix, {tuple(p.shape)}) has weight_decay {wd}, "
                              "expected train_config.weight_decay = 0.05: the matrices hold the "
                              "model's capacity, and weight decay is what keeps them small")
        if p.dim() < 2 and wd != 0.0:
            raise CheckFailed(
                f"{name} (1-D: an RMSNorm gain) has weight_decay {wd}, expected 0.0: decay pulls "
                "the gains toward 0 and fights the normalisation; put parameters with "
                "p.dim() < 2 in a group with weight_decay=0.0")
    passed.append("weight decay on matrices only (norm gains and biases: 0.0)")

    model.norm.weight.requires_grad_(False)
    frozen = trainer._setup_optimizer()
    if any(p is model.norm.weight for g in frozen.param_groups for p in g["params"]):
        raise CheckFailed("a frozen parameter (requires_grad=False) is in the optimizer: skip "
                          "parameters that do not train")
    passed.append("frozen parameters are left out")
    return passed


# ---------------------------------------------------------------- exercise 9: lr schedule


def check_get_lr(learner: ModuleType) -> list[str]:
    cls = _trainer_class(learner, "get_lr")
    solution = _ref_trainer()

    def schedule(**settings):
        # get_lr reads only self.train_config: no model or optimizer is needed for it.
        trainer, expected = cls.__new__(cls), solution.DistributedTrainer.__new__(
            solution.DistributedTrainer)
        trainer.train_config = learner.TrainConfig(**settings)
        expected.train_config = solution.TrainConfig(**settings)
        return trainer, expected

    settings = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    trainer, expected = schedule(**settings)
    lr, min_lr, warmup, max_steps = 1e-3, 1e-4, 10, 110
    for step in range(0, 2 * max_steps):
        got, want = trainer.get_lr(step), expected.get_lr(step)
        if not isinstance(got, (int, float)):
            raise CheckFailed(f"get_lr({step}) returned {type(got).__name__}; return a float")
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
            continue
        at = f"get_lr({step}) = {got:.7g}, expected {want:.7g} (lr={lr}, min_lr={min_lr}, " \
             f"warmup_steps={warmup}, max_steps={max_steps})"
        if step < warmup:
            if math.isclose(got, lr * step / warmup, rel_tol=1e-9, abs_tol=1e-15):
                why = ("your warmup is one step late: step 0 is the first update and should "
                       "already move, so the rate is lr * (step + 1) / warmup_steps, reaching the "
                       "peak at step warmup_steps - 1")
            else:
                why = "warmup grows linearly: lr * (step + 1) / warmup_steps"
        elif step >= max_steps:
            why = ("after max_steps the rate stays at min_lr (the cosine would climb back up if "
                   "it kept going)")
        else:
            progress = (step - warmup) / (max_steps - warmup)
            if math.isclose(got, 0.5 * (1 + math.cos(math.pi * progress)) * lr, rel_tol=1e-6):
                why = "you decay to 0; the cosine ends at min_lr: min_lr + coeff * (lr - min_lr)"
            elif math.isclose(got, lr - progress * (lr - min_lr), rel_tol=1e-6):
                why = ("that is a linear decay; use the cosine: coeff = 0.5 * (1 + cos(pi * "
                       "progress)), flat at both ends")
            else:
                why = ("after warmup, progress = (step - warmup_steps) / (max_steps - "
                       "warmup_steps) goes from 0 to 1, and the rate is min_lr + 0.5 * (1 + "
                       "cos(pi * progress)) * (lr - min_lr)")
        raise CheckFailed(f"{at}: {why}")
    passed = ["linear warmup, then cosine from lr to min_lr, then min_lr, at every step 0-219"]

    trainer, _ = schedule(lr=3e-3, warmup_steps=0, max_steps=50)
    try:
        first = trainer.get_lr(0)
    except ZeroDivisionError:
        raise CheckFailed("with warmup_steps=0 your get_lr divides by zero: no warmup means the "
                          "schedule starts at the peak, get_lr(0) = lr") from None
    if not math.isclose(first, 3e-3, rel_tol=1e-9):
        raise CheckFailed(f"with warmup_steps=0 and lr=3e-3, get_lr(0) = {first:.4g}: without "
                          "warmup the schedule starts at the peak lr")
    passed.append("warmup_steps=0 starts at the peak; settings come from train_config")
    return passed


# ---------------------------------------------------------------- exercise 10: train_step


def check_train_step(learner: ModuleType) -> list[str]:
    solution = _ref_trainer()
    cls = _trainer_class(learner, "train_step", wrapper=_Wrapper)
    batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    passed = []

    trainer = _trainer(cls, learner, batch_size=4, grad_accum_steps=2)
    quiet = type("Reference", (solution.DistributedTrainer,), {"log": lambda self, m: None})
    reference = _trainer(quiet, solution, batch_size=8)
    syncs = []
    original_sync = trainer._grad_sync

    def recording_sync(last_micro_step):
        syncs.append(last_micro_step)
        return original_sync(last_micro_step)

    trainer._grad_sync = recording_sync
    drawn = []

    def micro_batches(*batches):
        for b in batches:
            drawn.append(b)
            yield b

    try:
        stats = trainer.train_step(micro_batches(batch[:4], batch[4:]))
    except RuntimeError as err:
        if "StopIteration" in str(err) or isinstance(err.__cause__, StopIteration):
            raise CheckFailed("train_step asked batch_iter for more than grad_accum_steps=2 "
                              "micro-batches: draw exactly one per micro-step") from None
        raise
    except StopIteration:
        raise CheckFailed("train_step asked batch_iter for more than grad_accum_steps=2 "
                          "micro-batches: draw exactly one per micro-step") from None
    expected = reference.train_step(iter([batch]))

    if not isinstance(stats, dict) or not {"loss", "grad_norm", "lr", "tokens"} <= set(stats):
        raise CheckFailed("train_step must return a dict with loss, grad_norm, lr and tokens "
                          f"(the training loop logs them); got {stats!r:.80}")
    if len(drawn) != 2:
        raise CheckFailed(f"with grad_accum_steps=2 train_step drew {len(drawn)} micro-batches: "
                          "run forward and backward on one batch per micro-step, "
                          "grad_accum_steps of them per optimizer step")
    if trainer.model.forwards == 0:
        raise CheckFailed("the forward pass did not go through self.model: under DDP that is "
                          "the wrapper whose backward averages the gradients across processes; "
                          "self.raw_model would skip it")
    if syncs != [False, True]:
        raise CheckFailed(
            f"self._grad_sync was entered with last_micro_step={syncs}, expected [False, True]: "
            "run each micro-batch's forward and backward inside "
            "`with self._grad_sync(last_micro_step=micro_step == accum - 1):`, so that under DDP "
            "only the last backward all-reduces the gradients")
    passed.append("two micro-batches, through self.model, gradients synchronised on the last")

    if trainer.step != 1:
        raise CheckFailed(f"after one train_step self.step is {trainer.step}, expected 1: "
                          "count the optimizer steps (get_lr and checkpoints read self.step)")
    if stats["lr"] != reference.get_lr(0) or any(
            g["lr"] != reference.get_lr(0) for g in trainer.optimizer.param_groups):
        raise CheckFailed(
            f"at step 0 the optimizer's lr is {trainer.optimizer.param_groups[0]['lr']:.4g} "
            f"(reported {stats['lr']:.4g}), expected get_lr(0) = {reference.get_lr(0):.4g}: "
            "before optimizer.step(), set group['lr'] = self.get_lr(self.step) for every group "
            "in self.optimizer.param_groups")
    passed.append("the scheduled lr is set on every parameter group; self.step counts steps")

    for clip, expect in ((0.01, "0.01"), (0.0, "the unclipped norm")):
        clipped = _trainer(cls, learner, grad_clip=clip)
        seen = []
        step = clipped.optimizer.step

        def recording_step(*args, _step=step, _opt=clipped.optimizer, **kwargs):
            grads = [p.grad.norm() for g in _opt.param_groups for p in g["params"]
                     if p.grad is not None]
            seen.append(torch.stack(grads).norm().item() if grads else 0.0)
            return _step(*args, **kwargs)

        clipped.optimizer.step = recording_step
        out = clipped.train_step(iter([batch[:4]]))
        target = clip if clip else out["grad_norm"]
        if not seen or not math.isclose(seen[0], target, rel_tol=1e-3):
            if clip:
                why = ("clip after the last backward and before optimizer.step(): "
                       "torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)")
            else:
                why = ("grad_clip=0 turns clipping off (see TrainConfig); clip_grad_norm_ with "
                       "max_norm 0 would zero every gradient: pass math.inf instead")
            raise CheckFailed(f"with grad_clip={clip} the optimizer saw gradients of norm "
                              f"{f'{seen[0]:.4f}' if seen else 'none'} (expected {expect}): "
                              f"{why}")
    passed.append("gradients clipped to grad_clip before the step; grad_clip=0 means no clipping")

    if not math.isclose(stats["grad_norm"], expected["grad_norm"], rel_tol=1e-4):
        ratio = stats["grad_norm"] / expected["grad_norm"]
        why = ("compute it with clip_grad_norm_ after the LAST backward, before the step: it "
               "returns the norm before clipping")
        if math.isclose(ratio, 2.0, rel_tol=1e-3):
            why = ("that is grad_accum_steps times too large: backward() ADDS into .grad, so "
                   "divide each micro-batch's loss by grad_accum_steps before backward(); the "
                   "summed gradients are then the mean over the whole batch")
        raise CheckFailed(f"your gradient norm is {stats['grad_norm']:.4f} ({ratio:.2f}x) where "
                          f"one batch of 8 gives {expected['grad_norm']:.4f}: {why}")
    if not math.isclose(stats["loss"], expected["loss"], rel_tol=1e-5):
        raise CheckFailed(f"your reported loss is {stats['loss']:.4f}, expected "
                          f"{expected['loss']:.4f}: report the mean of the micro-batches' "
                          "(unscaled) losses")
    if stats["tokens"] != 8 * 16:
        raise CheckFailed(f"tokens = {stats['tokens']}, expected 2 micro-batches x 4 sequences x "
                          "16 targets = 128 (times world_size): count the targets trained on")
    for (name, p), q in zip(trainer.raw_model.named_parameters(),
                            reference.raw_model.parameters()):
        # Not bit-identical: two half-batch gradients are summed in a different order than
        # one backward over 8 sequences (~1e-6 here); a real mistake moves weights by ~lr = 1e-3.
        if not torch.allclose(p, q, rtol=0, atol=1e-5):
            raise CheckFailed(f"after one step {name} differs from one step on the whole batch "
                              f"by {_max_diff(p, q):.3g}: accumulate, clip, optimizer.step()")
    passed.append("2 x 4 sequences accumulated = one step on 8: same loss, gradient norm, weights")

    second = trainer.train_step(micro_batches(batch[4:], batch[:4]))
    reference.train_step(iter([batch]))
    for (name, p), q in zip(trainer.raw_model.named_parameters(),
                            reference.raw_model.parameters()):
        if not torch.allclose(p, q, rtol=0, atol=1e-5):
            raise CheckFailed(
                f"the second step differs ({name} by {_max_diff(p, q):.3g}) though the first "
                "matched: the first step's gradients were still in .grad; clear them after the "
                "step with self.optimizer.zero_grad(set_to_none=True)")
    if second["lr"] != reference.get_lr(1):
        raise CheckFailed(f"the second step used lr {second['lr']:.4g}, expected get_lr(1) = "
                          f"{reference.get_lr(1):.4g}: read the lr for self.step each call")
    passed.append("a second step starts from clean gradients and the next lr")

    return passed


# ---------------------------------------------------------------- exercise 11: checkpoints


def check_checkpoint(learner: ModuleType) -> list[str]:
    import tempfile
    from pathlib import Path

    cls = _trainer_class(learner, "save_checkpoint", "load_checkpoint", wrapper=_Wrapper)
    passed = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        first = _trainer(cls, learner)
        batches = first.micro_batches()
        for _ in range(3):
            first.train_step(batches)
        first.save_checkpoint(path)
        if not path.is_file():
            raise CheckFailed(f"save_checkpoint({path}) wrote no file there")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the learner may have saved anything
            raise CheckFailed(
                "torch.load(path, weights_only=True) refuses your checkpoint "
                f"({str(err).splitlines()[0][:120]}): save only tensors, numbers, strings and "
                "plain dicts/lists (config.to_dict(), asdict(train_config)), never objects; "
                "weights_only loading exists because unpickling objects can run any code"
            ) from None
        if not isinstance(state, dict):
            raise CheckFailed("save a dict: {'model': ..., 'optimizer': ..., 'step': ...}")
        model_state = next((v for v in state.values() if isinstance(v, dict) and v
                            and all(isinstance(t, torch.Tensor) for t in v.values())
                            and any("embed_tokens" in k for k in v)), None)
        if model_state is None:
            raise CheckFailed("your checkpoint holds no model state_dict: save "
                              "unwrap_model(self.model).state_dict()")
        if any(k.startswith("module.") for k in model_state):
            raise CheckFailed(
                "the saved model keys start with 'module.' (e.g. "
                f"{next(iter(model_state))}): that is the DDP wrapper's state_dict, which only "
                "another wrapped model can load; save unwrap_model(self.model).state_dict()")
        passed.append("loads with weights_only=True; model keys without the DDP 'module.' prefix")

        after_save = [first.train_step(batches)["loss"] for _ in range(3)]

        for wrapped in (True, False):
            second = _trainer(cls if wrapped else _trainer_class(
                learner, "save_checkpoint", "load_checkpoint"), learner)
            fresh = {n: p.detach().clone() for n, p in second.raw_model.named_parameters()}
            loaded = second.load_checkpoint(path)
            if second.step != 3:
                raise CheckFailed(f"after load_checkpoint self.step is {second.step}, expected "
                                  "3: restore the step, or the lr schedule restarts from warmup")
            saved = {k: v for k, v in model_state.items()}
            for n, p in second.raw_model.named_parameters():
                if not torch.equal(p, saved[n]):
                    raise CheckFailed(f"after load_checkpoint {n} does not hold the saved weights"
                                      + (" (it still holds the fresh init)"
                                         if torch.equal(p, fresh[n]) else "")
                                      + ": unwrap_model(self.model).load_state_dict(...)")
            if not second.optimizer.state_dict()["state"]:
                raise CheckFailed("after load_checkpoint the optimizer has no state: save and "
                                  "load self.optimizer.state_dict(), AdamW's moment estimates, or "
                                  "the resumed run takes different steps")
            second_sampler = second.sampler.state_dict()
            resumed = [second.train_step(second.micro_batches())["loss"] for _ in range(3)]
            if resumed != after_save:
                why = ("weights, optimizer and step are back, yet the losses differ: restore "
                       "everything a step depends on (RNG states too)")
                if second_sampler["batches_drawn"] != 3:
                    why = ("the resumed run reads different batches: restore the data position "
                           "too, save self.sampler.state_dict() and load it back with "
                           "self.sampler.load_state_dict(...)")
                raise CheckFailed(f"the resumed run's losses {[round(x, 5) for x in resumed]} "
                                  f"differ from the unbroken run's "
                                  f"{[round(x, 5) for x in after_save]}: {why}")
            if not (isinstance(loaded, dict) and "train_config" in loaded):
                raise CheckFailed("load_checkpoint must return the loaded state, with its "
                                  "train_config: main() compares it with the current settings")
        passed.append("a resumed run continues exactly like the unbroken one "
                      "(into a wrapped and a bare model)")
    return passed


# ---------------------------------------------------------------- phase 3: the FSDP trainer
#
# As in phase 2, each check runs the learner's method inside the solution's trainer. Exercises
# 12 and 13 are pure functions of the settings; 14 runs FSDP2 for real in a process group of
# one; 15 gathers shards, so it runs on two processes.

FSDP_EXERCISE_METHODS = ("_get_sharding_strategy", "_get_mixed_precision_policy",
                         "_get_fsdp_policy", "save_checkpoint")


def _fsdp_trainer_class(learner: ModuleType, *mine: str, **overrides) -> type:
    """The learner's FSDPTrainer, their methods `mine`, the solution's for the others."""
    from snippets.training import fsdp_trainer

    solution = fsdp_trainer.FSDPTrainer
    namespace = {name: getattr(solution, name) for name in FSDP_EXERCISE_METHODS
                 if name not in mine}
    namespace["log"] = lambda self, message: None
    namespace.update(overrides)
    return type("CheckedFSDPTrainer", (learner.FSDPTrainer,), namespace)


def _fsdp_trainer(cls: type, module: ModuleType, world_size: int = 1, **fsdp):
    train = module.TrainConfig(batch_size=4 // world_size, seq_len=16, max_steps=20,
                               warmup_steps=3, lr=1e-3, data="dummy")
    return cls(ref.get_config("tiny", max_position_embeddings=16), train,
               module.FSDPConfig(**fsdp), "cpu")


@contextlib.contextmanager
def _process_group_of_one():
    """FSDP2 needs a process group even for one process: an in-memory one, removed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- exercise 12: strategies


def check_sharding_strategy(learner: ModuleType) -> list[str]:
    # The mesh is recorded, not built: the mapping is what this exercise is about.
    cls = _fsdp_trainer_class(learner, "_get_sharding_strategy",
                              _device_mesh=lambda self, replicas, shards: (replicas, shards))
    world, group = 8, 4
    expected = {"FULL_SHARD": ((1, 8), True), "SHARD_GRAD_OP": ((1, 8), False),
                "NO_SHARD": ((8, 1), None), "HYBRID_SHARD": ((2, 4), True)}
    meaning = {
        "FULL_SHARD": "ZeRO-3: every rank holds 1/8 of everything, and the parameters gathered "
                      "for forward are freed right after it (all-gathered again for backward)",
        "SHARD_GRAD_OP": "ZeRO-2: sharded over all 8 ranks like FULL_SHARD, but the gathered "
                         "parameters stay from forward to backward, saving the second "
                         "all-gather at the cost of memory",
        "NO_SHARD": "DDP: 8 replicas of one rank each, a (8, 1) mesh; nothing is sharded and "
                    "the gradients are all-reduced",
        "HYBRID_SHARD": "HSDP: the 8 ranks form 2 groups (nodes) of shard_group_size=4; each "
                        "group shards one copy, the groups are replicas: mesh (2, 4)",
    }
    for name, (mesh, reshard) in expected.items():
        trainer = cls.__new__(cls)
        trainer.world_size = world
        trainer.fsdp_config = learner.FSDPConfig(sharding_strategy=name, shard_group_size=group)
        try:
            got = trainer._get_sharding_strategy()
        except (RuntimeError, ValueError) as err:
            if "process group" in str(err) or "init_process_group" in str(err):
                raise CheckFailed(f"for {name} your code built a device mesh itself "
                                  f"({str(err).splitlines()[0][:80]}): return "
                                  "self._device_mesh(replicas, shards), which builds it for "
                                  "the trainer's device") from None
            raise
        if not isinstance(got, dict) or set(got) != {"mesh", "reshard_after_forward"}:
            raise CheckFailed(f"for {name} _get_sharding_strategy returned {got!r:.80}; return "
                              "a dict with two keys, 'mesh' and 'reshard_after_forward' "
                              "(fully_shard's keyword arguments)")
        where = f"with world_size={world}, shard_group_size={group}, {name}"
        if got["mesh"] != mesh:
            why = meaning[name]
            if name == "HYBRID_SHARD" and got["mesh"] == (4, 2):
                why = ("you swapped the two sizes: the mesh is (replicas, shards), and a group "
                       "of shard_group_size=4 ranks (a node) shards one copy. Sharding across "
                       "nodes instead would send every all-gather over the slow network")
            elif name == "HYBRID_SHARD" and got["mesh"] == (1, 8):
                why = ("that is FULL_SHARD over all 8 ranks; HYBRID_SHARD shards within groups "
                       "of self.shard_group_size and replicates across them")
            raise CheckFailed(f"{where} asked for a mesh of (replicas, shards) = {got['mesh']}, "
                              f"expected {mesh}: {why}")
        if reshard is not None and got["reshard_after_forward"] is not reshard:
            raise CheckFailed(f"{where} gave reshard_after_forward="
                              f"{got['reshard_after_forward']!r}, expected {reshard}: "
                              f"{meaning[name]}")
    passed = ["FULL_SHARD and SHARD_GRAD_OP shard over all ranks; only FULL_SHARD frees the "
              "gathered parameters after forward",
              "NO_SHARD is a (world, 1) mesh (DDP); HYBRID_SHARD is (nodes, ranks per node)"]
    return passed


# ---------------------------------------------------------------- exercise 13: precision


def _record_compute_dtype(trainer) -> list:
    seen = []
    trainer.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: seen.append(module.weight.dtype))
    return seen


def check_mixed_precision_policy(learner: ModuleType) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cls = _fsdp_trainer_class(learner, "_get_mixed_precision_policy")
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for name, dtype in expected.items():
        trainer = cls.__new__(cls)
        trainer.fsdp_config = learner.FSDPConfig(mixed_precision=name)
        policy = trainer._get_mixed_precision_policy()
        if not isinstance(policy, MixedPrecisionPolicy):
            raise CheckFailed(f"for {name!r} you returned {type(policy).__name__}; return a "
                              "torch.distributed.fsdp.MixedPrecisionPolicy")
        compute = policy.param_dtype or torch.float32
        if compute != dtype:
            raise CheckFailed(f"for {name!r} the policy computes in "
                              f"{str(compute).removeprefix('torch.')}, expected "
                              f"{str(dtype).removeprefix('torch.')}: param_dtype is the dtype "
                              "the all-gathered parameters are cast to for forward and backward")
        reduce = policy.reduce_dtype or compute
        if reduce != torch.float32:
            raise CheckFailed(
                f"for {name!r} gradients are reduced in {str(reduce).removeprefix('torch.')} "
                "(reduce_dtype, which defaults to param_dtype): set reduce_dtype=torch.float32. "
                "Averaging over ranks adds N gradients; in 16 bits every partial sum is rounded "
                "to 8 (bf16) or 11 (fp16) significant bits, and small gradients vanish")
    passed = ["bf16 and fp16 compute in 16 bits, fp32 in 32; gradients always reduced in fp32"]

    trainer = cls.__new__(cls)
    trainer.fsdp_config = learner.FSDPConfig()
    trainer.fsdp_config.mixed_precision = "fp8"  # past FSDPConfig's own validation
    try:
        policy = trainer._get_mixed_precision_policy()
    except ValueError as err:  # ConfigError is a ValueError
        if not all(n in str(err) for n in expected):
            raise CheckFailed(f"for an unknown name your error says {str(err)!r}: name the "
                              "valid choices, bf16, fp16 and fp32") from None
    else:
        raise CheckFailed(f"for mixed_precision='fp8' you returned {policy!r:.60}: raise a "
                          "ConfigError naming the valid choices instead of training in "
                          "something nobody asked for")
    passed.append("an unknown name raises an error listing bf16, fp16, fp32")

    with _process_group_of_one():
        trainer = _fsdp_trainer(cls, learner, mixed_precision="bf16")
        seen = _record_compute_dtype(trainer)
        stats = trainer.train_step(trainer.micro_batches())
        stored = {p.dtype for p in trainer.model.parameters()}
    if seen[0] != torch.bfloat16 or stored != {torch.float32} or not math.isfinite(
            stats["loss"]):
        raise CheckFailed(f"training one step with bf16: the block computed with "
                          f"{seen[0]} weights and the shards are stored as {stored} (expected "
                          "bfloat16 and float32)")
    passed.append("a real bf16 training step: bf16 weights in the block, fp32 shards updated")
    return passed


# ---------------------------------------------------------------- exercise 14: FSDP units


def check_fsdp_policy(learner: ModuleType) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    cls = _fsdp_trainer_class(learner, "_get_fsdp_policy")
    quiet = type("Plain", (_ref_trainer().DistributedTrainer,), {"log": lambda self, m: None})
    fresh = ref.GPT(ref.get_config("tiny"))
    order = cls._get_fsdp_policy(cls.__new__(cls), fresh)
    if not isinstance(order, (list, tuple)) or not all(isinstance(m, nn.Module) for m in order):
        raise CheckFailed(f"_get_fsdp_policy returned {order!r:.80}; return a list of modules, "
                          "each of which becomes an FSDP unit")
    if fresh in order and any(isinstance(m, ref.Block) for m in order[order.index(fresh):]):
        raise CheckFailed(
            "the model comes first in your list, before blocks: fully_shard(model) claims "
            "every parameter not yet in a unit, the blocks' included, so applied first it "
            "leaves the blocks nothing (and FSDP fails or trains the blocks as one piece). "
            "Apply it bottom-up: the blocks first, the model itself last")
    with _process_group_of_one():
        try:
            trainer = _fsdp_trainer(cls, learner)
        except (TypeError, AssertionError, RuntimeError, ValueError) as err:
            raise CheckFailed(f"applying fully_shard to your units raised "
                              f"{type(err).__name__}: {str(err)[:160]}") from None
        model = trainer.model
        units = [name or "the model" for name, m in model.named_modules()
                 if isinstance(m, FSDPModule)]
        blocks = [f"layers.{i}" for i in range(len(model.layers))]
        extra = [u for u in units if u not in blocks and u != "the model"]
        if extra:
            raise CheckFailed(
                f"you made {len(units)} FSDP units ({', '.join(extra[:3])}, ...): units "
                "smaller than a block mean one all-gather and one reduce-scatter per unit and "
                "step, each a small message paying the collective's start-up cost. One unit "
                "per Block, then the model")
        if not isinstance(model, FSDPModule):
            raise CheckFailed(
                f"your FSDP units are {units}, without the model itself: embed_tokens (tied to "
                "lm_head) and the final norm stay ordinary tensors, a full copy on every rank, "
                "and nothing averages their gradients over the ranks, so the replicas drift "
                "apart. End the list with the model: fully_shard(model) takes what the blocks "
                "did not")
        if not all(b in units for b in blocks):
            raise CheckFailed(
                f"your FSDP units are {units}: with no unit per Block the whole model is "
                "all-gathered at once when forward starts, so every rank holds all of it at "
                "the peak (FSDP saves nothing there) and no gathering overlaps computation. "
                "Put each transformer Block in the list, then the model")
        passed = [f"units: {', '.join(blocks)} and the model itself, applied bottom-up"]

        solution = _ref_trainer()
        reference = quiet(ref.get_config("tiny", max_position_embeddings=16),
                          solution.TrainConfig(batch_size=4, seq_len=16, max_steps=20,
                                               warmup_steps=3, lr=1e-3, data="dummy"))
        batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
        ours, theirs = trainer.train_step(iter([batch])), reference.train_step(iter([batch]))
        plain = dict(reference.raw_model.named_parameters())
        for name, p in model.named_parameters():
            # A process group of one: FSDP's gather and average are copies, so one step
            # matches plain training up to the order of additions (~1e-7).
            if not torch.allclose(p.full_tensor(), plain[name], rtol=0, atol=1e-6):
                raise CheckFailed(f"after one step {name} differs from plain training by "
                                  f"{_max_diff(p.full_tensor(), plain[name]):.3g}")
        if not math.isclose(ours["loss"], theirs["loss"], rel_tol=1e-6):
            raise CheckFailed(f"the sharded model's loss {ours['loss']:.5f} differs from the "
                              f"plain model's {theirs['loss']:.5f}")
    passed.append("one training step of the sharded model equals one step of the plain model")
    return passed


# ---------------------------------------------------------------- exercise 15: checkpoint


def _fsdp_checkpoint_worker(rank: int, world_size: int, learner_path: str, tmp: str) -> dict:
    """Runs in each of two processes: train, save with the learner's save_checkpoint, resume
    with the solution's load_checkpoint. Returns facts; the parent judges them, so that no
    rank stops early and leaves the other waiting in a collective."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from snippets.exercises.runner import _describe, load_learner_module

    path = Path(learner_path)
    learner = load_learner_module(path)
    writers = []
    save_atomic = learner.save_atomic

    def recording_save(target, state):
        writers.append(rank)
        return save_atomic(target, state)

    learner.save_atomic = recording_save
    cls = _fsdp_trainer_class(learner, "save_checkpoint")
    full = StateDictOptions(full_state_dict=True)
    ckpt = f"{tmp}/ckpt.pt"
    try:
        trainer = _fsdp_trainer(cls, learner, world_size)
        batches = trainer.micro_batches()
        for _ in range(2):
            trainer.train_step(batches)
        returned = trainer.save_checkpoint(ckpt)
        torch.distributed.barrier()
        at_save = get_model_state_dict(trainer.model, options=full)
        trainer.train_step(batches)
        unbroken = get_model_state_dict(trainer.model, options=full)
    except Exception as err:  # noqa: BLE001 - the learner's code may raise anything
        raise RuntimeError(f"LEARNER: {_describe(err, path)}") from None
    facts = {"writers": writers, "returned": returned is not None}
    try:
        resumed = _fsdp_trainer(cls, learner, world_size)
        resumed.load_checkpoint(ckpt)
        resumed.train_step(resumed.micro_batches())
        after = get_model_state_dict(resumed.model, options=full)
        facts["resumed equal"] = all(torch.equal(after[k], unbroken[k]) for k in unbroken)
    except Exception as err:  # noqa: BLE001 - the loader rejects what the learner wrote
        facts["load error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    if rank == 0:
        facts["at save"] = {k: v.clone() for k, v in at_save.items()}
    return facts


def check_fsdp_checkpoint(learner: ModuleType) -> list[str]:
    import tempfile
    from pathlib import Path

    from snippets.dist import spawn

    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = spawn(_fsdp_checkpoint_worker, 2, learner.__file__, tmp, timeout_s=30)
        except (RuntimeError, TimeoutError) as err:
            text = str(err)
            if "LEARNER: " in text:
                raise CheckFailed("on 2 processes your code raised "
                                  + text.split("LEARNER: ", 1)[1].strip()) from None
            if "timed out" in text.lower() or "did not finish" in text:
                raise CheckFailed(
                    "a rank waited 30 s for the other in a collective: get_state_dict "
                    "all-gathers the shards, so EVERY rank must call it (only the writing "
                    "is rank 0's alone)") from None
            raise
        path = Path(tmp) / "ckpt.pt"
        if not path.is_file():
            raise CheckFailed("save_checkpoint wrote nothing at the path it was given (with 2 "
                              "processes): rank 0 must write it")
        if ranks[1]["writers"]:
            raise CheckFailed(
                "rank 1 wrote the checkpoint too: with cpu_offload=True only rank 0 receives "
                "the gathered tensors (the others get empty dicts), so rank 1's file would "
                "hold no weights and, renamed last, replace rank 0's. Return None on ranks "
                "other than 0 (if not self.is_main)")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the learner may have saved anything
            why = str(err).splitlines()[0][:100]
            if "DTensor" in str(err) or "distributed" in str(err):
                why = ("it holds DTensors: self.model.state_dict() of a sharded model is each "
                       "rank's slices. Gather them into plain tensors with get_state_dict(..., "
                       "options=StateDictOptions(full_state_dict=True, cpu_offload=True))")
            raise CheckFailed(f"torch.load(path, weights_only=True) refuses your checkpoint: "
                              f"{why}") from None
    expected = ranks[0]["at save"]
    model_state = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model_state, dict) or set(model_state) != set(expected):
        raise CheckFailed("the checkpoint's 'model' must be the full state dict, keyed like a "
                          "plain GPT's (embed_tokens.weight, layers.0...)")
    for name, value in expected.items():
        saved = model_state[name]
        if saved.shape != value.shape:
            raise CheckFailed(
                f"{name} is saved with shape {tuple(saved.shape)}, the full tensor is "
                f"{tuple(value.shape)}: you saved rank 0's shard only. Every rank holds a "
                "different slice; get_state_dict with full_state_dict=True all-gathers them")
        if not torch.equal(saved.float(), value):
            raise CheckFailed(f"{name} in the checkpoint differs from the model's weights at "
                              f"the time of saving by {_max_diff(saved, value):.3g}")
    plain = ref.GPT(ref.get_config("tiny", max_position_embeddings=16))
    plain.load_state_dict(model_state)
    passed = ["every rank gathers, rank 0 alone writes; loads with weights_only=True",
              "full, unsharded weights: they load into a plain GPT"]
    if not state.get("optimizer", {}).get("state"):
        raise CheckFailed("the checkpoint has no optimizer state: save the optimizer state "
                          "dict get_state_dict returns (AdamW's moments, gathered too)")
    if "load error" in ranks[0]:
        raise CheckFailed(f"load_checkpoint could not restore your checkpoint: "
                          f"{ranks[0]['load error']}: save the same pieces as exercise 11 "
                          "(step, sampler, rng, model_config, train_config)")
    if not all(r["resumed equal"] for r in ranks):
        raise CheckFailed("a run resumed from your checkpoint does not continue like the "
                          "unbroken run: save step, self.sampler.state_dict() and "
                          "capture_rng_state() as well")
    if not ranks[0]["returned"]:
        raise CheckFailed("save_checkpoint returned None on rank 0: return what "
                          "save_atomic(path, state) returns")
    passed.append("a run resumed from it continues exactly like the unbroken run")
    return passed
