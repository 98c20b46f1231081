"""Check of exercise 19: f, g and the parallel linears (tensor_parallel.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


TP_WORLD = 2


def _tp_setup():
    """The same layers, input and loss weights on every rank and in the reference."""
    g = torch.Generator().manual_seed(0)
    up = torch.nn.Linear(8, 16, bias=False)
    down = torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        up.weight.copy_(torch.randn(16, 8, generator=g))
        down.weight.copy_(torch.randn(8, 16, generator=g))
    x = torch.randn(3, 8, generator=g)
    weights = torch.randn(3, 8, generator=g)  # loss = (y * weights).sum(): every dy differs
    return up, down, x, weights


def _tp_worker(learner, rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from snippets.exercises.runner import _describe

    up, down, x, weights = _tp_setup()
    x.requires_grad_(True)
    stats = learner.TensorParallelCommStats()
    col = learner.ColumnParallelLinear(up)
    row = learner.RowParallelLinear(down, stats=stats)
    out = {"col_w": col.weight.detach().clone(), "row_w": row.weight.detach().clone()}
    try:
        h = learner.EnterTensorParallel.apply(x, None, stats)
        y = row(F.silu(col(h)))
        (y * weights).sum().backward()
    except Exception as err:  # noqa: BLE001 - the parent reports it, after the weights
        return out | {"error": _describe(err, Path(learner.__file__))}
    grad = lambda t: None if t.grad is None else t.grad.clone()  # noqa: E731
    return out | {"y": y.detach(), "x_grad": grad(x), "col_grad": grad(col.weight),
                  "row_grad": grad(row.weight), "stats": dict(vars(stats)), "error": None}


def _tp_reference(world: int, x_scale: float = 1.0) -> dict:
    import torch.nn.functional as F

    up, down, x, weights = _tp_setup()
    x = (x * x_scale).requires_grad_(True)
    y = down(F.silu(up(x)))
    (y * weights).sum().backward()
    partial = [F.linear(F.silu(F.linear(x, w1)), w2).detach() for w1, w2 in
               zip(up.weight.chunk(world, 0), down.weight.chunk(world, 1))]
    return {"y": y.detach(), "x_grad": x.grad, "up": up.weight.detach(),
            "down": down.weight.detach(), "up_grad": up.weight.grad,
            "down_grad": down.weight.grad, "partial": partial}


def _close(a, b) -> bool:
    # fp32, the same products summed in a different order (two partial sums): a bound, not
    # exact; 1e-5 relative is far below any of the mistakes' factor-of-2 differences.
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@shows_prints
def check_tensor_parallel(learner: ModuleType) -> list[str]:
    p = TP_WORLD
    ranks = run_learner(learner, _tp_worker, p)
    ref = _tp_reference(p)
    for r, got in enumerate(ranks):
        if not _close(got["col_w"], ref["up"].chunk(p, 0)[r]):
            hint = (" you split the columns (dim 1, the input features)"
                    if _close(got["col_w"], ref["up"].chunk(p, 1)[r]) else "")
            raise CheckFailed(
                f"rank {r}'s ColumnParallelLinear.weight has shape {list(got['col_w'].shape)} "
                f"for a Linear(8, 16):{hint} column-parallel keeps rank r's block of ROWS of W "
                "(a block of output features): linear.weight.chunk(size, dim=0)[rank], "
                f"shape [{16 // p}, 8]")
        if not _close(got["row_w"], ref["down"].chunk(p, 1)[r]):
            hint = (" you split the rows (dim 0, the output features)"
                    if _close(got["row_w"], ref["down"].chunk(p, 0)[r]) else "")
            raise CheckFailed(
                f"rank {r}'s RowParallelLinear.weight has shape {list(got['row_w'].shape)} "
                f"for a Linear(16, 8):{hint} row-parallel keeps rank r's block of COLUMNS of "
                "W (a block of input features, the slice the column-parallel layer produced): "
                f"linear.weight.chunk(size, dim=1)[rank], shape [8, {16 // p}]")
    for r, got in enumerate(ranks):
        if got["error"]:
            raise CheckFailed(f"on {p} processes, rank {r} raised {got['error']}")
    for r, got in enumerate(ranks):
        if _close(got["y"], ref["y"]):
            continue
        if _close(got["y"], ref["partial"][r]):
            raise CheckFailed(
                f"rank {r}'s output is its own partial sum, x_r W_r^T: g's forward must "
                "all-reduce the partial results (and never change its input in place: "
                "all-reduce a clone)")
        if _close(got["y"], _tp_reference(p, x_scale=p)["y"]):
            raise CheckFailed(
                f"the output is what the model gives for {p} * x: f's forward all-reduced x. "
                "x is already the same on every rank; f is the identity in forward (it "
                "all-reduces only the gradient, in backward)")
        raise CheckFailed(f"rank {r}'s output differs from the single-process layers' by "
                          f"{(got['y'] - ref['y']).abs().max():.3g}")
    for r, got in enumerate(ranks):
        if _close(got["x_grad"], p * ref["x_grad"]):
            raise CheckFailed(
                f"x.grad is {p} times the true gradient (and so are the weights' gradients): "
                "g's backward all-reduces too. The gradient reaching g is already the full "
                "one, the same on every rank; g's backward is the identity")
        if not _close(got["x_grad"], ref["x_grad"]):
            partial = "" if got["x_grad"] is None else (
                f" ({(got['x_grad'] - ref['x_grad']).abs().max():.3g} off)")
            raise CheckFailed(
                f"rank {r}'s x.grad is not the single-process gradient{partial}: each rank's "
                "dL/dx covers only its slice of the columns, so f's backward must all-reduce "
                "(sum) it over the ranks")
        if not _close(got["col_grad"], ref["up_grad"].chunk(p, 0)[r]) or not _close(
                got["row_grad"], ref["down_grad"].chunk(p, 1)[r]):
            raise CheckFailed(f"rank {r}'s weight gradients are not the matching slices of "
                              "the single-process gradients")
    stats = ranks[0]["stats"]
    if (stats["forward_calls"], stats["backward_calls"]) != (1, 1):
        raise CheckFailed(
            f"the numbers are right, but stats counted {stats['forward_calls']} forward and "
            f"{stats['backward_calls']} backward all-reduces; one each was made: record each "
            "all-reduce with stats.record('forward' or 'backward', tensor) before making it")
    return [f"{p} ranks: column- then row-parallel layers give the single-process output",
            "x.grad and both weights' gradients equal the single-process ones (fp32, 1e-5)",
            "one all-reduce in forward (g), one in backward (f)"]
