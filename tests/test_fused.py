"""The fused path (snippets/models/fused.py) computes what the readable GPT computes, and the
nanoGPT yardstick (snippets/models/nanogpt.py) costs the same FLOPs per token.

The fused path only regroups the readable model's arithmetic: stacked matmuls, q's and k's rows
reordered alike, and three torch.autograd.Functions with hand-written backwards (RMSNorm, SwiGLU,
RoPE as a complex multiplication). The bound below is derived from that; a bug in the regrouping
(the halves of RoPE swapped, q and k stacked in the wrong order) moves the results by far more,
and each hand-written backward is checked against finite differences in float64 (gradcheck).
torch.compile on top of it is not run here (its first step compiles for minutes on 2 cores);
snippets/bench/fused.py records the compiled model's first loss beside the readable one's.
"""

import pytest
import torch

from snippets.models.fused import (RMSNormFunction, RotaryQKV, SwiGLUFunction, as_complex,
                                   fuse, readable_names, rotate_pairs)
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.models.nanogpt import NanoGPT, matched_to
from snippets.models.nanogpt import training_flops_per_token as nanogpt_flops
from snippets.planner.flops import matmul_params, training_flops_per_token

# Larger weights than the default 0.02: attention then prefers some positions strongly, so a
# wrong rotation changes the logits visibly, not only the q and k gradients.
CONFIG = get_config("tiny", initializer_range=0.2)
BATCH, LENGTH = 2, 16

# The bound. Both paths run the same operations on the same values in fp32; what can differ is
# the order of the terms in a sum: a stacked matmul may split its K-sum into blocks differently
# from three small ones, q . k adds its head_dim products in another order (q's and k's features
# are reordered alike), RMSNorm takes its mean of squares as a norm (a sum in its own order,
# then a square root squared: two roundings more), its backward takes LayerNorm's kernel's sums
# over the hidden size and adds back one of them computed again by a matrix-vector product
# (the two differ by a reordering of that sum), RoPE's complex multiplication may round
# x1 cos - x2 sin as one fused multiply-add (a sum of two terms), and the gradients of the
# stacked weights come out of one matmul instead of three. Reordering a sum of K fp32 terms
# moves it by at most 2 (K - 1) u times the sum of their magnitudes, u = 2^-24 (each order is
# within (K - 1) u of the exact sum). The longest sums here: the vocabulary (256, the logits'
# gradient with respect to the hidden state, and the softmax), then intermediate_size (172),
# the tokens of a batch (32, weight gradients). A value is reached through at most
# 2 * layers + 1 such sums in sequence forward (each block's attention and MLP, then the head)
# and as many again backward, and first-order errors add along the chain. We take the sum of
# magnitudes to be of the order of the largest value of the tensor compared (the weights are
# random, so the sums do not cancel systematically), which gives, relative to that value:
U = 2.0 ** -24
K = max(CONFIG.vocab_size, CONFIG.intermediate_size, CONFIG.hidden_size, BATCH * LENGTH)
CHAIN = 2 * (2 * CONFIG.num_hidden_layers + 1)
TOLERANCE = CHAIN * 2 * (K - 1) * U  # 3.0e-4 for the tiny config; measured: under 1e-6


def readable_and_fused(config=CONFIG):
    torch.manual_seed(0)
    readable = GPT(config)
    torch.manual_seed(0)
    fused = fuse(GPT(config))
    return readable, fused


def batch(config=CONFIG, seed=0):
    g = torch.Generator().manual_seed(seed)
    return shift_for_next_token(torch.randint(0, config.vocab_size, (BATCH, LENGTH + 1),
                                              generator=g))


def assert_close(actual, expected, what):
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE * scale, (
        f"{what}: largest difference {error:.2e} > {TOLERANCE:.1e} x largest value {scale:.2e}")


@pytest.mark.parametrize("path", ["eager", "compile"])
def test_fused_equals_readable_forward_loss_and_every_gradient(path, monkeypatch):
    # "compile": the ops the fused modules take under torch.compile (F.rms_norm, SwiGLU and
    # RoPE in plain real arithmetic), run here in eager: the same math Inductor compiles,
    # without minutes of compiling.
    if path == "compile":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    readable, fused = readable_and_fused()
    inputs, targets = batch()
    logits, loss = readable(inputs, targets)
    fused_logits, fused_loss = fused(inputs, targets)
    assert_close(fused_logits, logits, "logits")
    assert_close(fused_loss, loss, "loss")
    loss.backward()
    fused_loss.backward()
    expected = {name: p.grad for name, p in readable.named_parameters()}
    actual = readable_names({name: p.grad for name, p in fused.named_parameters()},
                            CONFIG.head_dim)
    assert sorted(actual) == sorted(expected)  # every readable parameter has its gradient
    for name, grad in expected.items():
        assert grad.abs().max() > 0, f"{name} has no gradient to compare"
        assert_close(actual[name], grad, f"gradient of {name}")


