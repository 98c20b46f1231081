"""Check of exercise 26: the 3-D process groups (three_d.py).

The 3-D groups are judged first without processes: on 8 ranks (DP x PP x TP = 2 x 2 x 2) the
learner's build_groups runs once per rank with dist.new_group, get_rank and get_world_size
replaced, which records every group each rank creates and in which order. Then 4 processes
(DP x TP = 2 x 2) build the groups for real and average gradients over the DP group.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

import snippets.scratch.three_d  # noqa: F401 - the learner's three_d.py imports what it does:
# preloaded once in gang's forkserver, not in every rank's time
from snippets.exercises.checks._ranks import _close, _describe, _permutations
from snippets.exercises.gang import RankFailed, Stuck, run_learner, run_ranks, shows_prints
from snippets.exercises.runner import CheckFailed


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
