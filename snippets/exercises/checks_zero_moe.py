"""Checks of exercises 21-24: ZeRO stages 1, 2 and 3 (snippets/scratch/zero.py) and expert
parallelism's dispatch (snippets/scratch/moe.py).

As in checks_parallel.py, each check runs the learner's file on gloo processes through
gang.run_learner (one start per check, a hard time limit, a deadlock reported with each waiting
rank's call), compares every rank with single-process training, and computes the usual wrong
answers in one process (gradients summed, shards stale, rows in the wrong order, ...) so that a
result matching one of them is named.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import torch.optim  # noqa: F401 - imported here, in the forkserver, not in each rank's time
from torch import nn

import snippets.models.gpt  # noqa: F401 - the learner's moe.py imports it: preloaded once
import snippets.planner.memory  # noqa: F401 - and zero.py this
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed
from snippets.exercises.runner import _describe as describe


def _describe(err: BaseException, learner) -> str:
    return describe(err, Path(learner.__file__))


def _same(a, b) -> bool:
    # fp32. The mean over the ranks is summed in another order than the reference's (gloo's
    # order), and AdamW turns a relative error e in a gradient into about e in the update:
    # 1e-5 relative, far below every mistake's difference (a factor N, a whole step).
    return (a is not None and b is not None and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-5, atol=1e-6))


def _fmt(t: torch.Tensor, n: int = 6) -> str:
    values = [round(float(v), 4) for v in t.reshape(-1)[:n].tolist()]
    return str(values)[:-1] + (", ...]" if t.numel() > n else "]")


# ---------------------------------------------------------------- ZeRO: shared model and data

ZERO_WORLDS = (2, 4)  # 26 parameters: shards of 13 on 2 ranks; of 7, padded to 28, on 4
ZERO_LR = 0.05
ZERO_STEPS = 2


def _zero_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _zero_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _local_grads(flat: torch.Tensor, step: int, micro: int, rank: int) -> torch.Tensor:
    """The gradient of rank `rank`'s loss, as one flat tensor, at the flat parameters `flat`."""
    model = _zero_model()
    names = [n for n, _ in model.named_parameters()]
    flat = flat.detach().clone().requires_grad_(True)
    views = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in model.parameters()]),
                                          model.parameters())]
    x, y = _zero_batch(step, micro, rank)
    out = torch.func.functional_call(model, dict(zip(names, views)), (x,))
    (grad,) = torch.autograd.grad(F.mse_loss(out, y), flat)
    return grad