def test_fused_trains_under_bf16_autocast(monkeypatch):
    # Complex numbers exist for fp16, fp32 and fp64, not bf16: with q, k and v in bf16, RoPE
    # must take the real-arithmetic rotation (CPU autocast happens to cast view_as_complex to
    # fp32, CUDA's lists may not: the rule is the dtype, on every device).
    monkeypatch.setattr(torch, "view_as_complex", lambda x: pytest.fail("complex bf16"))
    _, fused = readable_and_fused()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = fused(*batch())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in fused.parameters())


def test_fused_has_fewer_larger_matmuls_and_the_same_weights():
    readable, fused = readable_and_fused()
    block = fused.layers[0]
    assert block.self_attn.qkv_proj.weight.shape == (3 * CONFIG.hidden_size, CONFIG.hidden_size)
    assert block.mlp.gate_up_proj.weight.shape == (2 * CONFIG.intermediate_size,
                                                   CONFIG.hidden_size)
    assert readable.num_parameters() == sum(p.numel() for p in fused.parameters())
    # The fused model's weights, renamed, load into a readable GPT: they are the same numbers.
    state = readable_names(fused.state_dict(), CONFIG.head_dim)
    assert all(torch.equal(state[k], v) for k, v in readable.state_dict().items())
    GPT(CONFIG).load_state_dict(state)


def test_fused_path_refuses_written_out_attention():
    with pytest.raises(ValueError, match="sdpa"):
        fuse(GPT(get_config("tiny", attn_implementation="eager")))


@pytest.mark.parametrize("name", ["tiny", "small", "medium"])
def test_nanogpt_matches_the_course_flops_per_token(name):
    config = get_config(name)
    seq_len = config.max_position_embeddings
    nano = matched_to(config)
    assert nanogpt_flops(nano, seq_len) == training_flops_per_token(config, seq_len)
    # And both formulas count the matmul weights the models really have (the embedding and
    # position tables are lookups, not matmuls; the head is tied to the embedding, counted once).
    def linear_weights(model, head):
        blocks = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m is not head)
        return blocks + head.weight.numel()
    course = GPT(config)
    assert linear_weights(course, course.lm_head) == matmul_params(config)
    model = NanoGPT(nano)
    nano_matmul = (nanogpt_flops(nano, seq_len) - 12 * nano.n_layer * seq_len * nano.n_embd) // 6
    assert linear_weights(model, model.lm_head) == nano_matmul


def test_nanogpt_trains_from_a_uniform_start():
    config = get_config("tiny")
    torch.manual_seed(0)
    model = NanoGPT(matched_to(config))
    inputs, targets = batch(config)
    logits, loss = model(inputs, targets)
    assert logits.shape == (BATCH, LENGTH, config.vocab_size)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1  # near ln(vocab)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_rms_norm_is_composite_on_the_cpu():
    """Why the fused path writes RMSNorm's backward itself: in the pinned torch, F.rms_norm on
    the CPU is built from pow, mean, rsqrt and mul, so autograd walks back through each; and why
    it still costs more than LayerNorm (Session B's slides, the ablation)."""
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.nn.functional.rms_norm(x, (8,), torch.ones(8), 1e-5)
    assert y.grad_fn.name() == "MulBackward0"
    # No CPU kernel for RMSNorm itself, forward or backward; LayerNorm has one each way.
    def cpu_kernel(op):
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU")
    assert not any(map(cpu_kernel, ("rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward")))
    assert cpu_kernel("native_layer_norm") and cpu_kernel("native_layer_norm_backward")


# Each hand-written backward against finite differences, in float64 where they are exact
# enough to compare. Small shapes: gradcheck perturbs every input element one at a time.
def test_rms_norm_backward_matches_finite_differences():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-5), (x, weight))


def test_swiglu_backward_matches_finite_differences():
    gate_up = torch.randn(2, 3, 2 * 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (gate_up,))


