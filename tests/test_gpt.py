"""Behaviour of snippets/models/gpt.py: the pieces, the whole model, and the config errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snippets.models.gpt import (
    CONFIGS,
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    ConfigError,
    GPTConfig,
    RMSNorm,
    apply_rotary_pos_emb,
    get_config,
    precompute_rope,
    rotate_half,
    shift_for_next_token,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def tiny(**overrides) -> GPTConfig:
    return get_config("tiny", **overrides)


def random_tokens(config, batch=2, length=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g)


# ---------------------------------------------------------------- pieces


def test_rotate_half_on_four_numbers():
    assert torch.equal(rotate_half(torch.tensor([1, 2, 3, 4])), torch.tensor([-3, -4, 1, 2]))


def test_rotate_half_twice_is_negation():
    x = torch.randn(3, 8)
    assert torch.equal(rotate_half(rotate_half(x)), -x)


def test_rmsnorm_matches_formula_and_gives_unit_rms():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-5)
    x = 3.0 * torch.randn(4, 7, 32) + 1.0
    out = norm(x)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    # The learned gain scales each channel.
    with torch.no_grad():
        norm.weight.fill_(2.0)
    torch.testing.assert_close(norm(x), 2 * expected, rtol=1e-6, atol=1e-6)


def test_rmsnorm_keeps_input_dtype():
    norm = RMSNorm(16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16


def test_precompute_rope_shapes_and_position_zero_is_identity():
    cos, sin = precompute_rope(head_dim=16, max_positions=10, theta=10000.0)
    assert cos.shape == sin.shape == (10, 16)
    q = torch.randn(1, 1, 1, 16)
    q0, _ = apply_rotary_pos_emb(q, q, cos[:1], sin[:1])
    torch.testing.assert_close(q0, q)  # angle 0 at position 0


def test_rope_preserves_norms():
    torch.manual_seed(0)
    cos, sin = precompute_rope(head_dim=32, max_positions=50, theta=10000.0)
    q = torch.randn(2, 4, 50, 32)
    k = torch.randn(2, 4, 50, 32)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_rot.norm(dim=-1), k.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rope_dot_product_depends_only_on_relative_position():
    torch.manual_seed(0)
    head_dim = 32
    cos, sin = precompute_rope(head_dim, max_positions=200, theta=10000.0)
    q = torch.randn(head_dim)
    k = torch.randn(head_dim)

    def score(q_pos, k_pos):
        q_rot, _ = apply_rotary_pos_emb(q, q, cos[q_pos], sin[q_pos])
        _, k_rot = apply_rotary_pos_emb(k, k, cos[k_pos], sin[k_pos])
        return torch.dot(q_rot, k_rot)

    base = score(7, 3)
    for offset in (1, 20, 150):
        torch.testing.assert_close(score(7 + offset, 3 + offset), base, rtol=1e-5, atol=1e-5)
    # ...and it does depend on the distance, or the test above proves nothing.
    assert not torch.allclose(score(7, 3), score(7, 5), atol=1e-3)


def test_mlp_is_swiglu():
    torch.manual_seed(0)
    mlp = MLP(tiny())
    x = torch.randn(2, 5, 64)
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(mlp(x), expected)


def test_eager_and_sdpa_attention_agree_in_outputs_and_gradients():
    # Same math, different kernels: the fused kernel sums in a different order (blockwise
    # online softmax), so fp32 results agree to rounding, not bit for bit; hence atol 1e-5.
    torch.manual_seed(0)
    eager = CausalSelfAttention(tiny(attn_implementation="eager"))
    sdpa = CausalSelfAttention(tiny(attn_implementation="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    x = torch.randn(3, 20, 64)
    x_eager = x.clone().requires_grad_()
    x_sdpa = x.clone().requires_grad_()
    y_eager, y_sdpa = eager(x_eager), sdpa(x_sdpa)
    torch.testing.assert_close(y_eager, y_sdpa, rtol=0, atol=1e-5)
    grad_out = torch.randn_like(y_eager)
    y_eager.backward(grad_out)
    y_sdpa.backward(grad_out)
    torch.testing.assert_close(x_eager.grad, x_sdpa.grad, rtol=0, atol=1e-5)
    for (name, p_eager), p_sdpa in zip(eager.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p_eager.grad, p_sdpa.grad, rtol=0, atol=1e-5, msg=name)


def test_block_is_pre_norm_residual():
    torch.manual_seed(0)
    block = Block(tiny())
    x = torch.randn(2, 8, 64)
    h = x + block.self_attn(block.input_layernorm(x))
    expected = h + block.mlp(block.post_attention_layernorm(h))
    torch.testing.assert_close(block(x), expected)


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(attn_implementation):
    torch.manual_seed(0)
    model = GPT(tiny(attn_implementation=attn_implementation)).eval()
    ids = random_tokens(model.config, batch=2, length=24)
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % model.config.vocab_size
    with torch.no_grad():
        logits, _ = model(ids)
        logits_changed, _ = model(changed)
    assert torch.equal(logits[:, :15], logits_changed[:, :15])  # exact: no leak at all
    assert not torch.allclose(logits[:, 15:], logits_changed[:, 15:])


def test_forward_shapes_and_initial_loss_near_uniform():
    # At init the logits are small (std about initializer_range * sqrt(hidden_size) = 0.16),
    # so the prediction is nearly uniform and the loss is about ln(vocab); 0.3 leaves room
    # for that spread and for sampling noise over 64 targets.
    torch.manual_seed(0)
    model = GPT(tiny())
    inputs, targets = shift_for_next_token(random_tokens(model.config, batch=4, length=17))
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    logits, loss = model(inputs, targets)
    assert logits.shape == (4, 16, model.config.vocab_size)
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 0.3
    logits_only, no_loss = model(inputs)
    assert no_loss is None
    assert torch.equal(logits_only, logits)


def test_lm_head_is_tied_to_embeddings_unless_disabled():
    tied = GPT(tiny())
    assert tied.lm_head.weight is tied.embed_tokens.weight
    untied = GPT(tiny(tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    extra = untied.config.vocab_size * untied.config.hidden_size
    assert untied.num_parameters() == tied.num_parameters() + extra
    assert untied.num_parameters(exclude_embeddings=True) == tied.num_parameters(True)


def test_residual_output_projections_get_scaled_init():
    torch.manual_seed(0)
    config = tiny(num_hidden_layers=8, hidden_size=256, intermediate_size=688)
    model = GPT(config)
    block = model.layers[0]
    expected = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    assert block.self_attn.o_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert block.mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    q_std = block.self_attn.q_proj.weight.std().item()
    assert q_std == pytest.approx(config.initializer_range, rel=0.05)
    assert torch.equal(block.input_layernorm.weight, torch.ones(256))


def test_gradient_checkpointing_gives_identical_loss_and_gradients():
    # Recomputation replays exactly the same ops on the same inputs on CPU, so we demand
    # bitwise equality (torch.equal), not a tolerance.
    inputs, targets = shift_for_next_token(random_tokens(tiny(), batch=2, length=33))
    results = []
    for flag in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny(gradient_checkpointing=flag)).train()
        _, loss = model(inputs, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_plain, grads_plain), (loss_ckpt, grads_ckpt) = results
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        assert torch.equal(grads_plain[name], grads_ckpt[name]), name


def test_model_overfits_one_small_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    inputs, targets = shift_for_next_token(random_tokens(model.config, batch=4, length=33))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, first = model(inputs, targets)
    for _ in range(100):
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    print(f"overfit: loss {first.item():.3f} -> {loss.item():.3f}")
    assert first.item() > 5.0
    assert loss.item() < 1.0


def test_sequence_longer_than_context_raises_clear_error():
    model = GPT(tiny())
    too_long = torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(too_long)
    model(too_long[:, :-1])  # exactly the context length is fine


def test_generate_appends_tokens_and_crops_to_context():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = random_tokens(model.config, batch=2, length=60)
    out = model.generate(prompt, max_new_tokens=10, temperature=1.0, top_k=5)
    assert out.shape == (2, 70)  # ran past the 64-token context without error
    assert torch.equal(out[:, :60], prompt)
    greedy_a = model.generate(prompt, max_new_tokens=3, temperature=0.0)
    greedy_b = model.generate(prompt, max_new_tokens=3, temperature=0.0)
    assert torch.equal(greedy_a, greedy_b)


def test_top_k_one_is_greedy():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = random_tokens(model.config, batch=1, length=8)
    sampled = model.generate(prompt, max_new_tokens=5, temperature=0.7, top_k=1)
    greedy = model.generate(prompt, max_new_tokens=5, temperature=0.0)
    assert torch.equal(sampled, greedy)


# ---------------------------------------------------------------- configs


def test_named_configs_build_and_report_parameter_counts():
    for name in CONFIGS:
        config = get_config(name)
        with torch.device("meta"):  # shapes only: no memory, no init time
            model = GPT(config)
        print(f"{name}: {model.num_parameters():,} parameters")
    assert get_config("tiny") is not CONFIGS["tiny"]  # callers get a copy


def test_gpt2_small_parameter_count_is_124m_class():
    with torch.device("meta"):
        model = GPT(get_config("gpt2-small"))
    n = model.num_parameters()
    print(f"gpt2-small: {n:,} parameters ({n / 1e6:.1f}M)")
    assert abs(n - 124_000_000) <= 3_000_000


def test_config_json_loads_and_matches_tiny():
    config = get_config(REPO_ROOT / "snippets" / "models" / "config.json")
    assert config.num_hidden_layers == 2
    assert config.to_dict() == CONFIGS["tiny"].to_dict()


def test_from_json_round_trips_to_dict(tmp_path):
    path = tmp_path / "c.json"
    config = tiny(num_hidden_layers=4, attn_implementation="eager")
    path.write_text(json.dumps(config.to_dict()))
    assert GPTConfig.from_json(path) == config
    assert get_config(str(path)) == config


def test_overrides_are_validated():
    assert get_config("small", gradient_checkpointing=True).gradient_checkpointing
    with pytest.raises(ConfigError, match="num_layers"):
        get_config("tiny", num_layers=3)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(hidden_size=100, num_attention_heads=3),
         ["hidden_size=100", "num_attention_heads=3", "multiple of", "96 or 102"]),
        (dict(hidden_size=36, num_attention_heads=4, intermediate_size=96),
         ["head_dim", "9", "odd", "RoPE", "multiple of 2*num_attention_heads=8", "32 or 40"]),
        (dict(attn_implementation="flash"),
         ["attn_implementation='flash'", "'sdpa'", "'eager'"]),
        (dict(num_hidden_layers=0), ["num_hidden_layers=0", "positive integer"]),
        (dict(hidden_size=64.0), ["hidden_size=64.0", "positive integer"]),
        (dict(rms_norm_eps=-1.0), ["rms_norm_eps=-1.0", "positive", "1e-05"]),
    ],
)
def test_bad_configs_raise_config_error_with_field_and_fix(kwargs, fragments):
    with pytest.raises(ConfigError) as info:
        GPTConfig(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_in_json_is_named_with_valid_keys(tmp_path):
    path = tmp_path / "config.json"
    data = CONFIGS["tiny"].to_dict()
    data["n_layer"] = 4
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        get_config(str(path))
    message = str(info.value)
    assert "'n_layer'" in message
    assert "did you mean 'num_hidden_layers'" in message
    assert "valid keys are:" in message and "max_position_embeddings" in message


def test_invalid_value_in_json_is_caught(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 100, "num_attention_heads": 3}))
    with pytest.raises(ConfigError, match="hidden_size=100"):
        GPTConfig.from_json(path)


def test_missing_json_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        get_config(str(tmp_path / "nope.json"))


def test_unknown_config_name_lists_the_names():
    with pytest.raises(ConfigError) as info:
        get_config("huge")
    message = str(info.value)
    assert "'huge'" in message
    for name in ("tiny", "small", "medium", "gpt2-small", ".json"):
        assert name in message


# ---------------------------------------------------------------- the script


def test_script_runs_from_repo_root():
    result = subprocess.run(
        [sys.executable, "snippets/models/gpt.py"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "logits shape: torch.Size([2, 16, 256])" in result.stdout
    loss_line = next(line for line in result.stdout.splitlines() if line.startswith("loss:"))
    assert abs(float(loss_line.split()[1]) - math.log(256)) < 0.3


def test_sections_and_exercise_markers_are_balanced():
    # The site includes these sections and the stub generator replaces the exercise bodies.
    text = (REPO_ROOT / "snippets" / "models" / "gpt.py").read_text()
    names = ["config", "named-configs", "rmsnorm", "rope", "mlp", "attention", "block", "gpt",
             "main"] + [f"exercise-{i}" for i in range(1, 8)]
    for name in names:
        assert text.count(f"# --8<-- [start:{name}]") == 1, name
        assert text.count(f"# --8<-- [end:{name}]") == 1, name
        assert text.index(f"[start:{name}]") < text.index(f"[end:{name}]"), name


def test_exercise_sections_can_be_replaced_by_a_raise():
    # Mirrors what the stub generator does: the result must still compile.
    import ast
    import re

    lines = (REPO_ROOT / "snippets" / "models" / "gpt.py").read_text().splitlines()
    out, skipping = [], False
    for line in lines:
        start = re.match(r"(\s*)# --8<-- \[start:(exercise-\d+)\]", line)
        if start:
            out.append(f"{start.group(1)}raise NotImplementedError('{start.group(2)}')")
            skipping = True
        elif re.match(r"\s*# --8<-- \[end:exercise-\d+\]", line):
            skipping = False
        elif not skipping:
            out.append(line)
    ast.parse("\n".join(out))
    assert sum("raise NotImplementedError('exercise-" in line for line in out) == 7
