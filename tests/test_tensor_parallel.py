"""Tensor parallelism against the single-device model: from scratch (2 and 4 ranks), with
DTensor's parallelize_module (2 ranks), and 2-D FSDP2 x TP on a 2 x 2 mesh (4 ranks), on gloo.

Each world size is spawned once (a module-scoped fixture) and every test reads its results:
process start-up, not the checks, is what costs time on a 2-core machine."""

import pytest
import torch

from snippets.bench import tensor_parallel as bench
from snippets.dist import spawn
from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.data.dataset import random_token_batches
from snippets.library.tensor_parallel import apply_tp, full_weights, parallelize_2d, train
from snippets.scratch.tensor_parallel import (
    all_reduce_bytes_per_step,
    apply_tensor_parallel,
    check_tensor_parallel_sizes,
)

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
BATCHES = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # rows split: dim 0
ROW_PARALLEL = ("o_proj", "down_proj")  # columns split: dim 1


def make_model(**overrides):
    torch.manual_seed(0)
    return GPT(get_config("tiny", **overrides))


# --8<-- [start:first-step]
def first_step(model):
    """Logits, loss and every parameter's gradient for the first global batch; no update."""
    logits, loss = model(*shift_for_next_token(BATCHES[0]))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.item(), grads
# --8<-- [end:first-step]


# --8<-- [start:scratch-worker]
def scratch_tp(rank, world_size):
    model = make_model()
    if rank != 0:  # apply_tensor_parallel must slice rank 0's weights: start the others apart
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    stats = apply_tensor_parallel(model)
    logits, loss, grads = first_step(model)
    step_stats = dict(vars(stats))  # what one forward + backward sent
    train(model, BATCHES)  # TP splits the model, not the data: every rank, whole batch
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "loss": loss, "grads": grads, "weights": weights,
            "stats": step_stats}
# --8<-- [end:scratch-worker]


def bad_size_message():
    try:
        apply_tensor_parallel(make_model(intermediate_size=171))
    except ConfigError as e:
        return str(e)
    return "no error"


# --8<-- [start:dtensor-worker]
def dtensor_tp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    model = make_model()
    apply_tp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    logits, loss, grads = first_step(model)
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    train(model, BATCHES)
    return {"logits": logits, "loss": loss, "grads": grads, "weights": full_weights(model)}


def two_d(rank, world_size):
    model = make_model()
    mesh = parallelize_2d(model, dp=2, tp=2)
    train(model, BATCHES, dp_rank=mesh["dp"].get_local_rank(), dp=2)
    return {"coordinate": tuple(mesh.get_coordinate()), "weights": full_weights(model)}
# --8<-- [end:dtensor-worker]


def two_rank_worker(rank, world_size):
    return {"scratch": scratch_tp(rank, world_size), "dtensor": dtensor_tp(rank, world_size),
            "bad_size": bad_size_message(),
            # the benchmark's own measurement, run small: 1 round, tiny GPT, batch 2 x SEQ
            "bench": bench.time_variants(rank, world_size, "tiny", 2, SEQ, rounds=1, warmup=0)}


def four_rank_worker(rank, world_size):
    return {"scratch": scratch_tp(rank, world_size), "2d": two_d(rank, world_size)}


@pytest.fixture(scope="module")
def single_device():
    model = make_model()
    logits, loss, grads = first_step(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, BATCHES)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "loss": loss, "grads": grads, "weights": weights, "start": start}


@pytest.fixture(scope="module")
def ranks():
    """world size -> each rank's results; each world spawned once for all tests below."""
    return {2: spawn(two_rank_worker, 2, timeout_s=120),
            4: spawn(four_rank_worker, 4, timeout_s=120)}


# --8<-- [start:assemble]
def assemble(per_rank: list[dict]) -> dict:
    """Stack the ranks' shards back into full tensors; replicated tensors must be identical."""
    full = {}
    for name in per_rank[0]:
        parts = [r[name] for r in per_rank]
        if any(f"{layer}." in name for layer in COLUMN_PARALLEL):
            full[name] = torch.cat(parts, dim=0)
        elif any(f"{layer}." in name for layer in ROW_PARALLEL):
            full[name] = torch.cat(parts, dim=1)
        else:  # embedding, norms: every rank computed the same thing from the same inputs
            assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs across ranks"
            full[name] = parts[0]
    return full
# --8<-- [end:assemble]


# --8<-- [start:tolerance]
def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float):
    """Equal up to fp32 rounding: |difference| <= 1e-5 * scale.

    Not bit-exact: a row-parallel layer sums its dot products in N partial sums, one per rank,
    added by the all-reduce, a different order than one long dot product (a few ulps, about
    1e-7 relative). A sharding bug (a wrong slice, a missing all-reduce) is off by the size of
    the values themselves, 1e5 times the bound.
    """
    worst = (actual - expected).abs().max().item()
    assert worst <= 1e-5 * scale, f"{what}: differs by {worst:.2e} (scale {scale:.2e})"