def rotary_inputs(B=2, T=3, heads=2, head_dim=4):
    qkv = torch.randn(B, T, 3, heads, head_dim, dtype=torch.float64, requires_grad=True)
    table = torch.randn(T, heads, head_dim, dtype=torch.float64)  # any complex numbers will do
    return qkv, table


def test_rotary_backward_matches_finite_differences():
    assert torch.autograd.gradcheck(RotaryQKV.apply, rotary_inputs())


def test_the_compiled_rotation_in_real_numbers_equals_the_complex_one():
    """What torch.compile runs instead of RotaryQKV (Inductor has no complex numbers)."""
    qkv, table = rotary_inputs()
    real = torch.cat((rotate_pairs(qkv[:, :, :2], table.unsqueeze(1)), qkv[:, :, 2:]), dim=2)
    for expected, actual in zip(RotaryQKV.apply(qkv, table), real.transpose(1, 3).unbind(2)):
        torch.testing.assert_close(actual, expected)


def test_gradcheck_catches_a_rotation_backward_with_the_wrong_sign():
    """The check has teeth: rotating the gradient on instead of back (the table where its
    conjugate belongs: the sine's sign wrong) fails it."""

    class WrongSign(RotaryQKV):
        @staticmethod
        def backward(ctx, grad_q, grad_k, grad_v):
            (table,) = ctx.saved_tensors
            grad = torch.stack([g.transpose(1, 2) for g in (grad_q, grad_k, grad_v)], dim=2)
            rotated = as_complex(grad[:, :, :2]) * as_complex(table).unsqueeze(1)  # no .conj()
            grad[:, :, :2] = torch.view_as_real(rotated).flatten(-2)
            return grad, None

    assert not torch.autograd.gradcheck(WrongSign.apply, rotary_inputs(), raise_exception=False)