def _plain_adamw(world: int, micro_batches=(1,) * ZERO_STEPS, optimizer="adamw") -> list[dict]:
    """Single-process training on the global batch (the mean over the ranks' losses): per
    step, the mean gradient and the parameters after the step."""
    model = _zero_model()
    params = list(model.parameters())
    opt = (torch.optim.AdamW(params, lr=ZERO_LR) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=ZERO_LR))
    steps = []
    for step, micros in enumerate(micro_batches):
        flat = _flat(params)
        local = [sum(_local_grads(flat, step, m, r) for m in range(micros)) for r in range(world)]
        mean = sum(local) / world
        for p, g in zip(params, mean.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        opt.step()
        opt.zero_grad()
        steps.append({"grad": mean, "local": local, "params": _flat(params),
                      "last_micro": sum(_local_grads(flat, step, micros - 1, r)
                                        for r in range(world)) / world})
    return steps


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


# ---------------------------------------------------------------- exercise 21: ZeRO-1


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


# ---------------------------------------------------------------- exercise 22: ZeRO-2

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


# ---------------------------------------------------------------- exercise 23: ZeRO-3

ZERO3_WORLDS = (2, 4)


class _ZeRO3Net(nn.Module):
    """Two blocks in `layers` (ZeRO3's default units) and a head in the root unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _zero3_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _zero3_worker(learner, rank: int, world: int) -> dict:
    model = _ZeRO3Net()
    comm = learner.CommStats()
    out = {"y": [], "held_after_forward": [], "held_after_backward": [], "gathers": [],
           "frees_in_forward": [], "params": [], "error": None}
    frees, free = [], learner.ShardedUnit.free

    def counting_free(unit):  # free() named apart from its body: is it called at all?
        frees.append(unit)
        return free(unit)
    learner.ShardedUnit.free = counting_free
    try:
        zero = learner.ZeRO3(model, comm=comm)
        opt = torch.optim.SGD(zero.parameters(), lr=ZERO_LR)
    except Exception as err:  # noqa: BLE001 - the parent reports it
        return out | {"error": _describe(err, learner), "where": "ZeRO3(model)", "step": 0}

    def held() -> int:  # bytes the model's parameters still hold
        return sum(p.untyped_storage().nbytes() for p in model.parameters())

    for step in range(ZERO_STEPS):
        x, y = _zero3_batch(step, rank)
        comm.reset()
        frees.clear()
        try:
            pred = zero(x)
        except Exception as err:  # noqa: BLE001
            return out | {"error": _describe(err, learner), "where": "forward", "step": step}
        out["frees_in_forward"].append(len(frees))
        out["y"].append(pred.detach().clone())
        out["held_after_forward"].append(held())
        try:
            F.mse_loss(pred, y).backward()
        except Exception as err:  # noqa: BLE001
            return out | {"error": _describe(err, learner), "where": "backward", "step": step}
        out["held_after_backward"].append(held())
        out["gathers"].append(comm.calls.get("all_gather", 0))
        opt.step()
        opt.zero_grad()
    try:
        out["params"] = {k: v.clone() for k, v in zero.full_state_dict().items()}
    except Exception as err:  # noqa: BLE001
        return out | {"error": _describe(err, learner), "where": "full_state_dict", "step": 1}
    return out


def _zero3_reference(world: int) -> dict:
    model = _ZeRO3Net()
    opt = torch.optim.SGD(model.parameters(), lr=ZERO_LR)
    out = {"y": [], "params": None}
    for step in range(ZERO_STEPS):
        ys = []
        for r in range(world):
            x, y = _zero3_batch(step, r)
            pred = model(x)
            ys.append(pred.detach())
            (F.mse_loss(pred, y) / world).backward()  # the mean over the ranks' losses
        out["y"].append(ys)
        opt.step()
        opt.zero_grad()
    out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out


@shows_prints
def check_zero3(learner: ModuleType) -> list[str]:
    units = 3  # two blocks and the root
    for p in ZERO3_WORLDS:
        ranks = run_learner(learner, _zero3_worker, p)
        for r, got in enumerate(ranks):
            if not got["error"]:
                continue
            text, where = got["error"], got["where"]
            said = f"on {p} processes, rank {r}'s {where} (step {got['step'] + 1}) raised {text}"
            if where == "backward" and ("storage" in text.lower() or "size" in text.lower()):
                raise CheckFailed(
                    "backward ran on freed parameters: the weights were freed after forward "
                    "and not gathered again when backward reached the unit. In _after_forward, "
                    "register a hook on each output tensor that requires grad "
                    "(t.register_hook) that calls unit.gather() and returns the gradient.\n  "
                    + said)
            if where == "forward" and ("storage" in text.lower() or "size" in text.lower()):
                raise CheckFailed(
                    "forward ran on freed parameters or gathered into freed storage: gather() "
                    "must first give the flat buffer its bytes back "
                    "(self.flat.full.untyped_storage().resize_(self.full_bytes)), then "
                    "all-gather the shards into it, and set self.gathered = True; free() sets "
                    "it back to False.\n  " + said)
            raise CheckFailed(said)
        ref = _zero3_reference(p)
        for step in range(ZERO_STEPS):
            for r, got in enumerate(ranks):
                if not _same(got["y"][step], ref["y"][step][r]):
                    raise CheckFailed(
                        f"with {p} ranks, rank {r}'s output in step {step + 1} is "
                        f"{_fmt(got['y'][step])}; the single-process model gives "
                        f"{_fmt(ref['y'][step][r])}"
                        + (": the first forward is right, so the weights a forward sees are "
                           "not the updated ones. gather() must all-gather the current shards "
                           "(self.shard) into the very storage the parameters view"
                           if step else ""))
        for r, got in enumerate(ranks):
            for name, want in ref["params"].items():
                if not _same(got["params"].get(name), want):
                    raise CheckFailed(f"with {p} ranks, rank {r}'s {name} after "
                                      f"{ZERO_STEPS} SGD steps is {_fmt(got['params'][name])}; "
                                      f"single-process training gives {_fmt(want)}")
        got = ranks[0]
        if got["held_after_forward"][0] and not got["frees_in_forward"][0]:
            raise CheckFailed(
                f"the numbers are right, but after forward the parameters still hold "
                f"{got['held_after_forward'][0]} bytes: the full weights were never freed, "
                "because free() was never called in forward, so ZeRO-3 holds as much as "
                "ZeRO-2. _after_forward must free the unit (unit.free()) before it hooks the "
                "outputs for backward's re-gather")
        if got["held_after_forward"][0]:
            raise CheckFailed(
                f"the numbers are right, but after forward the parameters still hold "
                f"{got['held_after_forward'][0]} bytes: free() was called "
                f"{got['frees_in_forward'][0]} times in forward, but the full weights were never "
                "freed, so ZeRO-3 holds as much as ZeRO-2. free() must release the flat buffer's bytes "
                "in place (self.flat.full.untyped_storage().resize_(0)): the parameters are "
                "views of it, and a new tensor in its place frees nothing")
        if got["gathers"][0] != 2 * units:
            raise CheckFailed(
                f"the numbers are right, but one step made {got['gathers'][0]} all-gathers for "
                f"{units} units; ZeRO-3 makes 2 per unit (before its forward, and again in "
                "backward): gather() must go through self.comm.all_gather and skip a unit "
                "that is already gathered")
    return [f"{' and '.join(map(str, ZERO3_WORLDS))} ranks, 3 units: outputs and the weights "
            f"after {ZERO_STEPS} SGD steps equal single-process training (fp32, 1e-5)",
            "after forward no full weights are left: each unit is freed after its forward",
            "each unit is all-gathered twice per step: before its forward and again in backward"]


# ---------------------------------------------------------------- exercise 24: MoE dispatch

MOE_CASES = ((2, 4), (4, 8))  # (ranks, experts): two local experts per rank in both
MOE_HIDDEN = 4


class _SplitsDisagree(Exception):
    """An all_to_all whose ranks disagree on how many rows go where (raised before gloo sees it,
    which would crash or hang)."""


def _moe_counts(world: int, experts: int, rank: int) -> torch.Tensor:
    """Rows rank `rank` sends to each expert: uneven, some zero, different on every rank."""
    g = torch.Generator().manual_seed(70 + 7 * world + rank)
    return torch.randint(0, 4, (experts,), generator=g)


def _moe_rows(world: int, experts: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = _moe_counts(world, experts, rank)
    g = torch.Generator().manual_seed(900 + 7 * world + rank)
    n = int(counts.sum())
    return torch.randn(n, MOE_HIDDEN, generator=g), torch.randn(n, MOE_HIDDEN, generator=g)


def _moe_layer(module, experts: int):
    """module's MoE layer (the learner's or the solution's), with the same tiny weights."""
    from dataclasses import replace

    config = replace(snippets.models.gpt.get_config("tiny"), hidden_size=MOE_HIDDEN,
                     intermediate_size=6, num_attention_heads=1)
    torch.manual_seed(0)
    return module.MoE(config, num_experts=experts, top_k=2, capacity_factor=None)


def _checked_all_to_all(log: list, original, gather):
    """dist.all_to_all_single that first checks every rank agrees on the row counts."""
    import torch.distributed as dist

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        world = dist.get_world_size(group)
        sizes = []
        for splits, t, name in ((input_split_sizes, input, "input_split_sizes"),
                                (output_split_sizes, output, "output_split_sizes")):
            if splits is None:
                splits = [t.shape[0] // world] * world
            splits = [int(s) for s in splits]
            if len(splits) != world:
                raise _SplitsDisagree({"call": len(log), "kind": "length", "name": name,
                                       "length": len(splits), "world": world})
            sizes.append(splits)
        mine = torch.tensor(sizes[0] + sizes[1] + [input.shape[0], output.shape[0]])
        width = 2 * world + 2
        everyone = torch.empty(world * width, dtype=mine.dtype)
        # An all-gather made of all_to_all_single, so that a rank waiting here for a peer that
        # skipped the exchange is reported as waiting in all_to_all_single.
        gather(everyone, mine.repeat(world), group=group)
        table = everyone.view(world, width).tolist()  # [rank][send to each, recv from each, rows]
        log.append({"float": input.is_floating_point(), "rows": input.shape[0]})
        call = len(log) - 1
        for rank, row in enumerate(table):
            send, recv, rows_in, rows_out = row[:world], row[world:2 * world], row[-2], row[-1]
            if sum(send) != rows_in or sum(recv) != rows_out:
                raise _SplitsDisagree({"call": call, "kind": "total", "rank": rank,
                                       "send": send, "recv": recv, "rows_in": rows_in,
                                       "rows_out": rows_out, "log": list(log)})
        for src in range(world):
            for dst in range(world):
                if table[src][dst] != table[dst][world + src]:
                    raise _SplitsDisagree({"call": call, "kind": "rows", "src": src,
                                           "dst": dst, "sent": table[src][dst],
                                           "expected": table[dst][world + src],
                                           "log": list(log)})
        return original(output, input, output_split_sizes, input_split_sizes, group=group,
                        async_op=async_op)
    return all_to_all_single


def _moe_worker(learner, rank: int, world: int, experts: int) -> dict:
    import torch.distributed as dist

    log = []
    original = dist.all_to_all_single
    dist.all_to_all_single = _checked_all_to_all(log, original, original)
    moe = _moe_layer(learner, experts)
    learner.apply_expert_parallel(moe)
    inputs, weights = _moe_rows(world, experts, rank)
    inputs.requires_grad_(True)
    counts = _moe_counts(world, experts, rank)
    out = {"log": log, "error": None, "mismatch": None}
    try:
        y = learner.dispatch_to_experts(moe, inputs, counts.clone())
    except _SplitsDisagree as err:
        return out | {"mismatch": err.args[0], "where": "forward"}
    except Exception as err:  # noqa: BLE001 - the parent reports it
        return out | {"error": _describe(err, learner), "where": "forward"}
    out |= {"y": y.detach().clone(), "requires_grad": y.requires_grad,
            "forward_calls": len(log)}
    if y.shape != inputs.shape or not y.requires_grad:
        return out
    try:
        (y * weights).sum().backward()
    except _SplitsDisagree as err:
        return out | {"mismatch": err.args[0], "where": "backward"}
    except Exception as err:  # noqa: BLE001
        return out | {"error": _describe(err, learner), "where": "backward"}
    return out | {"x_grad": None if inputs.grad is None else inputs.grad.clone(),
                  "expert_grads": [[None if p.grad is None else p.grad.clone()
                                    for p in e.parameters()] for e in moe.experts]}


def _moe_reference(world: int, experts: int, variant: str = "") -> dict:
    """Every rank's dispatch output, computed in one process with all the experts; `variant`
    is a wrong order learners write: "no-regroup" (the experts run on the received rows as they
    arrive, by source rank) or "no-restore" (the results go back in expert order)."""
    from snippets.scratch import moe as solution

    layer = _moe_layer(solution, experts)
    local = experts // world
    counts = [_moe_counts(world, experts, r) for r in range(world)]
    rows = [_moe_rows(world, experts, r)[0].requires_grad_(True) for r in range(world)]
    pieces = [list(x.split(c.tolist())) for x, c in zip(rows, counts)]  # [src][expert]
    outs = [[None] * experts for _ in range(world)]
    for dst in range(world):
        # (src, j) in arrival order: by source rank, then local expert
        arrived = [(s, j) for s in range(world) for j in range(local)]
        received = torch.cat([pieces[s][dst * local + j] for s, j in arrived] or
                             [rows[0][:0]])
        sizes = [counts[s][dst * local + j].item() for s, j in arrived]
        if variant == "no-regroup":
            per_expert = [sum(counts[s][dst * local + j].item() for s in range(world))
                          for j in range(local)]
            done = torch.cat([layer.experts[dst * local + j](chunk) for j, chunk in
                              enumerate(received.split(per_expert))])
        else:
            done = torch.cat([layer.experts[dst * local + j](pieces[s][dst * local + j])
                              for s, j in arrived])
            if variant == "no-restore":
                by_expert = sorted(range(len(arrived)), key=lambda i: (arrived[i][1], i))
                chunks = done.split(sizes)
                done = torch.cat([chunks[i] for i in by_expert])
        for (s, j), chunk in zip(arrived, done.split(sizes)):
            outs[s][dst * local + j] = chunk
    ys = [torch.cat(o) for o in outs]
    result = {"y": [y.detach() for y in ys]}
    if not variant:
        loss = sum((y * _moe_rows(world, experts, r)[1]).sum() for r, y in enumerate(ys))
        loss.backward()
        result["x_grad"] = [x.grad for x in rows]
        result["expert_grads"] = [[p.grad for p in e.parameters()] for e in layer.experts]
    return result


def _rows(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def _moe_mismatch(m: dict) -> str:
    if m["kind"] == "length":
        return (f"all_to_all number {m['call'] + 1} got {m['length']} {m['name']} on "
                f"{m['world']} ranks: the splits are per RANK, not per expert. Add up each "
                "rank's experts: tokens_per_expert.view(world, local).sum(dim=1)")
    earlier = m["log"][:m["call"]]
    if m["kind"] == "total":
        said = (f"in all_to_all number {m['call'] + 1}, rank {m['rank']} passes "
                f"{_rows(m['rows_in'])} with input splits {m['send']}, and an output of "
                f"{_rows(m['rows_out'])} with output splits {m['recv']}")
        if sum(c["float"] for c in earlier) >= 1:
            return ("the results go back with the splits of the way out: on the return trip "
                    "each rank sends what it received from every rank (recv_splits) and "
                    "receives what it sent (send_splits): AllToAll.apply(back, recv_splits, "
                    f"send_splits, group).\n  {said}")
        return ("the splits do not add up to the rows: input splits must sum to the rows you "
                f"send, output splits to the rows you receive.\n  {said}")
    said = (f"in all_to_all number {m['call'] + 1}, rank {m['src']} sends {_rows(m['sent'])} "
            f"to rank {m['dst']}, which expects {m['expected']}")
    if not any(not c["float"] for c in earlier):
        return ("counts not exchanged: a rank cannot know how many rows it will receive "
                "before the others tell it. First exchange tokens_per_expert with "
                "dist.all_to_all_single into a tensor of the same size, then split the rows "
                f"by what came back.\n  {said}")
    if any(c["float"] for c in earlier):
        return ("the results go back with the splits of the way out: on the return trip each "
                "rank sends what it received from every rank (recv_splits) and receives what "
                "it sent (send_splits): AllToAll.apply(back, recv_splits, send_splits, group)."
                f"\n  {said}")
    return ("the counts were exchanged, but the row splits do not match them: send_splits[d] "
            "is the number of rows for rank d's experts, recv_splits[s] the number rank s "
            f"sends you (from the exchanged counts).\n  {said}")


@shows_prints
def check_moe_dispatch(learner: ModuleType) -> list[str]:
    for p, experts in MOE_CASES:
        ranks = run_learner(learner, _moe_worker, p, experts)
        setting = f"with {p} ranks and {experts} experts ({experts // p} on each rank)"
        for r, got in enumerate(ranks):
            if got["mismatch"]:
                raise CheckFailed(_moe_mismatch(got["mismatch"])
                                  + f"\n  ({setting}, in {got['where']})")
            if got["error"]:
                raise CheckFailed(f"{setting}, rank {r}'s {got['where']} raised {got['error']}")
        ref = _moe_reference(p, experts)
        for r, got in enumerate(ranks):
            y, want = got["y"], ref["y"][r]
            if y.shape != want.shape:
                raise CheckFailed(
                    f"{setting}, rank {r} returned {y.shape[0]} rows for its {want.shape[0]} "
                    "inputs: the results never went back to the ranks their tokens came from. "
                    "After the local experts ran, a second all_to_all (the splits swapped) "
                    "returns each row to its sender, in the order it was sent")
            if _same(y, want):
                continue
            for variant, message in (
                    ("no-regroup",
                     "the received rows arrive ordered by source rank, then expert, and the "
                     "experts ran on them in that order: rows from rank 1 went to the wrong "
                     "expert. Regroup them by local expert before running the experts"),
                    ("no-restore",
                     "tokens combined in send order instead of original order: the results "
                     "went back in expert order, not in the order the rows arrived (by "
                     "source rank, then expert), so each rank got other tokens' outputs. "
                     "Put the outputs back in (source rank, expert) order before the return "
                     "all_to_all")):
                sim = _moe_reference(p, experts, variant)["y"]
                if all(_same(ranks[q]["y"], sim[q]) for q in range(p)):
                    wrong = int(((y - want).abs() > 1e-5).any(dim=1).sum())
                    raise CheckFailed(f"{message}.\n  {setting}, {wrong} of rank {r}'s "
                                      f"{y.shape[0]} results are wrong")
            raise CheckFailed(f"{setting}, rank {r}'s results differ from the single-process "
                              f"experts' by {(y - want).abs().max():.3g}")
        for r, got in enumerate(ranks):
            if not got["requires_grad"] or got.get("x_grad") is None:
                raise CheckFailed(
                    "the outputs are right but no gradient flows back to the inputs: move the "
                    "rows with AllToAll.apply(...), the autograd-aware all_to_all above, not "
                    "dist.all_to_all_single directly (its backward sends each row's gradient "
                    "back along the reverse path)")
            if not _same(got["x_grad"], ref["x_grad"][r]):
                raise CheckFailed(f"{setting}, rank {r}'s input gradients differ from the "
                                  "single-process ones")
            local = experts // p
            for j, grads in enumerate(got["expert_grads"]):
                want = ref["expert_grads"][r * local + j]
                if not all(_same(g, w) for g, w in zip(grads, want)):
                    raise CheckFailed(f"{setting}, rank {r}'s expert {r * local + j} has "
                                      "gradients that differ from the single-process ones")
        if not any(not c["float"] for c in ranks[0]["log"]):
            raise CheckFailed("the results are right, but no counts were exchanged")
    return [f"{' and '.join(str(p) for p, _ in MOE_CASES)} ranks, 2 experts each, uneven counts "
            "(some zero): every rank gets its rows' expert outputs back, in its own order",
            "the input gradients and every expert's weight gradients equal one process's "
            "(fp32, 1e-5)",
            "the counts are exchanged before the rows, and every all_to_all's splits agree"]
