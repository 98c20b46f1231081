"""Check of exercise 21: ZeRO1Optimizer.step (zero.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from snippets.exercises.checks._ranks import _describe, _same
from snippets.exercises.checks._zero import (
    ZERO_LR,
    ZERO_STEPS,
    ZERO_WORLDS,
    _flat,
    _fmt,
    _local_grads,
    _plain_adamw,
    _zero_batch,
    _zero_model,
)
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


def _simulate_zero1(world: int, *, average=True, reduce=True, gather="after") -> list[dict]:
    """ZeRO-1 in one process, with the knobs learners get wrong: per step, each rank's flat
    gradient after the step and its parameters."""
    numel = sum(p.numel() for p in _zero_model().parameters())
    size = math.ceil(numel / world)
    start = torch.zeros(size * world)
    start[:numel] = _flat(_zero_model().parameters())
    full = [start.clone() for _ in range(world)]
    shards = [nn.Parameter(full[r][r * size:(r + 1) * size]) for r in range(world)]
    opts = [torch.optim.AdamW([s], lr=ZERO_LR) for s in shards]

    def gather_all():
        gathered = torch.cat([full[q][q * size:(q + 1) * size] for q in range(world)])
        with torch.no_grad():
            for f in full:
                f.copy_(gathered)

    steps = []
    for step in range(ZERO_STEPS):
        local = []
        for r in range(world):
            g = torch.zeros(size * world)
            g[:numel] = _local_grads(full[r][:numel], step, 0, r)
            local.append(g)
        total = sum(local)
        grads = [(total / world if average else total) if reduce else local[r]
                 for r in range(world)]
        if gather == "before":
            gather_all()
        for r in range(world):
            shards[r].grad = grads[r][r * size:(r + 1) * size].clone()
            opts[r].step()
        if gather == "after":
            gather_all()
        steps.append({"grads": [g[:numel] for g in grads],
                      "params": [f[:numel].clone() for f in full]})
    return steps


def _zero1_worker(learner, rank: int, world: int) -> dict:
    model = _zero_model()
    comm = learner.CommStats()
    opt = learner.ZeRO1Optimizer(model.parameters(), comm=comm, lr=ZERO_LR)
    out = {"grads": [], "params": [], "calls": [], "error": None}
    for step in range(ZERO_STEPS):
        x, y = _zero_batch(step, 0, rank)
        F.mse_loss(model(x), y).backward()
        comm.reset()
        try:
            opt.step()
        except Exception as err:  # noqa: BLE001 - the parent reports it, with the step
            return out | {"error": _describe(err, learner), "step": step}
        out["grads"].append(_flat(p.grad for p in model.parameters())
                            if all(p.grad is not None for p in model.parameters()) else None)
        out["params"].append(_flat(model.parameters()))
        out["calls"].append(dict(comm.calls))
        opt.zero_grad()
    return out


ZERO1_MISTAKES = (
    ({"average": False},
     "the gradients were summed, not averaged: {p} times too large. AdamW hides a constant "
     "factor (it divides by the gradient's running RMS), so the weights barely change, but "
     "gradient clipping, a logged gradient norm or plain SGD would be {p} times off: divide "
     "the all-reduced gradients by the world size"),
    ({"reduce": False},
     "the gradients were never all-reduced: each rank stepped its shard with its own "
     "micro-batch's gradient, so the shards were trained on different data. All-reduce "
     "self.flat_grads (and divide by the world size) before the step"),
    ({"gather": None},
     "each rank updated its own shard, but the other ranks' shards still hold their old "
     "values: the updated shards were never all-gathered. After self.optimizer.step(), "
     "all-gather every rank's shard into self.flat.full"),
    ({"gather": "before"},
     "all-gathered before the step, so the update used stale parameters: every rank's copy "
     "of the other shards is one step behind. Step first, then all-gather the updated shards"),
)


@shows_prints
def check_zero1(learner: ModuleType) -> list[str]:
    for p in ZERO_WORLDS:
        ranks = run_learner(learner, _zero1_worker, p)
        for r, got in enumerate(ranks):
            if got["error"]:
                raise CheckFailed(f"on {p} processes, rank {r}'s step {got['step'] + 1} "
                                  f"raised {got['error']}")
        ref = _plain_adamw(p)
        for step in range(ZERO_STEPS):
            where = f"with {p} ranks, after step {step + 1}"
            for r, got in enumerate(ranks):
                if (_same(got["grads"][step], ref[step]["grad"])
                        and _same(got["params"][step], ref[step]["params"])):
                    continue
                for knobs, message in ZERO1_MISTAKES:
                    sim = _simulate_zero1(p, **knobs)
                    # every step: gathered before the step looks like never gathered at first
                    if all(_same(ranks[q]["params"][s], sim[s]["params"][q])
                           and _same(ranks[q]["grads"][s], sim[s]["grads"][q])
                           for q in range(p) for s in range(ZERO_STEPS)):
                        dp = (got["params"][step] - ref[step]["params"]).abs().max()
                        dg = (got["grads"][step] - ref[step]["grad"]).abs().max()
                        raise CheckFailed(f"{message.format(p=p)}.\n  {where}, rank {r}'s "
                                          "parameters differ from single-process AdamW's by up "
                                          f"to {dp:.3g}, its gradients from the mean over the "
                                          f"ranks by up to {dg:.3g}")
                if got["grads"][step] is None:
                    raise CheckFailed(f"{where}, a parameter's .grad on rank {r} is None: the "
                                      "step must leave each p.grad a view of self.flat_grads")
                if not _same(got["grads"][step], ref[step]["grad"]):
                    raise CheckFailed(f"{where}, rank {r}'s gradients are "
                                      f"{_fmt(got['grads'][step])}; the mean over the ranks is "
                                      f"{_fmt(ref[step]['grad'])}")
                raise CheckFailed(f"{where}, rank {r}'s parameters are "
                                  f"{_fmt(got['params'][step])}; single-process AdamW gives "
                                  f"{_fmt(ref[step]['params'])}")
        calls = ranks[0]["calls"][0]
        if calls.get("all_reduce") != 1 or calls.get("all_gather") != 1:
            raise CheckFailed(
                f"the parameters are right, but self.comm saw {calls or 'no collective'} in one "
                "step: make the all-reduce and the all-gather through self.comm "
                "(self.comm.all_reduce, self.comm.all_gather), which counts the traffic the "
                "ZeRO lesson compares, one of each per step")
    return [f"{' and '.join(map(str, ZERO_WORLDS))} ranks: after each of {ZERO_STEPS} steps every "
            "rank's parameters equal single-process AdamW on the global batch (fp32, 1e-5)",
            "the gradients are the mean over the ranks, not the sum",
            "one all-reduce of the gradients and one all-gather of the updated shards per step"]
