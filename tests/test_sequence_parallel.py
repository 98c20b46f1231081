"""Sequence parallelism against the single-device model: from scratch (2 and 4 ranks) and with
DTensor's SequenceParallel and loss_parallel (2 ranks), on gloo; bytes per collective against
the formula; saved activations per rank against the planner's sequence-parallel term.

Each world size is spawned once (a module-scoped fixture) and every test reads its results."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.library.sequence_parallel import apply_sp
from snippets.library.sequence_parallel import first_step as dtensor_first_step
from snippets.library.tensor_parallel import train
from snippets.planner import cost_model as cm
from snippets.scratch.sequence_parallel import apply_sequence_parallel, collective_payloads_per_step
from snippets.scratch.tensor_parallel import all_reduce_bytes_per_step, apply_tensor_parallel

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
BATCHES = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # rows split: dim 0
ROW_PARALLEL = ("o_proj", "down_proj")  # columns split: dim 1


def make_model():
    torch.manual_seed(0)
    return GPT(get_config("tiny"))


def first_step(model):
    """Logits, loss and every parameter's gradient for the first global batch; no update."""
    logits, loss = model(*shift_for_next_token(BATCHES[0]))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.item(), grads


# --8<-- [start:saved-bytes]
def saved_activation_bytes(module, x) -> int:
    """Bytes autograd saves for backward while module(x) runs, once per storage, weights and
    buffers left out (as snippets/planner/memory.py counts a whole model)."""
    state = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    storages = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in state:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(storages.values())


def block_activations(world_size, sequence_parallel: bool) -> dict:
    """One block's saved bytes on this rank, and its first norm's, for a (B, T, hidden) input
    (T/N of the tokens under sequence parallelism)."""
    model = make_model()
    apply = apply_sequence_parallel if sequence_parallel else apply_tensor_parallel
    apply(model)
    tokens = SEQ // world_size if sequence_parallel else SEQ
    x = torch.randn(GLOBAL_BATCH, tokens, model.config.hidden_size, requires_grad=True)
    block = model.layers[0]
    return {"block": saved_activation_bytes(block, x),
            "norm": saved_activation_bytes(block.input_layernorm, x)}
# --8<-- [end:saved-bytes]


def scratch_sp(rank, world_size):
    model = make_model()
    if rank != 0:  # apply_sequence_parallel must slice rank 0's weights: start the others apart
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    stats = apply_sequence_parallel(model)
    logits, loss, grads = first_step(model)
    step_stats = {"calls": dict(stats.calls), "payload": dict(stats.payload)}
    train(model, BATCHES)  # every rank is handed the whole batch; it takes its tokens
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "loss": loss, "grads": grads, "weights": weights,
            "stats": step_stats, "sp": block_activations(world_size, True),
            "tp": block_activations(world_size, False)}


def dtensor_sp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    model = make_model()
    apply_sp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    logits, loss, grads = dtensor_first_step(model, BATCHES[0])
    return {"logits": logits.full_tensor().detach(), "loss": loss.full_tensor().item(),
            "grads": grads, "tied": model.lm_head.weight is model.embed_tokens.weight,
            "placements": {n: p.placements for n, p in model.named_parameters()},
            "grad_placements": {n: p.grad.placements for n, p in model.named_parameters()},
            "local_norm_grad": model.layers[0].input_layernorm.weight.grad.to_local().clone()}


