"""Checks of exercises 25 and 26: sequence parallelism's region edges
(snippets/scratch/sequence_parallel.py) and the process groups of 3-D parallelism
(snippets/scratch/three_d.py).

As in checks_zero_moe.py, the learner's file runs on gloo processes through gang.run_learner
(one start per check, a hard time limit, a deadlock reported with each waiting rank's call),
every rank is compared with one process, and the usual wrong answers are computed in one process
(tokens gathered along the batch, in the wrong rank order, a gradient never summed, groups cut
along the wrong axis, ...) so that a result matching one of them is named.

The 3-D groups are judged first without processes: on 8 ranks (DP x PP x TP = 2 x 2 x 2) the
learner's build_groups runs once per rank with dist.new_group, get_rank and get_world_size
replaced, which records every group each rank creates and in which order. Then 4 processes
(DP x TP = 2 x 2) build the groups for real and average gradients over the DP group.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

import snippets.scratch.three_d  # noqa: F401 - the learner's three_d.py imports what it does:
# preloaded once in gang's forkserver, not in every rank's time
from snippets.exercises.checks_zero_moe import _describe
from snippets.exercises.gang import RankFailed, Stuck, run_learner, run_ranks, shows_prints
from snippets.exercises.runner import CheckFailed


def _close(a, b) -> bool:
    # fp32, the same products summed in another order (partial sums over ranks, gloo's order):
    # a bound, not exact; 1e-5 is far below every mistake's difference (a rank's share, a swap).
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-5, atol=1e-5))


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else repr(t)


# ---------------------------------------------------------------- exercise 25: SP's region edges

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


def _permutations(p: int):
    from itertools import permutations

    return permutations(range(p))


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


# ---------------------------------------------------------------- exercise 26: the 3-D groups

MESH_3D = {"dp": 2, "pp": 2, "tp": 2}  # simulated on 8 ranks, no processes
MESH_RUN = {"dp": 2, "pp": 1, "tp": 2}  # run on 4 gloo processes
AXES = ("tp", "pp", "dp")


class _FakeGroup:
    """What the simulated dist.new_group returns: the ranks it was asked for, and whether the
    calling rank is one of them (torch returns a non-member marker otherwise)."""

    def __init__(self, ranks: list[int], member: bool):
        self.ranks, self.member = ranks, member


def _simulate_build_groups(learner, mesh) -> list[dict]:
    """Per rank of mesh: the ranks of each new_group call, in order, and build_groups' answer."""
    import torch.distributed as dist

    size = mesh.size
    names = ("new_group", "get_rank", "get_world_size")
    saved = {n: getattr(dist, n) for n in names}
    per_rank = []
    try:
        for rank in range(size):
            calls = []

            def new_group(ranks=None, *args, _rank=rank, _calls=calls, **kwargs):
                ranks = list(range(size)) if ranks is None else sorted(int(r) for r in ranks)
                _calls.append(ranks)
                return _FakeGroup(ranks, _rank in ranks)

            def get_world_size(group=None):
                return len(group.ranks) if isinstance(group, _FakeGroup) else size

            def get_rank(group=None, _rank=rank):
                return group.ranks.index(_rank) if isinstance(group, _FakeGroup) else _rank

            dist.new_group, dist.get_world_size, dist.get_rank = (new_group, get_world_size,
                                                                  get_rank)
            try:
                groups = learner.build_groups(mesh)
            except NotImplementedError:
                raise
            except Exception as err:  # noqa: BLE001 - the caller reports it, with the rank
                per_rank.append({"calls": calls, "error": _describe(err, learner)})
                continue
            per_rank.append({"calls": calls, "groups": groups, "error": None})
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return per_rank


def _members(group, size: int):
    """The ranks of a group build_groups returned; None when it is no group at all."""
    if group is None:  # dist.group.WORLD, before (or without) init: the default group
        return list(range(size))
    if isinstance(group, _FakeGroup):
        return group.ranks if group.member else "not a member"
    return None


