"""Check of exercise 23: ZeRO-3's gather, free and re-gather (zero.py)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from snippets.exercises.checks._ranks import _describe, _same
from snippets.exercises.checks._zero import ZERO_LR, ZERO_STEPS, _fmt
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


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
