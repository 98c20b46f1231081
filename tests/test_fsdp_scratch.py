"""FSDP from scratch (snippets/scratch/fsdp.py) against one process (fp32, 2 and 4 ranks), against
PyTorch's fully_shard at the same mixed-precision dtypes (2 ranks), its global-norm clip against
torch.nn.utils.clip_grad_norm_, and its prefetch order (gloo)."""

import functools

import pytest
import torch

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, RMSNorm, get_config, shift_for_next_token
from snippets.scratch.ddp_check import GLOBAL_BATCH, SEQ, STEPS  # the DDP check's batches
from snippets.scratch.fsdp import FSDP, MixedPrecision

BATCHES = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank
TIMEOUT_S = 120
REPLICATE_BELOW = 100  # the tiny GPT's norm gains (64 elements) stay whole on every rank
# Clip by a norm the first steps' gradients stay below and the last step's exceeds (the tiny
# GPT's global gradient norm is about 1 here): both branches of the clip are exercised.
MAX_NORMS = [100.0] * (STEPS - 1) + [0.05]
BF16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def make_model():
    torch.manual_seed(0)
    return GPT(get_config("tiny"))


# --8<-- [start:groups]
def param_groups(model, weight_decay=0.1):
    """Weight decay on matrices only, as the course's trainers do. Built on the plain model:
    after FSDP(model) every parameter is a 1-D shard, but it is the same Parameter object."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
# --8<-- [end:groups]


def train(net, optimizer, clip, rank=0, world_size=1):
    """The single-device loop; `clip(max_norm)` is the only line that differs. Returns the
    gradient norm of every step."""
    norms = []
    for batch, max_norm in zip(BATCHES, MAX_NORMS):
        inputs, targets = shift_for_next_token(batch.chunk(world_size)[rank])  # this rank's slice
        net(inputs, targets)[1].backward()
        norms.append(clip(max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


def single_process(optimizer_class, **kwargs):
    model = make_model()
    optimizer = optimizer_class(param_groups(model), **kwargs)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()))
    norms = train(model, optimizer, clip)
    return {n: p.detach() for n, p in model.named_parameters()}, norms


# --8<-- [start:fp32-worker]
def fp32_worker(rank, world_size):
    model = make_model()
    groups = param_groups(model)
    if rank != 0:  # FSDP must start every rank from rank 0's weights: start them apart
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    fsdp = FSDP(model, replicate_below=REPLICATE_BELOW)
    # SGD, not AdamW: Adam divides each update by the gradient's own size, so a gradient
    # summed over ranks instead of averaged would barely change its weights. SGD's would double.
    optimizer = torch.optim.SGD(groups, lr=0.5, momentum=0.9)
    norms = train(model, optimizer, fsdp.clip_grad_norm_, rank, world_size)
    # After backward and step, each parameter is this rank's fp32 elements of it.
    held = {n: (p.numel(), p.dtype) for n, p in model.named_parameters()}
    return fsdp.full_state_dict(), norms, held, prefetch_order(rank, world_size)
# --8<-- [end:fp32-worker]


def prefetch_order(rank, world_size):
    """The events of one step on this rank, with and without prefetch."""
    orders = {}
    for prefetch in (True, False):
        model = make_model()
        fsdp = FSDP(model, prefetch=prefetch)
        fsdp.timeline = []
        inputs, targets = shift_for_next_token(BATCHES[0].chunk(world_size)[rank])
        model(inputs, targets)[1].backward()
        orders[prefetch] = [(event, unit) for _, event, unit in fsdp.timeline]
    return orders


# --8<-- [start:bf16-worker]
def bf16_worker(rank, world_size):
    """Ours and PyTorch's at the same dtypes, same data, same AdamW with parameter groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import init_device_mesh

    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    fsdp = FSDP(model, mp=MixedPrecision(**BF16))
    our_norms = train(model, optimizer, fsdp.clip_grad_norm_, rank, world_size)
    ours = fsdp.full_state_dict()

    theirs = make_model()
    mesh, policy = init_device_mesh("cpu", (world_size,)), MixedPrecisionPolicy(**BF16)
    for block in theirs.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)  # new Parameter objects: groups after
    optimizer = torch.optim.AdamW(param_groups(theirs), lr=1e-2)
    clip = functools.partial(torch.nn.utils.clip_grad_norm_, list(theirs.parameters()))
    their_norms = train(theirs, optimizer, lambda max_norm: clip(max_norm).full_tensor(), rank,
                        world_size)
    theirs = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    return ours, theirs, our_norms, their_norms, fp32_norm_dtypes(rank, world_size)
# --8<-- [end:bf16-worker]


def fp32_norm_dtypes(rank, world_size):
    """The dtypes of the weights and outputs each module type sees in a bf16 forward with the
    norms kept in fp32."""
    model = make_model()
    FSDP(model, mp=MixedPrecision(**BF16, fp32_modules=(RMSNorm,)))
    seen = {}
    def record(module, args, out):
        seen[type(module).__name__] = module.weight.dtype, out.dtype

    for m in (model.layers[0].input_layernorm, model.layers[0].mlp.down_proj):
        m.register_forward_hook(record)
    inputs, targets = shift_for_next_token(BATCHES[0].chunk(world_size)[rank])
    model(inputs, targets)[1].backward()
    return seen, {n: p.dtype for n, p in model.named_parameters()}


@functools.cache
def run(worker, world_size: int) -> list:
    return spawn(worker, world_size, timeout_s=TIMEOUT_S)