def test_bench_only_without_merge_refuses_to_drop_other_results(tmp_path, monkeypatch):
    import json

    from snippets.bench import __main__ as bench_main

    (tmp_path / "quick_bench.py").write_text("def run():\n    return {'ran': True}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench_main, "BENCHMARKS", ["quick_bench"])
    out = tmp_path / "bench.json"
    out.write_text(json.dumps({"results": {"other": {"kept": 1}, "quick_bench": {}}}))
    with pytest.raises(SystemExit, match="--only without --merge would drop other from"):
        bench_main.main(["--only", "quick", "--out", str(out)])
    assert json.loads(out.read_text())["results"]["other"] == {"kept": 1}
    out.write_text(json.dumps({"results": {"quick_bench": {}}}))  # only its own: replaced
    bench_main.main(["--only", "quick", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == {"quick_bench": {"ran": True}}


def test_bench_merge_replaces_only_the_results_it_ran(tmp_path, monkeypatch):
    """`python -m snippets.bench --only fused --merge` adds this benchmark to a bench.json
    written elsewhere without discarding the other results or their machine record."""
    import json

    from snippets.bench import __main__ as bench_main

    (tmp_path / "quick_bench.py").write_text("def run():\n    return {'ran': True}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench_main, "BENCHMARKS", ["quick_bench"])
    out = tmp_path / "bench.json"
    before = {"date": "then", "machine": {"cpu": "elsewhere"},
              "results": {"other": {"kept": 1}, "quick_bench": {"ran": False}}}
    out.write_text(json.dumps(before))
    bench_main.main(["--only", "quick", "--merge", "--out", str(out)])
    after = json.loads(out.read_text())
    assert after["results"] == {"other": {"kept": 1}, "quick_bench": {"ran": True}}
    assert (after["date"], after["machine"]) == ("then", {"cpu": "elsewhere"})
    assert [m["result"] for m in after["merged"]] == ["quick_bench"]
    out.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):  # refused before anything runs
        bench_main.main(["--only", "quick", "--merge", "--out", str(out)])
    assert out.read_text() == "{not json"


def test_bench_measures_every_variant_at_equal_flops():
    """snippets/bench/fused.py at the tiny config, one round of two races, without compiling:
    every variant timed, FLOPs per token equal, each ratio inside its range over the races, and
    the readable and fused first losses within the bound."""
    from snippets.bench.fused import measure

    result = measure("tiny", batch_size=2, repeats=1, compile=False, races=2)
    flops = result["training_flops_per_token"]
    assert flops["course_gpt"] == flops["nanogpt"]
    assert set(result["ratio_to_nanogpt"]) == {"readable", "fused", "nanogpt",
                                                "fused_layernorm_no_rope"}
    assert all(ms > 0 for ms in result["step_ms"].values())
    # Each ratio is the median of the races' ratios, inside the range kept beside it.
    for name, (low, high) in result["ratio_to_nanogpt_range"].items():
        assert low <= result["ratio_to_nanogpt"][name] <= high, (name, result)
    assert result["ratio_to_nanogpt_range"]["nanogpt"] == [1.0, 1.0]
    loss = result["first_step_loss"]
    assert abs(loss["fused"] - loss["readable"]) <= TOLERANCE * loss["readable"]


def test_the_ablation_leaves_out_only_rope_and_rmsnorm():
    """The bench's ablation (gpt2_norm_and_positions) is the fused GPT with its rotation left
    out and LayerNorm for RMSNorm, nothing else: its attention equals the fused attention with
    every rotation angle 0 (cos 1, sin 0), each LayerNorm has the fused norm's own weight and
    eps, and every weight is the fused model's."""
    from snippets.bench.fused import AttentionWithoutRoPE, gpt2_norm_and_positions
    from snippets.models.fused import FusedAttention, FusedRMSNorm

    _, fused = readable_and_fused()
    attn = fused.layers[0].self_attn
    x = torch.randn(BATCH, LENGTH, CONFIG.hidden_size)
    unrotated = AttentionWithoutRoPE(attn)(x)
    attn.rope_rotation.unflatten(-1, (-1, 2))[..., 0] = 1.0  # cos of angle 0
    attn.rope_rotation.unflatten(-1, (-1, 2))[..., 1] = 0.0  # sin of angle 0
    with torch.no_grad():
        assert_close(unrotated, attn(x), "attention without RoPE")
    _, fused = readable_and_fused()
    weights = {id(p) for p in fused.parameters()}
    norm_weights = [id(m.weight) for m in fused.modules() if isinstance(m, FusedRMSNorm)]
    ablated = gpt2_norm_and_positions(fused)
    assert {id(p) for p in ablated.parameters()} == weights
    assert not any(isinstance(m, (FusedRMSNorm, FusedAttention)) for m in ablated.modules())
    norms = [m for m in ablated.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert [id(n.weight) for n in norms] == norm_weights
    assert len(norms) == 2 * CONFIG.num_hidden_layers + 1
    assert all(n.bias is None and n.eps == CONFIG.rms_norm_eps for n in norms)
    _, loss = ablated(*batch())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in ablated.parameters())


def test_the_pages_verdict_follows_the_recorded_bench():
    """Session B's slides and the profiling page say, in words, what bench.json's fused result
    shows: eager, the fused GPT ties with nanoGPT's model-FLOP throughput at the medium config
    (its range over the races includes 1) and is behind it at the small one (its whole range
    below 1), and beats the readable GPT at both; the ablation (LayerNorm, no RoPE) is ahead of
    the fused GPT at the small config and ties with nanoGPT; compiling shortens the fused step
    and raises its ratio at both configs, and gains nanoGPT less. A new bench run that changes
    any of these makes the words wrong; this test fails then, so the sentences are rewritten
    with the new run."""
    import json
    from pathlib import Path

    fused = json.loads((Path(__file__).parents[1] / "bench.json").read_text())["results"]["fused"]
    ratios = {config: fused[config]["ratio_to_nanogpt"] for config in ("small", "medium")}
    ranges = {config: fused[config]["ratio_to_nanogpt_range"] for config in ("small", "medium")}
    low, high = ranges["medium"]["fused"]
    assert low <= 1.0 <= high and ranges["small"]["fused"][1] < 1.0, ranges
    assert all(r["fused"] > r["readable"] for r in ratios.values()), ratios
    low, high = ranges["small"]["fused_layernorm_no_rope"]
    assert low <= 1.0 <= high, ranges
    assert ratios["small"]["fused_layernorm_no_rope"] > ratios["small"]["fused"], ratios
    for config in ("small", "medium"):
        r = ratios[config]
        assert r["fused_compiled"] > r["fused"], ratios
        assert r["fused_compiled"] / r["fused"] > r["nanogpt_compiled"], ratios
    medium = fused["medium"]["step_ms"]
    assert medium["fused_compiled"] < medium["fused"], medium
    assert ratios["medium"]["nanogpt_compiled"] < 1.05, ratios
