"""The model, the data, the reference and the async all-reduce's handle of both DDP checks
(exercises 20 and 27).
"""

from __future__ import annotations

import torch


DDP_WORLD = 2
DDP_BUCKET_MB = 200 / 2**20  # 200 bytes: buckets [b2, w2, b1] and [w1] of the model below


def _ddp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _ddp_batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


class _TrackedWork:
    """An async all-reduce's handle. The sum lands in the caller's tensor at the first wait(),
    the one moment it is sure to be there: read before, the tensor holds this rank's own values,
    every time, as it may on a GPU (gloo's thread would often have finished by then)."""

    def __init__(self, work, tensor: torch.Tensor, in_flight: torch.Tensor, on_wait):
        self.work, self.tensor, self.in_flight, self.on_wait = work, tensor, in_flight, on_wait
        self.waited = False

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        if not self.waited:
            self.tensor.copy_(self.in_flight)
            self.waited = True
            self.on_wait(self.tensor)
        return done

    def __getattr__(self, name):
        return getattr(self.work, name)


def _track_all_reduces(on_launch=None, on_wait=None) -> list:
    """From now on in this process, dist.all_reduce(..., async_op=True) reduces a copy of the
    tensor and returns a _TrackedWork, collected in the list returned. on_launch(tensor,
    async_op) is called at every all-reduce, on_wait(tensor) at each handle's first wait."""
    import torch.distributed as dist

    handles, all_reduce = [], dist.all_reduce
    on_launch = on_launch or (lambda tensor, async_op: None)
    on_wait = on_wait or (lambda tensor: None)

    def tracking(tensor, *args, async_op=False, **kwargs):
        on_launch(tensor, async_op)
        if not async_op:
            return all_reduce(tensor, *args, **kwargs)
        in_flight = tensor.clone()
        work = all_reduce(in_flight, *args, async_op=True, **kwargs)
        handles.append(_TrackedWork(work, tensor, in_flight, on_wait))
        return handles[-1]
    dist.all_reduce = tracking
    return handles


def _sgd_step(model: torch.nn.Module) -> None:
    """Plain SGD by hand: torch.optim imports much of torch.distributed on first use (seconds
    in a fresh process), which would eat into the check's time limit."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
            p.grad = None


def _ddp_reference(world: int, micro_batches: tuple[int, ...] = (1, 1)) -> list[dict]:
    """Per step: the averaged gradients, and each rank's own (summed over the step's
    micro-batches), from one process."""
    import torch.nn.functional as F

    model = _ddp_model()
    steps = []
    for step, micros in enumerate(micro_batches):
        local = []
        for r in range(world):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for micro in range(micros):
                x, y = _ddp_batch(step, r, micro)
                loss = F.mse_loss(model(x), y)
                step_grads = torch.autograd.grad(loss, list(model.parameters()))
                grads = [g + d for g, d in zip(grads, step_grads)]
            local.append(grads)
        mean = [sum(g) / world for g in zip(*local)]
        steps.append({"mean": mean, "local": local})
        for p, g in zip(model.parameters(), mean):
            p.grad = g.clone()
        _sgd_step(model)
    return steps


def _all_close(got: list, want: list) -> bool:
    # fp32; the mean over 2 ranks is summed in another order than autograd's: 1e-6 relative
    return all(g is not None and torch.allclose(g, w, rtol=1e-5, atol=1e-6)
               for g, w in zip(got, want))


def _first_unaveraged(ranks: list, ref: list, p: int) -> tuple[int, int, str] | None:
    """The first (step, rank, what) whose gradients after a step are not the mean over the
    ranks, what being 'unwaited' (an async handle never waited on), 'missing' (a .grad is
    None), 'sum', 'local' (the rank's own), 'local/p' (its own divided by p) or 'other';
    None when every rank has the mean after every step. Exercises 20 and 27 name them."""
    for step in range(len(ref)):
        for r, got in enumerate(ranks):
            grads, want = got["grads"][step], ref[step]
            if got["unwaited"][step]:
                return step, r, "unwaited"
            if any(g is None for g in grads):
                return step, r, "missing"
            own = want["local"][r]
            candidates = {"mean": want["mean"], "sum": [p * g for g in want["mean"]],
                          "local": own, "local/p": [g / p for g in own]}
            what = next((what for what, expected in candidates.items()
                         if _all_close(grads, expected)), "other")
            if what != "mean":
                return step, r, what
    return None


UNPACKED_BEFORE_WAIT = (
    "you unpacked a bucket before waiting on its all-reduce: until work.wait() returns, the "
    "buffer is not sure to hold the sum (this check lands it only at the wait, as a GPU may), "
    "so unpack copied this rank's own gradients. Wait on the handle first, then unpack")