def _table(mesh, groups_of) -> str:
    """Mesh.table()'s layout, with each rank's groups as groups_of(rank, axis) gives them."""
    from snippets.scratch.three_d import Mesh

    solution = Mesh(mesh.dp, mesh.pp, mesh.tp)
    lines = ["rank  dp pp tp  TP group  PP group  DP group"]
    for r in range(mesh.size):
        c = solution.coords(r)
        lines.append(f"{r:>4}  {c['dp']:>2} {c['pp']:>2} {c['tp']:>2}  "
                     + "  ".join(f"{str(groups_of(r, a)):<8}" for a in ("tp", "pp", "dp"))
                     .rstrip())
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _judge_groups(sims: list[dict], mesh) -> None:
    from snippets.scratch.three_d import Mesh

    size = mesh.size
    solution = Mesh(mesh.dp, mesh.pp, mesh.tp)
    setting = f"with DP x PP x TP = {mesh.dp} x {mesh.pp} x {mesh.tp} on {size} ranks"
    for r, sim in enumerate(sims):
        if sim["error"]:
            raise CheckFailed(f"{setting}, build_groups on rank {r} raised {sim['error']}")
        groups = sim["groups"]
        if not isinstance(groups, dict) or set(groups) != set(AXES):
            raise CheckFailed(f"{setting}, build_groups on rank {r} returned {groups!r}; it "
                              "returns this rank's groups as a dict {'tp': ..., 'pp': ..., "
                              "'dp': ...}")
        for axis in AXES:
            if _members(groups[axis], size) is None:
                raise CheckFailed(f"{setting}, rank {r}'s {axis!r} entry is "
                                  f"{groups[axis]!r}: return what dist.new_group returned")
    got = {axis: [_members(s["groups"][axis], size) for s in sims] for axis in AXES}
    want = {axis: [next(g for g in solution.groups(axis) if r in g) for r in range(size)]
            for axis in AXES}
    if got == want:
        return
    tables = ("\n  expected (TP innermost: rank = ((d * pp) + p) * tp + t):\n"
              + _indent(_table(solution, lambda r, a: want[a][r]))
              + "\n  yours:\n" + _indent(_table(solution, lambda r, a: got[a][r])))
    for axis in AXES:
        for r in range(size):
            if got[axis][r] == "not a member":
                raise CheckFailed(
                    f"{setting}, rank {r}'s {axis.upper()} group is a group it is not a member "
                    "of: every rank creates every group, but keeps only the one whose ranks "
                    f"include it (if rank in ranks: mine[axis] = group).{tables}")
    world = list(range(size))
    stage = [[q for q in world if solution.coords(q)["pp"] == solution.coords(r)["pp"]]
             for r in world]
    if got["dp"] == [world] * size:
        raise CheckFailed(
            "averaging over the world: every rank's DP group holds all "
            f"{size} ranks. Only the replicas of the same stage and the same TP shard hold the "
            "same parameters: ranks of other stages have other layers (gloo fails on the size "
            "mismatch, or, where sizes happen to agree, adds unrelated weights), and the other "
            f"TP shards of a stage have other heads and columns of the same shape.\n  {setting}"
            + tables)
    if got["dp"] == stage:
        raise CheckFailed(
            "averaging over the stage group (DP x TP): rank 0's DP group is "
            f"{got['dp'][0]}, every rank of its stage. Its TP peers hold other heads and MLP "
            "columns of the same shapes, so no error is raised and the model silently trains "
            "wrong; the DP group is the replicas of the same stage AND the same TP shard, "
            f"{want['dp'][0]}.\n  {setting}" + tables)
    for order in _permutations(3):
        axes = tuple(("dp", "pp", "tp")[i] for i in order)
        if axes == solution.order:
            continue
        other = Mesh(mesh.dp, mesh.pp, mesh.tp, order=axes)
        if got == {a: [next(g for g in other.groups(a) if r in g) for r in range(size)]
                   for a in AXES}:
            inner = axes[-1].upper()
            where = ("TP outermost: consecutive ranks (one node) land in other TP groups, and "
                     "TP's per-layer all-reduces would cross the slow links between nodes"
                     if axes[0] == "tp" else f"{inner} innermost instead of TP")
            raise CheckFailed(
                f"your groups lay the ranks out with {where}: rank 0's TP group is "
                f"{got['tp'][0]}, expected {want['tp'][0]}. The mesh's order is "
                f"{solution.order}, outermost first: rank = ((d * pp) + p) * tp + t, so a TP "
                "group is tp consecutive ranks; use mesh.coords and mesh.rank rather than your "
                f"own arithmetic.\n  {setting}" + tables)
    axis = next(a for a in AXES if got[a] != want[a])
    r = next(q for q in range(size) if got[axis][q] != want[axis][q])
    raise CheckFailed(f"{setting}, rank {r}'s {axis.upper()} group is {got[axis][r]}, expected "
                      f"{want[axis][r]}: the ranks whose other two coordinates equal rank "
                      f"{r}'s.{tables}")


def _order_mistake(sims: list[dict], setting: str) -> tuple[str, bool] | None:
    """How the ranks' new_group calls differ, when they do, and whether their numbers of calls
    differ too."""
    first = sims[0]["calls"]
    for r, sim in enumerate(sims[1:], 1):
        calls = sim["calls"]
        if calls == first:
            continue
        n = next((i for i, (a, b) in enumerate(zip(first, calls)) if a != b),
                 min(len(first), len(calls)))
        said = (f"rank 0 made {len(first)} new_group calls, rank {r} {len(calls)}"
                if n == min(len(first), len(calls)) else
                f"call {n + 1} was new_group({first[n]}) on rank 0 but new_group({calls[n]}) "
                f"on rank {r}")
        return ("new_group not called on every rank in the same order: it is a collective "
                "of the whole world (each call's group is known by how many were created "
                "before it), so every rank must create every group, its own or not, in the "
                f"same order, and keep its own ({setting}, {said})",
                len(calls) != len(first))
    return None


