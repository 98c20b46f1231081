"""Check of exercise 27: make_buckets and BucketedDDP.sync_gradients (ddp.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from snippets.exercises.checks._ddp import (
    DDP_BUCKET_MB,
    DDP_WORLD,
    UNPACKED_BEFORE_WAIT,
    _ddp_batch,
    _ddp_model,
    _ddp_reference,
    _first_unaveraged,
    _sgd_step,
    _track_all_reduces,
)
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


# make_buckets is judged in this process, against the assignments the usual mistakes give
# (computed here); then BucketedDDP.sync_gradients runs on 2 gloo processes against the mean of
# the ranks' gradients, as exercise 20.

# Bytes: 4 buckets, then 2, of _ddp_model's 128 + 32 + 96 + 12 bytes. 100 first: there every
# mistake below gives its own assignment (at 200, counting elements and closing a bucket after
# it overflowed both give one bucket).
BUCKET_CAPS = (100, 200)
BUCKET_MISTAKES = {
    "forward": "your buckets follow the registration order, first layer first: backward "
               "produces the LAST layer's gradients first, so in that order the first bucket "
               "fills last and nothing can start early. Walk reversed(params)",
    "elements": "you counted elements against the cap, not bytes: a float32 element is 4 "
                "bytes (p.numel() * p.element_size()), so your buckets are 4 times too big",
    "after": "you close a bucket only after a parameter has overflowed it, so every bucket "
             "but the last is over the cap: check size + this parameter's bytes against the "
             "cap BEFORE adding it",
    "frozen": "a parameter with requires_grad=False is in a bucket: it never gets a gradient, "
              "so pack() finds p.grad None, and a hook-driven bucket would never fill. Keep "
              "only the parameters that require grad",
}


def _simulate_buckets(model: torch.nn.Module, cap_bytes: int, *, order: str = "backward",
                      unit: str = "bytes", close: str = "before",
                      frozen: bool = False) -> list[list[str]]:
    """make_buckets' assignment by parameter name, or a usual mistake's."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or frozen]
    buckets, current, size = [], [], 0
    for name, p in (reversed(named) if order == "backward" else named):
        nbytes = p.numel() * (p.element_size() if unit == "bytes" else 1)
        if close == "before" and current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        if close == "after" and size > cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


def _bucket_cases():
    """(model, cap in bytes) pairs: the caps above, then one with a frozen parameter."""
    for cap in BUCKET_CAPS:
        yield _ddp_model(), cap
    model = _ddp_model()
    model[0].bias.requires_grad_(False)
    yield model, BUCKET_CAPS[0]


def _judge_make_buckets(learner: ModuleType) -> None:
    for model, cap in _bucket_cases():
        names = {id(p): n for n, p in model.named_parameters()}
        buckets = learner.make_buckets(model, cap / 2**20)
        try:
            got = [[names[id(p)] for p in b.params] for b in buckets]
        except (AttributeError, KeyError, TypeError):
            raise CheckFailed(f"make_buckets returned {buckets!r:.80}: return a list of "
                              "Bucket(params) objects, each holding some of the module's own "
                              "parameters") from None
        want = _simulate_buckets(model, cap)
        if got == want:
            continue
        setting = f"with a cap of {cap} bytes, your buckets are {got}"
        for name, variant in (("forward", {"order": "forward"}), ("elements", {"unit": "elements"}),
                              ("after", {"close": "after"}), ("frozen", {"frozen": True})):
            if got == _simulate_buckets(model, cap, **variant):
                raise CheckFailed(f"{setting}: {BUCKET_MISTAKES[name]}")
        flat = [n for b in got for n in b]
        if sorted(flat) != sorted(n for b in want for n in b):
            raise CheckFailed(f"{setting}: every parameter that requires grad must be in "
                              "exactly one bucket")
        raise CheckFailed(f"{setting}; expected {want}: walk the parameters in reverse, and "
                          "start a new bucket when the next one would take it over the cap")


def _bucketed_worker(learner, rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from snippets.exercises.runner import _describe

    handles = _track_all_reduces()
    model = _ddp_model()
    ddp = learner.BucketedDDP(model, bucket_cap_mb=DDP_BUCKET_MB)
    out = {"grads": [], "unwaited": [], "async": [], "error": None}
    for step in range(2):
        x, y = _ddp_batch(step, rank)
        F.mse_loss(ddp(x), y).backward()
        try:
            ddp.sync_gradients()
        except Exception as err:  # noqa: BLE001 - the parent reports it with the step
            return out | {"error": _describe(err, Path(learner.__file__)), "step": step}
        out["unwaited"].append(sum(not h.waited for h in handles))
        out["async"].append(len(handles))
        handles.clear()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        _sgd_step(model)
    return out


@shows_prints
def check_bucketed_ddp(learner: ModuleType) -> list[str]:
    _judge_make_buckets(learner)
    p = DDP_WORLD
    ranks = run_learner(learner, _bucketed_worker, p)
    ref = _ddp_reference(p)
    for r, got in enumerate(ranks):
        if got["error"]:
            raise CheckFailed(f"on {p} processes, rank {r}'s sync_gradients raised "
                              f"{got['error']}")
    found = _first_unaveraged(ranks, ref, p)
    if found:
        step, r, what = found
        if what == "unwaited":
            raise CheckFailed(
                f"in step {step + 1}, rank {r} started {ranks[r]['unwaited'][step]} async "
                "all-reduce(s) and never waited on the handle: the buffer is not sure to hold "
                "the sum before work.wait() (this check lands it only at the wait, as a GPU "
                "may). A blocking dist.all_reduce(bucket.buffer) is all sync_gradients needs")
        if what == "local/p" and ranks[r]["async"][step]:
            raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are its own divided "
                              f"by {p}: {UNPACKED_BEFORE_WAIT}")
        if what == "sum":
            raise CheckFailed(
                f"the gradients are {p} times the mean: gradients not divided by the world "
                "size. all_reduce sums; each rank's loss is a mean over its own examples, "
                "so unpack with 1 / world")
        if what in ("local", "local/p"):
            raise CheckFailed(
                f"after step {step + 1}, rank {r}'s gradients are its own"
                f"{' divided by ' + str(p) if what == 'local/p' else ''}: the all-reduced "
                "sums never reached them. For each bucket: pack(), "
                "all_reduce(bucket.buffer), then unpack(1 / world), in that order")
        raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are not the mean "
                          "of the ranks' gradients")
    return [f"make_buckets, caps of {' and '.join(map(str, BUCKET_CAPS))} bytes and a frozen "
            "parameter: reverse order, bytes against the cap, a new bucket before it would "
            "overflow",
            f"{p} ranks: after each of 2 steps every gradient is the mean over the ranks "
            "(fp32, 1e-5)"]
