"""Check of exercise 20: OverlappedDDP's hooks (ddp.py).

What the exercise teaches is the overlap: each bucket's all-reduce starts, without blocking,
the moment the bucket's last gradient is accumulated, travels while backward computes the
earlier layers, and is waited on when backward ends. So the check measures it. On each rank
the worker records, in order, every gradient accumulated (a hook registered before
OverlappedDDP's, so for each parameter it runs first), the end of backward (a callback queued
before the learner's _finish, so it runs first), every all-reduce launched (async or blocking,
and of which bucket) and every handle's first wait. Only the order of these events is judged,
never a time. An async all-reduce lands its sum in the bucket's buffer at the wait and not
before (_ddp._TrackedWork), so a buffer unpacked before its wait gives wrong
gradients every time.

Three steps on 2 gloo processes: two plain backwards (the second shows that the per-backward
state is reset), then two micro-batches, the first inside no_sync(), which must communicate
nothing.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType

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


DDP_MICRO = (1, 1, 2)  # backwards per step; in the last step the first runs inside no_sync()


def _overlap_worker(learner, rank: int, world: int) -> dict:
    import torch.nn.functional as F
    from torch.autograd import Variable

    from snippets.exercises.runner import _describe
    from snippets.scratch import ddp as solution

    model = _ddp_model()
    names = {id(p): n for n, p in model.named_parameters()}
    backwards = []  # per backward: inside no_sync() or not, and its events in order

    def note(*event):
        if backwards:
            backwards[-1]["events"].append(event)

    def on_grad(param):
        if not any(e[0] == "grad" for e in backwards[-1]["events"]):
            Variable._execution_engine.queue_callback(lambda: note("end"))
        note("grad", names[id(param)])

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_grad)
    # Exercise 27's make_buckets, the solution's: this exercise is judged on its own.
    learner.make_buckets = solution.make_buckets
    ddp = learner.OverlappedDDP(model, bucket_cap_mb=DDP_BUCKET_MB)
    bucket_of = {id(b.buffer): i for i, b in enumerate(ddp.buckets)}
    handles = _track_all_reduces(
        on_launch=lambda tensor, async_op: note("launch", bucket_of.get(id(tensor)), async_op),
        on_wait=lambda tensor: note("wait", bucket_of.get(id(tensor))))
    out = {"grads": [], "unwaited": [], "async": [], "backwards": backwards, "error": None,
           "buckets": [[names[id(p)] for p in b.params] for b in ddp.buckets]}
    for step, micros in enumerate(DDP_MICRO):
        for micro in range(micros):
            no_sync = micro < micros - 1
            backwards.append({"step": step, "no_sync": no_sync, "events": []})
            x, y = _ddp_batch(step, rank, micro)
            try:
                with ddp.no_sync() if no_sync else contextlib.nullcontext():
                    F.mse_loss(ddp(x), y).backward()
            except Exception as err:  # noqa: BLE001 - the parent reports it with the step
                return out | {"error": _describe(err, Path(learner.__file__)), "step": step,
                              "no_sync": no_sync}
        out["unwaited"].append(sum(not h.waited for h in handles))
        out["async"].append(len(handles))
        handles.clear()
        out["grads"].append([None if p.grad is None else p.grad.clone()
                             for p in model.parameters()])
        _sgd_step(model)
    return out


def _judge_error(r: int, got: dict, p: int) -> None:
    text = got["error"]
    if "NoneType" in text:
        raise CheckFailed(
            f"rank {r} packed a bucket before all its gradients existed ({text.splitlines()[0]}): "
            "reducing before all the bucket's hooks have fired. Launch a bucket's "
            "all-reduce only when bucket.ready == len(bucket.params)")
    if got["step"] == 1:
        raise CheckFailed(
            f"the first backward synchronised, the second raised {text}\n  Likely "
            "cause: _finish must reset the per-backward state for the next one: "
            "bucket.ready = 0 for every bucket, the pending list, callback_queued")
    if got["step"] == 2:
        raise CheckFailed(
            f"the backward {'inside' if got['no_sync'] else 'after'} a no_sync() block raised "
            f"{text}\n  Likely cause: inside no_sync() the hook must return at once, before "
            "it counts a gradient or queues _finish: the backward after the block then "
            "reduces the accumulated gradients")
    raise CheckFailed(f"on {p} processes, rank {r}'s backward raised {text}")


def _judge_values(ranks: list, p: int) -> None:
    found = _first_unaveraged(ranks, _ddp_reference(p, DDP_MICRO), p)
    if not found:
        return
    step, r, what = found
    names = [name for name, _ in _ddp_model().named_parameters()]
    grads = ranks[r]["grads"][step]
    if what == "unwaited":
        raise CheckFailed(
            f"in step {step + 1}, rank {r} left {ranks[r]['unwaited'][step]} async all-reduce(s) "
            "never waited on: stepping before the handles are waited on. Until work.wait() "
            "returns the buffer is not sure to hold the sum (this check lands it only at the "
            "wait, as a GPU may); call work.wait() in _finish before bucket.unpack")
    if what == "missing":
        missing = next(n for n, g in zip(names, grads) if g is None)
        raise CheckFailed(f"after step {step + 1}, rank {r}'s {missing} has no gradient: "
                          "unpack must write every parameter's .grad")
    if what == "sum":
        raise CheckFailed(
            f"the gradients are {p} times the mean: you summed instead of averaging. Each "
            "rank's loss is a mean over its own examples; divide the all-reduced sum by the "
            "world size (bucket.unpack(1 / world))")
    if what == "local/p" and ranks[r]["async"][step]:
        raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are its own divided by "
                          f"{p}: {UNPACKED_BEFORE_WAIT}")
    if what in ("local", "local/p"):
        raise CheckFailed(
            f"after step {step + 1}, rank {r} kept its own gradients: they were never averaged"
            + (". The first backward was averaged: _finish must reset bucket.ready to 0 (and "
               "pending, callback_queued), or no bucket fills again" if step else
               ": in the hook, count the bucket's ready gradients and launch "
               "dist.all_reduce(bucket.buffer, async_op=True) when the last one arrives"))
    raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are not the mean of the "
                      "ranks' gradients")


BLOCKS = ("your hook's all-reduce blocks backward: {how}. Backward then stops at every full "
          "bucket until the ranks have exchanged it, so no communication overlaps the "
          "computing of the earlier layers, which is what OverlappedDDP is for. Launch it "
          "with async_op=True, keep the handle in self.pending, and wait on the handles in "
          "_finish, once backward has ended")
AFTER_BACKWARD = ("every bucket's all-reduce was launched after backward had ended (in "
                  "_finish): that is BucketedDDP, with nothing overlapped. Launch each bucket's "
                  "all-reduce from the hook, as soon as its last gradient arrives, while "
                  "backward goes on with the earlier layers")
INSIDE_NO_SYNC = ("inside no_sync() your hook launched {n} all-reduce(s): no_sync() lets "
                  "micro-batches accumulate their gradients locally and communicate once, "
                  "after the last. The hook must return at once when not self.require_sync")


def _judge_overlap(got: dict, r: int) -> int:
    """Raises CheckFailed when a backward of rank r communicated at the wrong time; returns how
    many gradients were still to compute when the first bucket was launched."""
    buckets, ahead = got["buckets"], None
    for number, backward in enumerate(got["backwards"], 1):
        events = backward["events"]
        where = f"\n  Measured on rank {r}, in backward {number}: {_timeline(events)}"
        launches = [(i, e) for i, e in enumerate(events) if e[0] == "launch"]
        if backward["no_sync"]:
            if launches:
                raise CheckFailed(INSIDE_NO_SYNC.format(n=len(launches)) + where)
            continue
        end = next((i for i, e in enumerate(events) if e == ("end",)), len(events))
        order = [e[1] for e in events if e[0] == "grad"]
        if any(not async_op and i < end for i, (_, _, async_op) in launches):
            raise CheckFailed(BLOCKS.format(how="it is a blocking dist.all_reduce (no "
                                            "async_op=True)") + where)
        if any(e[0] == "wait" and i < end for i, e in enumerate(events)):
            raise CheckFailed(BLOCKS.format(how="you wait() on the handle before backward has "
                                            "ended, in the hook") + where)
        if launches and all(i > end for i, _ in launches):
            raise CheckFailed(AFTER_BACKWARD + where)
        for i, (_, b, _) in launches:
            if b is None or i > end or not set(buckets[b]) <= set(order):
                continue
            done = sum(e[0] == "grad" for e in events[:i])
            last = max(order.index(name) for name in buckets[b]) + 1
            if done > last:
                raise CheckFailed(
                    f"bucket {b} ({', '.join(buckets[b])}) was complete after gradient {last} of "
                    f"{len(order)}, but its all-reduce was launched only after gradient {done}: "
                    "it could have travelled while backward computed the others. Launch each "
                    "bucket's all-reduce from the hook of its last gradient" + where)
            if ahead is None:
                ahead = len(order) - done
    return ahead


def _timeline(events: list) -> str:
    """The events in the order they happened, as the messages show them."""

    def show(event):
        kind = event[0]
        if kind == "grad":
            return event[1]
        if kind == "end":
            return "| backward ends |"
        what = f"bucket {event[1]}" if event[1] is not None else "a tensor"
        if kind == "wait":
            return f"wait({what})"
        return f"all_reduce({what}{', async' if event[2] else ''})"
    return " ".join(map(show, events))


@shows_prints
def check_overlapped_ddp(learner: ModuleType) -> list[str]:
    p = DDP_WORLD
    ranks = run_learner(learner, _overlap_worker, p)
    for r, got in enumerate(ranks):
        if got["error"]:
            _judge_error(r, got, p)
    _judge_values(ranks, p)
    ahead = [_judge_overlap(got, r) for r, got in enumerate(ranks)][0]
    grads = sum(e[0] == "grad" for e in ranks[0]["backwards"][0]["events"])
    return [f"{p} ranks, 2 buckets: after each of {len(DDP_MICRO)} steps every gradient is the "
            "mean over the ranks (fp32, 1e-5); the second backward synchronises too",
            "each bucket's all-reduce is launched async from the hook of its last gradient (the "
            f"first with {ahead} of {grads} gradients still to compute) and waited on after "
            "backward ends, before its bucket is unpacked",
            "inside no_sync() nothing is communicated; the next backward averages the "
            "accumulated gradients"]
