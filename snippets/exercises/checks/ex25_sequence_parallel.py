"""Check of exercise 25: SP's gather and scatter edges (sequence_parallel.py)."""

from __future__ import annotations

import re
from types import ModuleType

import torch
import torch.nn.functional as F

from snippets.exercises.checks._ranks import _close, _describe, _permutations
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else repr(t)


SP_WORLD = 2
SP_B, SP_T, SP_H, SP_I = 2, 8, 4, 6  # batch, sequence, hidden, MLP width (split over ranks)
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast",
               "all_to_all_single", "send", "isend")


def _sp_setup():
    """The same tensors on every rank and in the reference."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SP_B, SP_T, SP_H, generator=g)
    weights = torch.randn(SP_B, SP_T, SP_H, generator=g)  # loss = (y * weights).sum()
    norm = 1 + 0.1 * torch.randn(SP_H, generator=g)
    up = torch.randn(SP_I, SP_H, generator=g) / 2
    down = torch.randn(SP_H, SP_I, generator=g) / 2
    return x, weights, norm, up, down


def _sp_pieces(p: int) -> tuple[list, list]:
    """Part 1's inputs: each rank's (B, T/p, h) shard, and each rank's (B, T, h) partial sums."""
    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(SP_B, SP_T // p, SP_H, generator=g) for _ in range(p)]
    partials = [torch.randn(SP_B, SP_T, SP_H, generator=g) for _ in range(p)]
    return shards, partials


def _sp_norm(x, weight):
    """RMSNorm, token by token: the kind of op SP runs on T/N tokens."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _sp_mix(full):
    """Each token becomes the mean of the tokens up to it: causal mixing, as attention does, so
    every token's gradient depends on the tokens after it, on other ranks too."""
    positions = torch.arange(1, full.shape[1] + 1, dtype=full.dtype).view(1, -1, 1)
    return full.cumsum(1) / positions


def _sp_worker(learner, rank: int, world: int) -> dict:
    import torch.distributed as dist

    log, original_all_reduce = [], dist.all_reduce
    for name in COLLECTIVES:
        if hasattr(dist, name):
            def counting(*args, _name=name, _original=getattr(dist, name), **kwargs):
                first = args[0] if args else next(iter(kwargs.values()), None)
                log.append((_name, first.numel() if isinstance(first, torch.Tensor) else 0))
                return _original(*args, **kwargs)
            setattr(dist, name, counting)

    out = {"error": None, "log": log}
    # Part 1: the two collectives on their own.
    shards, partials = _sp_pieces(world)
    try:
        out["gathered"] = learner.all_gather_sequence(shards[rank].clone(), None)
    except Exception as err:  # noqa: BLE001 - the parent reports it
        return out | {"error": _describe(err, learner), "where": "all_gather_sequence"}
    try:
        out["scattered"] = learner.reduce_scatter_sequence(partials[rank].clone(), None)
    except Exception as err:  # noqa: BLE001
        return out | {"error": _describe(err, learner), "where": "reduce_scatter_sequence"}
    right = (_close(out["gathered"], torch.cat(shards, 1))
             and _close(out["scattered"], sum(partials).chunk(world, 1)[rank]))
    wrong = torch.tensor([float(not right)])
    original_all_reduce(wrong)  # every rank stops together: the parent names the mistake
    if wrong.item():
        return out

    # Part 2: a block's region between the edges, forward and backward.
    log.clear()
    x, weights, norm, up, down = _sp_setup()
    mine = x.chunk(world, 1)[rank].clone().requires_grad_(True)
    norm_weight = torch.nn.Parameter(norm.clone())
    up_w = torch.nn.Parameter(up.chunk(world, 0)[rank].clone())
    down_w = torch.nn.Parameter(down.chunk(world, 1)[rank].clone())
    stats = learner.SequenceCommStats()
    try:
        learner.all_reduce_gradient_of(norm_weight, None, stats)
        full = learner.GatherSequence.apply(_sp_norm(mine, norm_weight), None, stats)
        partial = F.linear(F.silu(F.linear(_sp_mix(full), up_w)), down_w)
        y = mine + learner.ScatterSequence.apply(partial, None, stats)
    except Exception as err:  # noqa: BLE001
        return out | {"error": _describe(err, learner), "where": "forward"}
    out |= {"y": y.detach().clone()}
    try:
        (y * weights.chunk(world, 1)[rank]).sum().backward()
    except Exception as err:  # noqa: BLE001
        return out | {"error": _describe(err, learner), "where": "backward"}
    grad = lambda t: None if t.grad is None else t.grad.clone()  # noqa: E731
    return out | {"x_grad": grad(mine), "norm_grad": grad(norm_weight), "up_grad": grad(up_w),
                  "down_grad": grad(down_w), "calls": dict(stats.calls),
                  "log2": list(log)}


def _sp_reference(p: int, *, gather_sums: bool = True, scatter_sums: bool = True,
                  norm_reduced: bool = True) -> list[dict]:
    """Every rank's results, computed in one process; the knobs are wrong answers learners
    write: the gradient entering the region not summed over the ranks (gather_sums), the
    partial outputs leaving it not summed (scatter_sums), the norm's gradient not all-reduced
    (norm_reduced). Right, it is the single-process model cut into pieces."""
    x, weights, norm, up, down = _sp_setup()
    xs = [c.clone().requires_grad_(True) for c in x.chunk(p, 1)]
    norms = [norm.clone().requires_grad_(True) for _ in range(p)]
    ups = [w.clone().requires_grad_(True) for w in up.chunk(p, 0)]
    downs = [w.clone().requires_grad_(True) for w in down.chunk(p, 1)]
    hs = [_sp_norm(xr, nr) for xr, nr in zip(xs, norms)]
    partials = []
    for q in range(p):  # rank q's region: the tokens of every rank, its own slices of W
        # one graph for all ranks: cat's backward sums the ranks' gradients, a reduce-scatter
        gathered = torch.cat([h if gather_sums or s == q else h.detach()
                              for s, h in enumerate(hs)], 1)
        partials.append(F.linear(F.silu(F.linear(_sp_mix(gathered), ups[q])), downs[q]))
    total = sum(partials)
    ys = [xs[r] + (total if scatter_sums else partials[r]).chunk(p, 1)[r] for r in range(p)]
    sum((y * w).sum() for y, w in zip(ys, weights.chunk(p, 1))).backward()
    norm_total = sum(n.grad for n in norms)
    return [{"y": ys[r].detach(), "x_grad": xs[r].grad,
             "norm_grad": norm_total if norm_reduced else norms[r].grad,
             "up_grad": ups[r].grad, "down_grad": downs[r].grad} for r in range(p)]


def _judge_gathered(ranks: list, p: int) -> None:
    shards, _ = _sp_pieces(p)
    want = torch.cat(shards, 1)
    for r, got in enumerate(ranks):
        g = got["gathered"]
        if _close(g, want):
            continue
        where = (f"with {p} ranks, all_gather_sequence of (B, T/N, h) = "
                 f"{list(shards[0].shape)} shards returned {_shape(g)} on rank {r}")
        if _close(g, torch.cat(shards, 0)):
            raise CheckFailed(
                "gathered along the batch dimension instead of the sequence: all_gather_single "
                "(all_gather_into_tensor) stacks the ranks' tensors along dimension 0, which is "
                "the batch here. Move the sequence to dimension 0 first "
                "(shard.movedim(1, 0).contiguous()), gather, and move it back.\n  "
                f"{where}; the whole sequence is {list(want.shape)}")
        if _close(g, torch.cat(shards, 0).reshape(want.shape)):
            raise CheckFailed(
                "the ranks' shards were stacked along the batch and then reshaped to (B, T, h): "
                "reshape (or view) keeps the order of the elements, so the batch and the ranks "
                "are interleaved. Move the sequence to dimension 0 with movedim before the "
                f"gather, and back after.\n  {where}, with other tokens at each position")
        for order in _permutations(p):
            if list(order) != list(range(p)) and _close(g, torch.cat([shards[s] for s in order],
                                                                     1)):
                raise CheckFailed(
                    f"shards concatenated in the wrong rank order: positions "
                    f"{', '.join(f'{i * (SP_T // p)}-{(i + 1) * (SP_T // p) - 1}' for i in range(p))} "
                    f"of the sequence hold the tokens of ranks {list(order)}; rank i's tokens "
                    "belong at block i (all_gather_single puts rank i's tensor at block i of "
                    f"dimension 0).\n  {where}")
        if g is not None and _close(g, shards[r]):
            raise CheckFailed(f"all_gather_sequence returned rank {r}'s own shard: nothing was "
                              "gathered")
        raise CheckFailed(f"{where}; expected the ranks' shards side by side along the "
                          f"sequence, {list(want.shape)}"
                          + ("" if not isinstance(g, torch.Tensor) or g.shape != want.shape else
                             f", off by up to {(g - want).abs().max():.3g}"))


def _judge_scattered(ranks: list, p: int) -> None:
    _, partials = _sp_pieces(p)
    total = sum(partials)
    for r, got in enumerate(ranks):
        s = got["scattered"]
        want = total.chunk(p, 1)[r]
        if _close(s, want):
            continue
        where = (f"with {p} ranks, rank {r}'s reduce_scatter_sequence of (B, T, h) = "
                 f"{list(total.shape)} partial sums returned {_shape(s)}; its tokens' sums are "
                 f"{list(want.shape)}")
        if _close(s, total.chunk(p, 0)[r]):
            raise CheckFailed(
                "reduce-scattered along the batch dimension instead of the sequence: "
                "reduce_scatter_single (reduce_scatter_tensor) splits dimension 0, the batch "
                "here. Move the sequence to dimension 0 first, reduce-scatter, and move it "
                f"back.\n  {where}")
        other = [q for q in range(p) if q != r and _close(s, total.chunk(p, 1)[q])]
        if other:
            raise CheckFailed(
                f"the wrong shard: rank {r} holds the summed tokens of rank {other[0]}'s block "
                f"of the sequence. Rank i keeps block i.\n  {where}")
        if _close(s, total):
            raise CheckFailed(
                "all-reduced instead of reduce-scattered: every rank holds the sums of all "
                f"{SP_T} tokens, N = {p} times too large a tensor; each rank keeps only its own "
                f"T/N tokens, and a reduce-scatter sends half an all-reduce's bytes.\n  {where}")
        if _close(s, partials[r].chunk(p, 1)[r]):
            raise CheckFailed(
                f"partial sums: rank {r} kept its own partial results for its tokens, never "
                f"summed over the ranks.\n  {where}")
        if _close(s, want / p):
            raise CheckFailed(f"averaged instead of summed: the partial outputs of a "
                              f"row-parallel layer add up.\n  {where}")
        raise CheckFailed(where)


_BAD_GRAD = re.compile(r"Function (\w+)Backward returned an invalid gradient at index 0 - got "
                       r"(\[[^\]]*\]) but expected shape compatible with (\[[^\]]*\])")


def _judge_sp_error(r: int, got: dict, p: int) -> None:
    text, where = got["error"], got["where"]
    m = _BAD_GRAD.search(text)
    if m and m[1] == "GatherSequence":
        raise CheckFailed(
            f"GatherSequence.backward returned a gradient of shape {m[2]} for its input of "
            f"shape {m[3]}: the whole sequence's, N = {p} times too large. Backward "
            "all-reduced instead of reduce-scattered: each rank needs only the sum over the "
            "ranks of its OWN tokens' gradients, reduce_scatter_sequence(grad, ctx.group)")
    if m and m[1] == "ScatterSequence":
        raise CheckFailed(
            f"ScatterSequence.backward returned a gradient of shape {m[2]} for its input of "
            f"shape {m[3]}: the forward's input held every token's partial result, so its "
            "gradient covers every token. All-gather the gradients of the ranks' tokens "
            "(all_gather_sequence(grad, ctx.group)), the conjugate of the forward's "
            "reduce-scatter")
    raise CheckFailed(f"with {p} ranks, rank {r}'s {where} raised {text}")


SP_STATS = {("forward", "all_gather"): 1, ("forward", "reduce_scatter"): 1,
            ("backward", "reduce_scatter"): 1, ("backward", "all_gather"): 1,
            ("backward", "all_reduce"): 1}


@shows_prints
def check_sequence_parallel(learner: ModuleType) -> list[str]:
    p = SP_WORLD
    ranks = run_learner(learner, _sp_worker, p)
    for r, got in enumerate(ranks):
        if got["error"] and got["where"] in ("all_gather_sequence", "reduce_scatter_sequence"):
            raise CheckFailed(f"with {p} ranks, rank {r}'s {got['where']} raised {got['error']}")
    _judge_gathered(ranks, p)
    _judge_scattered(ranks, p)
    for r, got in enumerate(ranks):
        if got["error"]:
            _judge_sp_error(r, got, p)
    ref = _sp_reference(p)
    setting = f"with {p} ranks and (B, T, h) = ({SP_B}, {SP_T}, {SP_H})"
    for r, got in enumerate(ranks):
        if _close(got["y"], ref[r]["y"]):
            continue
        if _close(got["y"], _sp_reference(p, scatter_sums=False)[r]["y"]):
            raise CheckFailed(
                f"partial sums: rank {r}'s output is its own row-parallel partial result for "
                "its tokens. ScatterSequence's forward must reduce-scatter: sum the ranks' "
                f"partial results and keep this rank's tokens.\n  {setting}")
        raise CheckFailed(f"{setting}, rank {r}'s output differs from the single-process "
                          f"block's by up to {(got['y'] - ref[r]['y']).abs().max():.3g}"
                          if got["y"].shape == ref[r]["y"].shape else
                          f"{setting}, rank {r}'s output has shape {_shape(got['y'])}; its "
                          f"tokens' outputs are {list(ref[r]['y'].shape)}")
    unsummed = _sp_reference(p, gather_sums=False)
    for r, got in enumerate(ranks):
        if _close(got["x_grad"], ref[r]["x_grad"]):
            continue
        if _close(got["x_grad"], unsummed[r]["x_grad"]):
            raise CheckFailed(
                f"partial sums: rank {r}'s input gradient covers only its own region's use of "
                "its tokens. Every rank's column slice used every token, so GatherSequence's "
                "backward must sum the ranks' gradients and keep this rank's tokens: "
                f"reduce-scatter.\n  {setting}")
        if _close(got["x_grad"], p * ref[r]["x_grad"]):
            raise CheckFailed(f"rank {r}'s input gradient is N = {p} times too large: a sum "
                              f"over the ranks too many.\n  {setting}")
        raise CheckFailed(f"{setting}, rank {r}'s input gradient is not the single-process one"
                          + ("" if got["x_grad"] is None else
                             f" (up to {(got['x_grad'] - ref[r]['x_grad']).abs().max():.3g} "
                             "off)"))
    partial_norm = _sp_reference(p, norm_reduced=False)
    for r, got in enumerate(ranks):
        if _close(got["norm_grad"], ref[r]["norm_grad"]):
            continue
        if _close(got["norm_grad"], partial_norm[r]["norm_grad"]):
            raise CheckFailed(
                "forgot to all-reduce the norm weights' gradients: partial sums. The norm saw "
                f"only rank {r}'s {SP_T // p} of the {SP_T} tokens, so its gradient is the sum "
                "over those; all_reduce_gradient_of must add the other ranks' parts (a hook "
                "that all-reduces the gradient over the group as it arrives).\n  "
                f"{setting}, rank {r}'s norm weight gradient is "
                f"{_fmt(got['norm_grad'])}; the whole sequence's is "
                f"{_fmt(ref[r]['norm_grad'])}")
        if _close(got["norm_grad"], ref[r]["norm_grad"] / p):
            raise CheckFailed(
                f"the norm weight's gradient was divided by N = {p} after the all-reduce: "
                "that is DDP's mean, but here the ranks hold different tokens of the same "
                "sequences, not replicas on different batches. The loss already counts every "
                "token once, so the gradient is the plain sum of the ranks' parts: all-reduce "
                f"(SUM) and do not divide.\n  {setting}, rank {r}'s norm weight gradient is "
                f"{_fmt(got['norm_grad'])}; the whole sequence's is {_fmt(ref[r]['norm_grad'])}")
        if _close(got["norm_grad"], p * ref[r]["norm_grad"]):
            raise CheckFailed(f"the norm weight's gradient is N = {p} times the whole "
                              "sequence's: it was all-reduced twice (or summed once too "
                              f"often).\n  {setting}")
        raise CheckFailed(f"{setting}, rank {r}'s norm weight gradient is "
                          f"{_fmt(got['norm_grad'])}; the whole sequence's is "
                          f"{_fmt(ref[r]['norm_grad'])}")
    for r, got in enumerate(ranks):
        if not (_close(got["up_grad"], ref[r]["up_grad"])
                and _close(got["down_grad"], ref[r]["down_grad"])):
            raise CheckFailed(f"{setting}, rank {r}'s weight slices' gradients are not the "
                              "matching slices of the single-process gradients")
    activation = SP_B * SP_T * SP_H
    for r, got in enumerate(ranks):
        big = [name for name, n in got["log2"] if name == "all_reduce" and n == activation]
        if big:
            raise CheckFailed(
                "the values are right, but a (B, T, h) activation or gradient was all-reduced "
                "where SP reduce-scatters: an all-reduce sends 2(N-1)/N of the tensor per rank, "
                "a reduce-scatter (N-1)/N. SP's point is to send exactly TP's bytes and keep "
                "T/N tokens: use reduce_scatter_sequence")
    calls = {k: v for k, v in ranks[0]["calls"].items() if v}
    if calls != SP_STATS:
        raise CheckFailed(
            f"the numbers are right, but stats counted {calls or 'nothing'}; one block's "
            f"region makes {SP_STATS}: record each collective with stats.record(phase, "
            "collective, tensor) where it is made (the norm's all-reduce too)")
    return [f"{p} ranks: all_gather_sequence and reduce_scatter_sequence gather and sum along "
            "the sequence, each rank's tokens at its own place",
            "a region between the edges gives the single-process output, input gradient, "
            "weight-slice gradients and norm gradient (fp32, 1e-5)",
            "forward all-gathers then reduce-scatters, backward the converse; the norm's "
            "gradient is all-reduced"]


def _fmt(t, n: int = 4) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    values = [round(float(v), 4) for v in t.reshape(-1)[:n].tolist()]
    return str(values)[:-1] + (", ...]" if t.numel() > n else "]")