def _3d_worker(learner, rank: int, world: int, mesh_args: dict) -> dict:
    import torch.distributed as dist

    mesh = learner.Mesh(**mesh_args)
    groups = learner.build_groups(mesh)
    c = mesh.coords(rank)
    sizes = {axis: dist.get_world_size(groups[axis]) for axis in AXES}
    tp_sum = torch.tensor([float(rank + 1)])
    dist.all_reduce(tp_sum, group=groups["tp"])
    layer = _3d_layer(c["tp"])
    for p, g in zip(layer.parameters(), _3d_grads(c["dp"], c["tp"])):
        p.grad = g.clone()
    buckets = learner.make_buckets(layer, bucket_cap_mb=25)
    learner.average_gradients(buckets, groups["dp"])
    return {"sizes": sizes, "tp_sum": tp_sum.item(),
            "grads": [p.grad.clone() for p in layer.parameters()]}


def _3d_layer(t: int) -> torch.nn.Module:
    torch.manual_seed(100 + t)  # TP shard t's weights, the same in every replica
    return torch.nn.Linear(3, 2)


def _3d_grads(d: int, t: int) -> list[torch.Tensor]:
    """Replica d's gradients of TP shard t: its own micro-batch's, different everywhere."""
    g = torch.Generator().manual_seed(1000 + 10 * d + t)
    return [torch.randn(2, 3, generator=g), torch.randn(2, generator=g)]


@shows_prints
def check_3d_groups(learner: ModuleType) -> list[str]:
    from snippets.scratch.three_d import Mesh

    mesh = learner.Mesh(**MESH_3D)
    sims = _simulate_build_groups(learner, mesh)
    for r, sim in enumerate(sims):
        if sim["error"]:
            raise CheckFailed(f"with DP x PP x TP = {mesh.dp} x {mesh.pp} x {mesh.tp} on "
                              f"{mesh.size} ranks, build_groups on rank {r} raised "
                              f"{sim['error']}")
    order = _order_mistake(sims, f"simulated on {mesh.size} ranks, DP x PP x TP = "
                                 f"{mesh.dp} x {mesh.pp} x {mesh.tp}")
    run = Mesh(**MESH_RUN)
    if order and order[1]:
        # Some rank creates a group its peers never create: it waits for them in new_group.
        # The real thing, on processes, where the watchdog names who waits.
        try:
            run_ranks(Path(learner.__file__), _3d_worker, run.size, MESH_RUN)
        except (RankFailed, Stuck) as err:
            raise CheckFailed(f"{err}\n  Why: {order[0]}") from None
        raise CheckFailed(order[0])
    if order:
        # As many calls everywhere, different groups: on gloo the ranks then disagree on which
        # group a name stands for, and either wait for each other until the timeout or, by
        # the luck of who registers first, connect to the wrong ranks. Named, not run.
        raise CheckFailed(
            f"{order[0]}.\n  On processes, ranks that disagree on which group is which wait for "
            "each other until the timeout, or, depending on which rank registers first, "
            "connect to ranks of another group")
    _judge_groups(sims, mesh)
    ranks = run_learner(learner, _3d_worker, run.size, MESH_RUN)
    setting = (f"on {run.size} processes with DP x PP x TP = {run.dp} x {run.pp} x {run.tp}")
    for r, got in enumerate(ranks):
        c = run.coords(r)
        want = {axis: len(next(g for g in run.groups(axis) if r in g)) for axis in AXES}
        if got["sizes"] != want:
            raise CheckFailed(f"{setting}, rank {r}'s groups have sizes {got['sizes']}; "
                              f"expected {want}")
        tp = next(g for g in run.groups("tp") if r in g)
        if got["tp_sum"] != sum(q + 1 for q in tp):
            raise CheckFailed(f"{setting}, an all-reduce over rank {r}'s TP group summed "
                              f"{got['tp_sum']:g}, not {sum(q + 1 for q in tp)}: the group "
                              "does not connect the ranks it names")
        mean = [sum(gs) / run.dp for gs in zip(*(_3d_grads(d, c["tp"]) for d in range(run.dp)))]
        if not all(_close(a, b) for a, b in zip(got["grads"], mean)):
            raise CheckFailed(f"{setting}, rank {r}'s gradients after averaging over its DP "
                              "group are not the mean over the replicas of its TP shard")
    return [f"{mesh.size} ranks (DP x PP x TP = 2 x 2 x 2, simulated): every rank's TP, PP and "
            "DP groups are those of the layout with TP innermost",
            "every rank creates every group, in the same order",
            f"{run.size} processes (DP x TP = 2 x 2): the groups connect their ranks, and the "
            "gradients averaged over the DP group are the mean over the replicas of the same "
            "shard (fp32, 1e-5)"]