def bad_length_message():
    model = make_model()
    apply_sequence_parallel(model)
    try:
        model(torch.zeros(1, SEQ - 1, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "no error"


def two_rank_worker(rank, world_size):
    return {"scratch": scratch_sp(rank, world_size), "dtensor": dtensor_sp(rank, world_size),
            "bad_length": bad_length_message()}


def four_rank_worker(rank, world_size):
    return {"scratch": scratch_sp(rank, world_size)}


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


def assemble(per_rank: list[dict]) -> dict:
    """Stack the ranks' shards back into full tensors; replicated tensors must be identical."""
    full = {}
    for name in per_rank[0]:
        parts = [r[name] for r in per_rank]
        if any(f"{layer}." in name for layer in COLUMN_PARALLEL):
            full[name] = torch.cat(parts, dim=0)
        elif any(f"{layer}." in name for layer in ROW_PARALLEL):
            full[name] = torch.cat(parts, dim=1)
        else:  # embedding, norms: all-reduced, so the same on every rank, bit for bit
            assert all(torch.equal(p, parts[0]) for p in parts), f"{name} differs across ranks"
            full[name] = parts[0]
    return full


# --8<-- [start:tolerance]
def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float):
    """Equal up to fp32 rounding: |difference| <= 1e-5 * scale.

    Not bit-exact: sums run in another order. A row-parallel output is N partial sums added by
    the reduce-scatter; a norm's or the embedding's gradient is N sums over T/N tokens each,
    added by the all-reduce, where one process adds all B*T tokens in one go. Each reordered
    fp32 sum moves by a few units of 6e-8 of its terms; through the two blocks' dozen ops that
    stays below 1e-6 of the largest value (the worst seen here is 5e-7). A sharding mistake is
    off by the size of the values: an un-reduced norm gradient holds about 1/N of the sum.
    """
    worst = (actual - expected).abs().max().item()
    assert worst <= 1e-5 * scale, f"{what}: differs by {worst:.2e} (scale {scale:.2e})"
# --8<-- [end:tolerance]


# --8<-- [start:tests-equal]
@pytest.mark.parametrize("world_size", [2, 4])
def test_scratch_sp_forward_and_gradients_equal_single_device(ranks, single_device, world_size):
    results = [r["scratch"] for r in ranks[world_size]]
    expected_logits = single_device["logits"]
    logits = torch.cat([r["logits"] for r in results], dim=1)  # each rank: its T/N tokens
    assert logits.shape == expected_logits.shape
    assert_close(logits, expected_logits, "logits", expected_logits.abs().max().item())
    for r in results:
        assert abs(r["loss"] - single_device["loss"]) <= 1e-5 * single_device["loss"]
    for r in results:  # the weights outside the regions: each rank's own, all-reduced gradient
        for name, grad in r["grads"].items():
            if not any(f"{layer}." in name for layer in COLUMN_PARALLEL + ROW_PARALLEL):
                expected = single_device["grads"][name]
                assert_close(grad, expected, f"gradient of {name}", expected.abs().max().item())
    grads = assemble([r["grads"] for r in results])
    assert grads.keys() == single_device["grads"].keys()
    for name, expected in single_device["grads"].items():
        assert_close(grads[name], expected, f"gradient of {name}", expected.abs().max().item())


@pytest.mark.parametrize("world_size", [2, 4])
def test_scratch_sp_training_equals_single_device(ranks, single_device, world_size):
    weights = assemble([r["scratch"]["weights"] for r in ranks[world_size]])
    start, expected = single_device["start"], single_device["weights"]
    moved = max((expected[n] - start[n]).abs().max().item() for n in expected)
    for name in expected:  # judged against how far 3 SGD steps moved the weights
        assert_close(weights[name], expected[name], f"{name} after {STEPS} steps", moved)
# --8<-- [end:tests-equal]


# --8<-- [start:tests-bytes]
@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_bytes_match_the_formula_and_tp(ranks, world_size):
    config = get_config("tiny")
    theory = collective_payloads_per_step(config, batch_size=GLOBAL_BATCH, seq_len=SEQ)
    tp = all_reduce_bytes_per_step(config, batch_size=GLOBAL_BATCH, seq_len=SEQ)
    model = make_model()
    replicated = sum(p.numel() * 4 for n, p in model.named_parameters()
                     if "self_attn." not in n and "mlp." not in n)  # embedding and norms
    ring = (world_size - 1) / world_size  # share of a tensor a rank sends in a ring collective
    for r in ranks[world_size]:
        calls, payload = r["scratch"]["stats"]["calls"], r["scratch"]["stats"]["payload"]
        for key, (expected_calls, expected_bytes) in theory.items():
            assert (calls[key], payload[key]) == (expected_calls, expected_bytes), key
        for phase in ("forward", "backward"):
            # An all-gather and a reduce-scatter of TP's all-reduced tensor: on a ring, the
            # same bytes sent as TP's all-reduce, 2(N-1)/N of it.
            sent = ring * (payload[phase, "all_gather"] + payload[phase, "reduce_scatter"])
            assert sent == 2 * ring * tp[f"{phase}_bytes"]
            assert calls[phase, "all_gather"] == tp[f"{phase}_calls"]
        # What SP adds: the gradients of the weights outside the regions, once per step, and
        # the loss (one fp32 number).
        assert payload["backward", "all_reduce"] == replicated
        assert (calls["forward", "all_reduce"], payload["forward", "all_reduce"]) == (1, 4)
# --8<-- [end:tests-bytes]


def test_a_sequence_that_does_not_divide_is_a_clear_error(ranks):
    for r in ranks[2]:  # raised on every rank, before any collective could wait for the others
        assert r["bad_length"] == ("sequence length 15 does not divide by the sequence-parallel "
                                   "size 2")


# --8<-- [start:tests-memory]
@pytest.mark.parametrize("world_size", [2, 4])
def test_saved_activations_per_rank_match_the_planner(ranks, world_size):
    model = cm.MODELS["tiny"]
    plan = dict(dp=1, tp=world_size, pp=1, zero_stage=0, precision="fp32", recompute=False,
                micro_batch_size=GLOBAL_BATCH, micro_batches=1, seq_len=SEQ, schedule="1f1b",
                mfu=0.5)
    tp_term = cm.activation_bytes_per_layer(model, {**plan, "sp": False})
    sp_term = cm.activation_bytes_per_layer(model, {**plan, "sp": True})
    # The planner assumes Megatron-LM's column-parallel layer, which saves its input's sequence
    # shard and all-gathers it again in backward. Ours (TP's layers, unchanged) save the
    # gathered input: each region's norm output whole, not 1/N of it, on every rank.
    gathered_copies = 2 * GLOBAL_BATCH * SEQ * model["hidden_size"] * 4 * (1 - 1 / world_size)
    for r in ranks[world_size]:
        tp, sp = r["scratch"]["tp"], r["scratch"]["sp"]
        assert tp["block"] == tp_term  # exact: the planner counts this model tensor by tensor
        assert sp["block"] == sp_term + gathered_copies
        assert sp["norm"] * world_size == tp["norm"]  # the norm's saved tensors: 1/N each
# --8<-- [end:tests-memory]


# --8<-- [start:tests-dtensor]
def test_dtensor_sp_with_loss_parallel_equals_scratch_and_single_device(ranks, single_device):
    scratch = assemble([r["scratch"]["grads"] for r in ranks[2]])
    for r in ranks[2]:
        ours = r["dtensor"]
        assert ours["tied"]  # one weight for embedding and output layer, as in the plain GPT
        placements = ours["placements"]
        assert placements["layers.0.input_layernorm.weight"] == (Replicate(),)
        assert placements["embed_tokens.weight"] == (Shard(0),)  # split by vocabulary
        assert_close(ours["logits"], single_device["logits"], "logits",
                     single_device["logits"].abs().max().item())
        assert abs(ours["loss"] - single_device["loss"]) <= 1e-5 * single_device["loss"]
        for name, g in single_device["grads"].items():
            assert_close(ours["grads"][name], g, f"gradient of {name}", g.abs().max().item())
            assert_close(ours["grads"][name], scratch[name], f"{name} vs scratch",
                         g.abs().max().item())
        # After backward a norm's gradient is still Partial(sum): each rank holds its own
        # tokens' part, and DTensor adds them only when the tensor is redistributed
        # (full_tensor() in first_step; the optimizer's update of the Replicate weight).
        assert ours["grad_placements"]["layers.0.input_layernorm.weight"] == (Partial("sum"),)
    local = [r["dtensor"]["local_norm_grad"] for r in ranks[2]]
    whole = single_device["grads"]["layers.0.input_layernorm.weight"]
    assert (local[0] - local[1]).abs().max() > 0.1 * whole.abs().max()  # each rank: its part
    assert_close(local[0] + local[1], whole, "the two ranks' local parts, added", whole.abs().max().item())
# --8<-- [end:tests-dtensor]