def relative_error(ours: dict, reference: dict, start: dict) -> float:
    """The largest difference, relative to the distance training moved the weights."""
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    return max((ours[n] - reference[n]).abs().max().item() for n in reference) / moved


# --8<-- [start:equals-single-process]
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp32_equals_single_process_with_groups_replicas_and_clipping(world_size):
    reference, reference_norms = single_process(torch.optim.SGD, lr=0.5, momentum=0.9)
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    assert reference_norms[-1] > MAX_NORMS[-1] and max(reference_norms) < MAX_NORMS[0]
    for state, norms, held, _ in run(fp32_worker, world_size):
        # Not bit-exact: each rank's loss is a mean over its slice and the ranks' gradients
        # are then averaged, the same sum in another order (relative ~1e-7), which SGD with
        # momentum passes on without amplifying it. Measured: 2.1e-7 (2 ranks) and 1.4e-6
        # (4 ranks) of the distance the weights moved. A gradient summed instead of averaged
        # makes the steps before the clip N times too long; planted once (the division by
        # the world size deleted), it differed by 1.8x (2 ranks) and 6.6x (4 ranks) that
        # distance, and this test failed. 1e-4 is 70x above the noise, 10^4 below the bug.
        assert relative_error(state, reference, start) < 1e-4
        # The global norm is the same sum of squares, over shards then ranks: relative 1e-6.
        assert norms == pytest.approx(reference_norms, rel=1e-6)
        for name, (numel, dtype) in held.items():
            assert dtype == torch.float32
            if reference[name].numel() < REPLICATE_BELOW:  # replicated: whole on every rank
                assert numel == reference[name].numel(), name
    for name, p in reference.items():  # sharded: each element on exactly one rank
        if p.numel() >= REPLICATE_BELOW:
            assert sum(r[2][name][0] for r in run(fp32_worker, world_size)) == p.numel(), name
# --8<-- [end:equals-single-process]


# --8<-- [start:equals-fully-shard]
def test_bf16_equals_fully_shard_at_the_same_dtypes():
    per_rank = run(bf16_worker, 2)
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    for ours, theirs, our_norms, their_norms, _ in per_rank:
        # Both gather the bf16 cast of the same fp32 master, compute the same bf16 forward and
        # backward, sum the same bf16 gradients in fp32 and step the same fp32 AdamW; cutting
        # the shards differently (a flat buffer, rows) changes no elementwise result. Measured:
        # bit for bit while no clip is active. The last step clips, and the two compute the
        # global norm in different orders (one sum of squares; per-tensor norms, then theirs),
        # which moves the clip's scale by ~1e-7 relative: measured 2.5e-7 of the distance the
        # weights moved. 1e-5 is 40x that. Planted once each, the wrong dtypes fail it by far:
        # computing in fp32 differed by 1.5x that distance, reducing in bf16 by 7e-3, and a
        # gradient summed instead of averaged by 0.62.
        assert relative_error(ours, theirs, start) < 1e-5
        assert our_norms == pytest.approx(their_norms, rel=1e-6)
# --8<-- [end:equals-fully-shard]


def test_norms_can_stay_fp32():
    seen, stored = run(bf16_worker, 2)[0][4]
    assert seen == {"RMSNorm": (torch.float32, torch.bfloat16),  # fp32 inside, bf16 out
                    "Linear": (torch.bfloat16, torch.bfloat16)}
    assert set(stored.values()) == {torch.float32}  # the stored shards are fp32 masters


# --8<-- [start:prefetch]
def test_prefetch_issues_the_next_all_gather_before_the_unit_computes():
    orders = run(fp32_worker, 2)[0][3]
    order = orders[True]
    issued = order.index(("all-gather issued", "layers.1"))
    assert issued < order.index(("forward", "layers.0"))  # forward: next block, ahead
    issued = order.index(("all-gather issued", "layers.0"), order.index(("backward", "root")))
    assert issued < order.index(("backward", "layers.1"))  # backward: previous block, ahead
    # ... and still in flight while the unit computes: its wait comes only when it is needed
    # (an all-gather waited on at once, right after it is issued, would log no wait at all)
    assert order.index(("wait", "layers.1")) > order.index(("forward", "layers.0"))
    backward = order.index(("backward", "root"))
    assert order.index(("wait", "layers.0"), backward) > order.index(("backward", "layers.1"))
    order = orders[False]  # without prefetch, each all-gather is issued when its unit runs
    assert order.index(("all-gather issued", "layers.1")) > order.index(("forward", "layers.0"))
# --8<-- [end:prefetch]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="replicate_below=-1"):
        FSDP(make_model(), replicate_below=-1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(make_model())  # no process group in this process


def unused_parameter_worker(rank, world_size):
    model = make_model()
    model.layers[0].unused = torch.nn.Parameter(torch.zeros(8))  # in the unit, never in the loss
    fsdp = FSDP(model)
    inputs, targets = shift_for_next_token(BATCHES[0].chunk(world_size)[rank])
    try:
        fsdp(inputs, targets)[1].backward()
    except RuntimeError as error:
        return str(error)
    return "backward returned"


def test_a_parameter_without_a_gradient_is_an_error_not_a_silently_unreduced_unit():
    """A unit is reduced once every parameter's gradient is in: without the end-of-backward
    check, one unused parameter left layers.0 unreduced on every rank and training went on."""
    messages = run(unused_parameter_worker, 2)
    for message in messages:
        assert message.startswith("FSDP unit 'layers.0' was not reduced: backward gave no "
                                  "gradient to layers.0.unused."), message
