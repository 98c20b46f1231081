"""DDP from scratch, three ways, against single-process training on the same global batch and
against torch.nn.parallel.DistributedDataParallel (gloo, 2 and 4 processes)."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.ddp import BucketedDDP, NaiveDDP, OverlappedDDP

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
BATCHES = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank


def make_model():
    torch.manual_seed(0)
    return GPT(get_config("tiny"))


def train(model, batches, sync=lambda: None, micro_batches=1, no_sync=None):
    params = (model.module if hasattr(model, "module") else model).parameters()
    # SGD, not Adam: Adam's update ignores the gradient's scale, so it would hide a DDP that
    # forgot to divide the summed gradient by the world size.
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    losses = []
    for batch in batches:
        for i, micro in enumerate(batch.chunk(micro_batches)):
            inputs, targets = shift_for_next_token(micro)
            last = i == micro_batches - 1
            if no_sync is not None and not last:
                with no_sync():
                    (model(inputs, targets)[1] / micro_batches).backward()
            else:
                (model(inputs, targets)[1] / micro_batches).backward()
        sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


# --8<-- [start:ddp-worker]
def ddp_worker(rank, world_size, variant, micro_batches):
    model = make_model()
    if rank != 0:  # the wrappers must broadcast rank 0's weights: start replicas apart
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    wrap = {"naive": NaiveDDP, "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.1),
            "overlapped": lambda m: OverlappedDDP(m, bucket_cap_mb=0.1),
            "torch": lambda m: DistributedDataParallel(m, bucket_cap_mb=0.1)}[variant]
    ddp = wrap(model)
    shards = [b.chunk(world_size)[rank] for b in BATCHES]  # this rank's slice
    sync = ddp.sync_gradients if variant in ("naive", "bucketed") else (lambda: None)
    no_sync = ddp.no_sync if variant in ("overlapped", "torch") else None
    train(ddp, shards, sync, micro_batches, no_sync)
    return {k: v.clone() for k, v in model.state_dict().items()}
# --8<-- [end:ddp-worker]


def single_process(micro_batches=1):
    model = make_model()
    train(model, BATCHES, micro_batches=micro_batches)
    return model.state_dict()


# --8<-- [start:assert-same]
def assert_same(a, b):
    """Equal up to fp32 rounding, judged against how far training moved the weights.

    Not bit-exact: averaging per-rank means adds the same numbers in a different order than one
    mean over the global batch (differences of a few ulps, growing a little over the steps).
    A real bug (a missing /world, an unsynchronised bucket) changes weights by the size of an
    update itself.
    """
    init = make_model().state_dict()
    moved = max((b[n] - init[n]).abs().max().item() for n in b)
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst < 1e-5 * moved, f"differs by {worst:.2e}; training moved weights {moved:.2e}"
# --8<-- [end:assert-same]


# --8<-- [start:equals-single-process]
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ["naive", "bucketed", "overlapped", "torch"])
def test_ddp_equals_single_process_training(variant, world_size):
    reference = single_process()
    results = spawn(ddp_worker, world_size, variant, 1)
    for state in results:
        assert_same(state, reference)
    for state in results[1:]:  # replicas identical to each other, bit for bit
        for name in state:
            assert torch.equal(state[name], results[0][name]), name
# --8<-- [end:equals-single-process]


# --8<-- [start:bit-for-bit]
@pytest.mark.parametrize("variant", ["naive", "bucketed", "overlapped"])
def test_two_ranks_match_torch_ddp_bit_for_bit(variant):
    # With two ranks each all-reduce adds exactly two numbers, and a + b == b + a in floating
    # point, so ours and torch's DDP must agree exactly, not just closely.
    ours, theirs = spawn(ddp_worker, 2, variant, 1), spawn(ddp_worker, 2, "torch", 1)
    for name in theirs[0]:
        assert torch.equal(ours[0][name], theirs[0][name]), name
# --8<-- [end:bit-for-bit]


# --8<-- [start:no-sync]
@pytest.mark.parametrize("world_size", [2])
def test_overlapped_no_sync_accumulation_equals_torch_ddp(world_size):
    ours = spawn(ddp_worker, world_size, "overlapped", 2)
    theirs = spawn(ddp_worker, world_size, "torch", 2)
    assert_same(ours[0], theirs[0])
    assert_same(ours[0], single_process(micro_batches=1))
# --8<-- [end:no-sync]


def unused_parameter(rank, world_size):
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 2), "unused": torch.nn.Linear(2, 2)})
    ddp = OverlappedDDP(model, bucket_cap_mb=1e-6)  # one parameter per bucket
    try:
        model["used"](torch.ones(1, 2)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_parameter_without_gradient_is_a_clear_error():
    messages = spawn(unused_parameter, 2)
    assert all("every parameter must take part in the loss" in m for m in messages)
