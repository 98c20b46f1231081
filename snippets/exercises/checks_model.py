"""Checks of exercises 1-7, the model (snippets/models/gpt.py): one check per exercise, which
runs the learner's code and says, in learner terms, what is wrong.

Each check takes the learner's module (their copy of the file, imported by path) and returns
the list of things it verified; on the first problem it raises CheckFailed with a message that
says what the code did, what was expected, and the likely cause. Checks compare with the
solution modules in snippets/ (same seeds, same weights) and recognise the usual mistakes by
computing them: a result that equals "the right formula without the scaling" is reported as
that, not as "wrong numbers". The checks of the trainer (checks_trainer.py), of the FSDP trainer
(checks_fsdp.py) and of the parallelisms (checks_parallel.py and its siblings) work the same way.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F

from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


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
