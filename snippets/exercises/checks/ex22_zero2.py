"""Check of exercise 22: ZeRO2Optimizer._grad_ready (zero.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from snippets.exercises.checks._ranks import _describe, _same
from snippets.exercises.checks._zero import (
    ZERO_LR,
    ZERO_WORLDS,
    _flat,
    _fmt,
    _plain_adamw,
    _zero_batch,
    _zero_model,
)
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


ZERO2_BUCKET_MB = 56 / 2**20  # 56 bytes: buckets [b2, w2, b1] and [w1] of the model above
ZERO2_MICRO = (2, 1)  # micro-batches per step: the first step accumulates two


def _zero2_worker(learner, rank: int, world: int) -> dict:
    import torch.distributed as dist

    all_reduces, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        all_reduces.append(tensor.numel())
        return original(tensor, *args, **kwargs)
    dist.all_reduce = counting

    model = _zero_model()
    comm = learner.CommStats()
    opt = learner.ZeRO2Optimizer(model.parameters(), comm=comm, bucket_cap_mb=ZERO2_BUCKET_MB,
                                 lr=ZERO_LR)
    out = {"shard_grads": [], "params": [], "calls": [], "kept": [], "error": None}
    for step, micros in enumerate(ZERO2_MICRO):
        comm.reset()
        all_reduces.clear()
        for micro in range(micros):
            x, y = _zero_batch(step, micro, rank)
            try:
                F.mse_loss(model(x), y).backward()
            except Exception as err:  # noqa: BLE001 - the parent reports it
                return out | {"error": _describe(err, learner), "step": step, "micro": micro,
                              "where": "backward"}
            out["kept"].append([n for n, p in model.named_parameters() if p.grad is not None])
        out["shard_grads"].append([None if s.grad is None else s.grad.clone()
                                   for s in opt.shards])
        try:
            opt.step()
        except Exception as err:  # noqa: BLE001
            return out | {"error": _describe(err, learner), "step": step, "where": "step"}
        out["params"].append(_flat(model.parameters()))
        out["calls"].append(dict(comm.calls) | {"dist.all_reduce": len(all_reduces)})
        opt.zero_grad()
    return out


def _bucket_shards(flat_grad: torch.Tensor, world: int) -> list[list[torch.Tensor]]:
    """[bucket][rank]: rank's shard of each bucket of a flat gradient laid out like the model's
    parameters."""
    from snippets.scratch.zero import buckets_by_size

    params = list(_zero_model().parameters())
    pieces = dict(zip(map(id, params), flat_grad.split([p.numel() for p in params])))
    out = []
    for bucket in buckets_by_size(params, ZERO2_BUCKET_MB):
        flat = torch.cat([pieces[id(p)] for p in bucket])
        size = math.ceil(flat.numel() / world)
        flat = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
        out.append(list(flat.split(size)))
    return out


@shows_prints
def check_zero2(learner: ModuleType) -> list[str]:
    for p in ZERO_WORLDS:
        ranks = run_learner(learner, _zero2_worker, p)
        for r, got in enumerate(ranks):
            if not got["error"]:
                continue
            text, step = got["error"], got["step"]
            if "some buckets were not reduced" in text:
                raise CheckFailed(
                    f"step {step + 1} raised {text.splitlines()[0]}\n  Likely cause: the hook "
                    "reduce-scattered but did not set self.reduced[i] = True (or never "
                    "reduce-scattered): step() checks that every bucket was reduced")
            if "NoneType" in text and (step, got.get("micro")) == (0, 0):
                raise CheckFailed(
                    f"rank {r}'s first backward raised {text}\n  Likely cause: reducing "
                    "before all the bucket's gradients exist. Count the bucket's ready "
                    "gradients (self.ready[i] += 1) and reduce-scatter only when it reaches "
                    "len(bucket.params)")
            if "NoneType" in text:
                raise CheckFailed(
                    f"the first backward worked, a later one raised {text}\n  Likely cause: "
                    "self.ready[i] was not reset to 0 after the reduce-scatter, so the next "
                    "backward reduces the bucket at its first gradient")
            raise CheckFailed(f"on {p} processes, rank {r}'s {got['where']} in step "
                              f"{step + 1} raised {text}")
        kept = next((names for names in ranks[0]["kept"] if names), None)
        if kept:
            raise CheckFailed(
                f"after backward {kept[0]}.grad still holds the full gradient: ZeRO-2's saving "
                "is freeing it, and a kept .grad is added into by the next backward, so its "
                "gradient is reduce-scattered twice. After the reduce-scatter set p.grad = None "
                "for every parameter of the bucket")
        ref = _plain_adamw(p, ZERO2_MICRO)
        for step in range(len(ZERO2_MICRO)):
            want = _bucket_shards(ref[step]["grad"], p)
            where = f"with {p} ranks, in step {step + 1}"
            for r, got in enumerate(ranks):
                shards = got["shard_grads"][step]
                for b, (mine, expected) in enumerate(zip(shards, want)):
                    if _same(mine, expected[r]):
                        continue
                    said = f"{where}, rank {r}'s gradient shard of bucket {b} is "
                    if mine is None:
                        raise CheckFailed(said + "None: the hook must set (or add into) "
                                          "self.shards[i].grad")
                    said += f"{_fmt(mine)}; expected {_fmt(expected[r])}"
                    if _same(mine, p * expected[r]):
                        raise CheckFailed(f"the gradients were summed, not averaged: {p} "
                                          "times too large. reduce_scatter sums over the ranks; "
                                          f"divide by the world size.\n  {said}")
                    other = [q for q in range(p) if q != r and _same(mine, expected[q])]
                    if other:
                        raise CheckFailed(f"reduce-scatter shard given to the wrong rank: rank "
                                          f"{r} holds the averaged gradient of rank {other[0]}'s "
                                          "shard. Rank r owns flat[r * S:(r + 1) * S] "
                                          f"(bucket.local(flat)).\n  {said}")
                    local = _bucket_shards(ref[step]["local"][r], p)[b][r]
                    if _same(mine, local) or _same(mine, local / p):
                        raise CheckFailed("the gradients were never reduced across the ranks: "
                                          f"rank {r} holds its own gradient. reduce-scatter the "
                                          f"bucket's flat gradient.\n  {said}")
                    last = _bucket_shards(ref[step]["last_micro"], p)[b][r]
                    if ZERO2_MICRO[step] > 1 and _same(mine, last):
                        raise CheckFailed(
                            "with 2 micro-batches in one step, the shard holds only the last "
                            "micro-batch's gradient: the hook overwrote self.shards[i].grad. "
                            "Add into it when it already exists (gradient accumulation).\n  "
                            + said)
                    raise CheckFailed(said)
                if not _same(got["params"][step], ref[step]["params"]):
                    raise CheckFailed(f"{where}, rank {r}'s gradient shards are right but its "
                                      f"parameters after the step are {_fmt(got['params'][step])}"
                                      f"; single-process AdamW gives {_fmt(ref[step]['params'])}")
        got = ranks[0]
        calls = got["calls"][0]
        if calls.get("all_reduce") or calls.get("dist.all_reduce"):
            raise CheckFailed(
                "the gradient shards are right, but the gradients were all-reduced, not "
                "reduce-scattered: every rank received the whole summed gradient (twice "
                "reduce-scatter's traffic) and kept 1/N of it. self.comm.reduce_scatter(received, "
                "bucket.flat_grad()) sends and receives only the shards")
        buckets = len(got["shard_grads"][0])
        if calls.get("reduce_scatter") != ZERO2_MICRO[0] * buckets:
            raise CheckFailed(
                f"the numbers are right, but self.comm saw {calls}: reduce-scatter each bucket "
                "once per backward through self.comm.reduce_scatter, which counts the traffic")
    return [f"{' and '.join(map(str, ZERO_WORLDS))} ranks, 2 buckets: each rank holds the mean "
            "gradient of its own shard only, accumulated over 2 micro-batches (fp32, 1e-5)",
            "the parameters after each step equal single-process AdamW",
            "reduce-scattered, not all-reduced: one reduce-scatter per bucket per backward, and "
            "the full gradients freed"]
