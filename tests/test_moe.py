"""The MoE layer from scratch: routing, capacity, the load-balancing loss, training inside the
tiny GPT, and expert parallelism against the single-process layer (gloo, 2 and 4 processes)."""

import itertools

import pytest
import torch
import torch.distributed as dist

from snippets.bench.moe_check import main as moe_check_main, train_moe_gpt
from snippets.dist import spawn
from snippets.models.gpt import GPT, MLP, get_config
from snippets.scratch.moe import (MoE, apply_expert_parallel, capacity_mask, is_expert_parameter,
                                  load_balancing_loss, swap_mlps_for_moe)

TOKENS_PER_RANK, TOP_K, AUX_WEIGHT = 48, 2, 0.1


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def make_moe(num_experts, capacity_factor):
    torch.manual_seed(0)
    return MoE(get_config("tiny"), num_experts, TOP_K, capacity_factor,
               expert_intermediate_size=32)


def rank_inputs(world_size):
    """Each rank's tokens, and a random weighting of the output so that every output element
    gets its own gradient (a plain .sum() would give every row the same one)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world_size, TOKENS_PER_RANK, 64, generator=g)
    return x, torch.randn(x.shape, generator=g)


# --8<-- [start:ep-worker]
def ep_worker(rank, world_size, num_experts, capacity_factor):
    moe = make_moe(num_experts, capacity_factor)
    apply_expert_parallel(moe)  # this rank keeps E / world_size experts
    xs, output_weights = rank_inputs(world_size)
    x = xs[rank].clone().requires_grad_()
    y = moe(x)
    ((y * output_weights[rank]).sum() + AUX_WEIGHT * moe.aux_loss).backward()
    # The router is replicated and sees only this rank's tokens: sum its gradient over the
    # ranks, as data parallelism would (an average, up to the constant world_size). Expert
    # gradients are complete where the expert lives: the backward all_to_all brought them.
    for name, param in moe.named_parameters():
        if not is_expert_parameter(name):
            dist.all_reduce(param.grad)
    result = {"y": y.detach(), "x_grad": x.grad, "router_grad": moe.router.weight.grad,
              "dropped": moe.last_routing.dropped,
              "expert_grads": {moe.first_expert + j: [p.grad for p in expert.parameters()]
                               for j, expert in enumerate(moe.experts)}}
    if world_size == 2:  # bad input, checked here to avoid a separate spawn
        try:
            apply_expert_parallel(make_moe(3, None))
        except ValueError as e:
            result["error"] = str(e)
    return result


def single_process_reference(world_size, num_experts, capacity_factor):
    """The full layer in one process, run on each rank's tokens in turn: routing and capacity
    are per batch of tokens, so rank r's batch is the unit, as in the parallel layer."""
    moe = make_moe(num_experts, capacity_factor)
    xs, output_weights = rank_inputs(world_size)
    xs.requires_grad_()
    ys, loss = [], 0
    for r in range(world_size):
        y = moe(xs[r])
        ys.append(y.detach())
        loss = loss + (y * output_weights[r]).sum() + AUX_WEIGHT * moe.aux_loss
    loss.backward()
    return moe, ys, xs.grad
# --8<-- [end:ep-worker]