# --8<-- [end:tolerance]


# --8<-- [start:tests-scratch]
@pytest.mark.parametrize("world_size", [2, 4])
def test_scratch_tp_forward_and_gradients_equal_single_device(ranks, single_device, world_size):
    results = [r["scratch"] for r in ranks[world_size]]
    for r in results:
        assert r["logits"].shape == single_device["logits"].shape  # full logits on every rank
        assert_close(r["logits"], single_device["logits"], "logits",
                     single_device["logits"].abs().max().item())
        assert abs(r["loss"] - single_device["loss"]) <= 1e-5 * single_device["loss"]
    grads = assemble([r["grads"] for r in results])
    assert grads.keys() == single_device["grads"].keys()
    for name, expected in single_device["grads"].items():
        assert_close(grads[name], expected, f"gradient of {name}", expected.abs().max().item())


@pytest.mark.parametrize("world_size", [2, 4])
def test_scratch_tp_training_equals_single_device(ranks, single_device, world_size):
    weights = assemble([r["scratch"]["weights"] for r in ranks[world_size]])
    start, expected = single_device["start"], single_device["weights"]
    moved = max((expected[n] - start[n]).abs().max().item() for n in expected)
    for name in expected:  # judged against how far 3 SGD steps moved the weights
        assert_close(weights[name], expected[name], f"{name} after {STEPS} steps", moved)


def test_all_reduces_per_step_match_theory(ranks):
    layers = get_config("tiny").num_hidden_layers
    counted = all_reduce_bytes_per_step(get_config("tiny"), batch_size=GLOBAL_BATCH, seq_len=SEQ)
    assert counted["forward_calls"] == counted["backward_calls"] == 2 * layers
    for r in ranks[2]:
        assert r["scratch"]["stats"] == counted  # TensorParallelCommStats, counted by f and g themselves
        # Measured by the benchmark's dispatch mode, which sees every all-reduce op issued:
        measured, theory = r["bench"]["measured"], r["bench"]["theory"]
        assert measured["TP from scratch"] == theory
        assert measured["TP DTensor"] == theory
        # Without PrepareModuleInput each of q, k, v, gate, up all-reduces its own input
        # gradient: 5 per block in backward instead of 2, same forward.
        unprepared = measured["TP DTensor, no PrepareModuleInput"]
        assert unprepared["backward_calls"] == 5 * layers
        assert unprepared["forward_bytes"] == theory["forward_bytes"]
# --8<-- [end:tests-scratch]


# --8<-- [start:tests-errors]
def test_sizes_that_do_not_divide_are_clear_errors(ranks):
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 .* and intermediate_size=172"):
        check_tensor_parallel_sizes(get_config("tiny"), 8)
    with pytest.raises(ConfigError, match=r"divide num_attention_heads=2 \(") as err:
        check_tensor_parallel_sizes(get_config("tiny", num_attention_heads=2), 4)
    assert "tensor-parallel size in [1, 2]" in str(err.value)
    # Raised by apply_tensor_parallel itself, on every rank, before any weight is sliced.
    for r in ranks[2]:
        assert r["bad_size"].startswith("tensor-parallel size 2 does not divide "
                                        "intermediate_size=171")
# --8<-- [end:tests-errors]


# --8<-- [start:tests-dtensor]
def test_dtensor_tp_equals_scratch_tp_and_single_device(ranks, single_device):
    scratch = {key: assemble([r["scratch"][key] for r in ranks[2]]) for key in ("grads", "weights")}
    start, expected = single_device["start"], single_device["weights"]
    moved = max((expected[n] - start[n]).abs().max().item() for n in expected)
    for r in ranks[2]:
        ours = r["dtensor"]
        assert_close(ours["logits"], single_device["logits"], "logits",
                     single_device["logits"].abs().max().item())
        for name, g in single_device["grads"].items():
            assert_close(ours["grads"][name], g, f"gradient of {name}", g.abs().max().item())
            # Same shards, same local matmuls, all-reduces of two numbers (a + b == b + a):
            # DTensor and the from-scratch version agree to within a few ulps.
            assert_close(ours["grads"][name], scratch["grads"][name], f"{name} vs scratch",
                         g.abs().max().item())
        for name in expected:
            assert_close(ours["weights"][name], expected[name], f"{name} after training", moved)


def test_2d_fsdp_and_tp_equals_single_process_training(ranks, single_device):
    start, expected = single_device["start"], single_device["weights"]
    moved = max((expected[n] - start[n]).abs().max().item() for n in expected)
    results = ranks[4]
    assert [r["2d"]["coordinate"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        for name in expected:
            assert_close(r["2d"]["weights"][name], expected[name], f"2-D {name}", moved)
# --8<-- [end:tests-dtensor]
