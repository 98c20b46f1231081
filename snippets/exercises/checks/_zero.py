"""The model, the data and the single-process references of the ZeRO checks (exercises 21-23)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.optim  # noqa: F401 - imported here, in the forkserver, not in each rank's time
from torch import nn

import snippets.planner.memory  # noqa: F401 - the learner's zero.py imports it: preloaded once


def _fmt(t: torch.Tensor, n: int = 6) -> str:
    values = [round(float(v), 4) for v in t.reshape(-1)[:n].tolist()]
    return str(values)[:-1] + (", ...]" if t.numel() > n else "]")


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