# --8<-- [start:ep-equals-single]
def close(actual, expected):
    """Equal up to fp32 rounding. Not bit-exact: each expert runs once on the rows of all
    ranks together instead of once per rank's batch, so its matmuls run on differently shaped
    inputs (BLAS picks kernels and summation orders by shape), and weight gradients add the
    ranks' contributions in a different order. Each rounding is ~6e-8 of the value; 1e-5 of
    the largest value allows for many. A routing or dispatch bug moves values by O(1) of it."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("world_size, num_experts", [(2, 4), (4, 8)])
def test_expert_parallel_equals_single_process(world_size, num_experts):
    capacity_factor = 1.0  # tight: some assignments are dropped, so capacity is exercised too
    results = spawn(ep_worker, world_size, num_experts, capacity_factor, timeout_s=120)
    moe, ys, x_grad = single_process_reference(world_size, num_experts, capacity_factor)
    for rank, result in enumerate(results):
        close(result["y"], ys[rank])  # forward: each rank's outputs
        close(result["x_grad"], x_grad[rank])  # backward through both all_to_alls
        close(result["router_grad"], moe.router.weight.grad)
        for expert_id, grads in result["expert_grads"].items():
            for grad, param in zip(grads, moe.experts[expert_id].parameters()):
                close(grad, param.grad)  # this expert's gradient from every rank's tokens
    owned = sorted(e for result in results for e in result["expert_grads"])
    assert owned == list(range(num_experts))  # every expert on exactly one rank
    assert sum(result["dropped"] for result in results) > 0  # capacity really applied
    if world_size == 2:
        assert "num_experts=3 is not divisible by the expert-parallel world size 2" in \
            results[0]["error"]
# --8<-- [end:ep-equals-single]


# --8<-- [start:capacity]
def test_capacity_drops_on_a_constructed_routing():
    # 6 tokens, top-2 of 3 experts, capacity 2. First choices are served first, in token
    # order: expert 0 takes tokens 0 and 1, and is full for tokens 2 and 5. Second choices
    # get what is left: expert 1 still has room for token 0, expert 2 for token 1.
    expert_index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 1], [0, 2]])
    keep = capacity_mask(expert_index, num_experts=3, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [False, False],
                             [True, False], [True, False], [False, False]]

    # The same routing through a whole layer: a router that reads the first three input
    # features as scores, and inputs that score the two chosen experts 2 and 1.
    config = get_config("tiny", hidden_size=4, num_attention_heads=2)
    moe = MoE(config, num_experts=3, top_k=2, capacity_factor=0.5)  # ceil(0.5*6*2/3) = 2
    with torch.no_grad():
        moe.router.weight.copy_(10 * torch.eye(3, 4))
    x = torch.zeros(6, 4)
    x[torch.arange(6), expert_index[:, 0]] = 2.0
    x[torch.arange(6), expert_index[:, 1]] = 1.0
    y = moe(x)
    routing = moe.last_routing
    assert (routing.assignments, routing.dropped, routing.tokens_fully_dropped) == (12, 6, 2)
    assert routing.tokens_per_expert.tolist() == [2, 2, 2]
    # Tokens 2 and 5 lost both experts: exactly zero, so `x + mlp(norm(x))` passes them on.
    assert torch.equal(y[[2, 5]], torch.zeros(2, 4))
    # Token 3 kept only its first choice (expert 1), weighted by its router probability.
    p = torch.softmax(moe.router(x[3]), dim=-1)[1]
    torch.testing.assert_close(y[3], p * moe.experts[1](x[3]))
# --8<-- [end:capacity]


# --8<-- [start:aux-loss]
def test_load_balancing_loss_formula_and_minimum():
    # Hand-made: 4 tokens, 2 experts, top-1. Choices: 0, 0, 1, 0 -> f = (3/4, 1/4);
    # mean probabilities P = (0.65, 0.35); loss = 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    expert_index = probs.argmax(dim=1, keepdim=True)
    assert load_balancing_loss(probs, expert_index).item() == pytest.approx(1.15, abs=1e-6)

    # A confident router (probabilities one-hot on its choice, so P = f): the loss is
    # E * sum(f_i^2) >= 1 by Cauchy-Schwarz, with equality only for equal loads. Check every
    # way to assign 8 tokens to 4 experts.
    num_experts, tokens = 4, 8
    for assignment in itertools.combinations_with_replacement(range(num_experts), tokens):
        index = torch.tensor(assignment).unsqueeze(1)
        loss = load_balancing_loss(torch.nn.functional.one_hot(index[:, 0], num_experts).float(),
                                   index).item()
        balanced = torch.bincount(index[:, 0], minlength=num_experts).eq(2).all()
        assert loss == pytest.approx(1.0) if balanced else loss > 1.0 + 1e-6
# --8<-- [end:aux-loss]


def test_one_expert_is_the_dense_mlp_and_bad_arguments_are_clear():
    config = get_config("tiny")
    moe = MoE(config, num_experts=1, top_k=1, capacity_factor=None)
    x = torch.randn(2, 5, config.hidden_size)
    # Softmax over one expert is exactly 1.0, so the layer is that expert: the GPT's MLP.
    assert isinstance(moe.experts[0], MLP)
    assert torch.equal(moe(x), moe.experts[0](x))
    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        MoE(config, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoE(config, num_experts=4, capacity_factor=0)


# --8<-- [start:trains]
def test_tiny_gpt_with_moe_trains():
    model = swap_mlps_for_moe(GPT(get_config("tiny")), num_experts=4, top_k=2)
    assert all(isinstance(block.mlp, MoE) for block in model.layers)
    log = train_moe_gpt(steps=30, log_every=30)  # 30 AdamW steps on the course corpus
    first, last = log[0], log[-1]
    # From ln(256) = 5.55 (uniform over bytes) to clearly below: learning, not noise.
    assert first["lm_loss"] == pytest.approx(5.55, abs=0.1)
    assert last["lm_loss"] < first["lm_loss"] - 1.0
    assert 0.9 < last["aux_loss"] < 2.0 and 0 <= last["dropped"] < 0.5
# --8<-- [end:trains]


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--capacity-factor", "0"),
                                         ("--aux-loss-weight", "-0.1")])
def test_moe_check_refuses_a_bad_flag_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:  # refused while parsing, before any training
        moe_check_main([flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {flag}: must be" in err and f"got {value}" in err, err
