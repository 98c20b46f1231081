"""Check of exercise 16: ring_all_reduce (collectives.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


RING_WORLD = 4
RING_SHAPES = ((3, 4), (10,))  # 10 does not divide by 4: chunks of 3, 3, 2, 2


def _ring_input(shape: tuple, rank: int) -> torch.Tensor:
    """Small integers, different on every rank: every sum is exact in float32, in any order."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, shape, generator=g).float()


def _ring_worker(learner, rank: int, world: int) -> list:
    import torch.distributed as dist

    sent = []  # (calls, elements) of every send this rank makes: the ring's traffic
    # The tensor as the reduce-scatter phase left it: at the p-th send, the all-gather's first.
    current = {}
    for name in ("send", "isend"):
        def counting(tensor, *args, _original=getattr(dist, name), **kwargs):
            if len(sent) == world - 1:
                current["after_reduce_scatter"] = current["x"].clone()
            sent.append(tensor.numel())
            return _original(tensor, *args, **kwargs)
        setattr(dist, name, counting)
    out = []
    for shape in RING_SHAPES:
        x = _ring_input(shape, rank)
        sent.clear()
        current.clear()
        current["x"] = x
        returned = learner.ring_all_reduce(x)
        out.append({"x": x, "in place": returned is x, "sends": list(sent),
                    "after_reduce_scatter": current.get("after_reduce_scatter"),
                    "returned": returned if isinstance(returned, torch.Tensor) else None})
        # Stop at the first wrong case, on every rank together: the parent names the mistake
        # from it, where the next case might only crash (chunks of different sizes).
        total = sum(_ring_input(shape, r) for r in range(world))
        wrong = torch.tensor([float(not torch.equal(x, total))])
        dist.all_reduce(wrong)
        if wrong.item():
            break
    return out


def simulate_ring(inputs: list[torch.Tensor], *, direction: int = 1, rs_steps: int | None = None,
                  ag_steps: int | None = None, rs_index=None, ag_index=None,
                  ag_adds: bool = False) -> list[torch.Tensor] | None:
    """The ring all-reduce of inputs (one per rank), in one process, with the knobs learners
    get wrong; None when the variant would fail (chunks of different sizes meet)."""
    p = len(inputs)
    rs_steps = p - 1 if rs_steps is None else rs_steps
    ag_steps = p - 1 if ag_steps is None else ag_steps
    rs_index = rs_index or (lambda r, s: ((r - s) % p, (r - s - 1) % p))
    ag_index = ag_index or (lambda r, s: ((r + 1 - s) % p, (r - s) % p))
    tensors = [x.clone() for x in inputs]
    chunks = [list(t.view(-1).tensor_split(p)) for t in tensors]

    def step(index, s, add):
        sent = [chunks[r][index(r, s)[0]].clone() for r in range(p)]
        for r in range(p):
            target, data = chunks[r][index(r, s)[1]], sent[(r - direction) % p]
            if target.shape != data.shape:
                return False
            target.add_(data) if add else target.copy_(data)
        return True

    for s in range(rs_steps):
        if not step(rs_index, s, True):
            return None
    for s in range(ag_steps):
        if not step(ag_index, s, ag_adds):
            return None
    return tensors


def _ring_mistakes(p: int) -> list[tuple[str, dict]]:
    return [
        # Sending to rank-1 with the indices of a ring to rank+1, or counting the index up
        # (rank + step) with the ring to rank+1, are mirror images: the same wrong sums.
        ("your ring sends to rank-1 (or counts the chunk index up, rank + step) while its "
         "chunk indices are those of a ring that sends to rank+1 (or the other way round): "
         "the chunks arrive in the wrong order. Send to (rank + 1) % world, receive from "
         "(rank - 1) % world, and at step s send chunk (rank - s) % world", {"direction": -1}),
        (f"the reduce-scatter phase ran p-2 steps, not p-1 (p = {p}): each finished chunk "
         "misses one rank's part", {"rs_steps": p - 2}),
        ("each rank holds the full sum of one chunk only, and partial sums elsewhere: the "
         "all-gather phase is missing (p-1 more steps that pass the finished chunks around the "
         "ring)", {"ag_steps": 0}),
        ("the all-gather phase added the chunks it received: there a received chunk is "
         "already the full sum, so copy it over yours (chunks[i].copy_(received)), do not add",
         {"ag_adds": True}),
        ("you added the received chunk into the chunk you had just sent: in the reduce-scatter "
         "phase receive into the next one, (rank - step - 1) % world",
         {"rs_index": lambda r, s: ((r - s) % p, (r - s) % p)}),
        ("the all-gather phase used the reduce-scatter phase's chunk indices: the reduce-scatter "
         "is right, but after it rank r's finished chunk is (r + 1) % world, not the one it sent "
         "first, so the all-gather passed partial sums around. Start the all-gather from the "
         "chunk this rank finished, one index ahead of the reduce-scatter's",
         {"ag_index": lambda r, s: ((r - s) % p, (r - s - 1) % p)}),
    ]


def _fmt(t: torch.Tensor) -> str:
    return str([int(v) if float(v).is_integer() else round(float(v), 3)
                for v in t.reshape(-1).tolist()])


def _wrong_phase(got: list[dict], total: torch.Tensor, p: int, shape: tuple) -> str:
    """Which phase of the ring went wrong, judged from the tensor as each rank held it when it
    made its p-th send (the all-gather's first): after a right reduce-scatter, every rank holds
    one chunk summed over all the ranks."""
    differ = [r for r in range(p) if not torch.equal(got[r]["x"], total)]
    where = (f"with {p} ranks and a tensor of shape {list(shape)}, rank {differ[0]} holds "
             f"{_fmt(got[differ[0]]['x'])}; the sum over the ranks is {_fmt(total)} "
             f"(ranks {differ} are wrong)")
    if any(g["after_reduce_scatter"] is None for g in got):
        return (f"{where}. Draw a ring of 3 ranks on paper and follow each chunk through both "
                "phases (python -m snippets.exercises hints 16 gives one hint at a time)")
    sums = total.view(-1).tensor_split(p)
    unfinished = [r for r, g in enumerate(got)
                  if not any(torch.equal(mine, right) for mine, right in
                             zip(g["after_reduce_scatter"].view(-1).tensor_split(p), sums))]
    if unfinished:
        r = unfinished[0]
        return (f"the reduce-scatter phase is wrong: after it (your first p-1 = {p - 1} sends) "
                f"rank {r} holds no chunk summed over all {p} ranks: "
                f"{_fmt(got[r]['after_reduce_scatter'])}, where the sums are {_fmt(total)}. In "
                "that phase each step adds the received chunk into the chunk this rank sends at "
                "the next step, so the partial sums grow around the ring and each rank ends "
                f"with one finished chunk.\n  {where}")
    return ("the reduce-scatter phase is right (after it every rank holds one finished chunk) "
            "but the all-gather phase is wrong: each rank first sends the chunk it finished, "
            "and every chunk it receives is finished too: it replaces its copy and is the one "
            f"to pass on at the next step.\n  {where}")


def _check_ring_traffic(sends: list[int], p: int, numel: int) -> None:
    """A right answer can still send too much: the ring's point is 2(p-1) sends of 1/p each."""
    if not sends:  # sent through another API (batch_isend_irecv): nothing to count
        return
    if len(sends) == 2 * p - 1:
        raise CheckFailed(
            f"the sums are right, but rank 0 sent {len(sends)} chunks where the ring needs "
            f"2(p-1) = {2 * p - 2}: a phase ran p steps, not p-1 (p = {p}). After p-1 "
            "reduce-scatter steps each rank already holds one finished chunk; the extra step "
            "sends 1/p of the tensor for nothing")
    if len(sends) != 2 * p - 2 or sum(sends) > 2 * numel * (p - 1) / p + 2 * p:
        raise CheckFailed(
            f"the sums are right, but rank 0 made {len(sends)} sends of {sum(sends)} elements "
            f"in all, for a tensor of {numel}: the ring makes 2(p-1) = {2 * p - 2} sends of "
            f"one chunk (1/p of the tensor) each, {2 * (p - 1) / p:.2f}x the tensor in all, "
            "whatever p is: that is why it is bandwidth-optimal")


@shows_prints
def check_ring_all_reduce(learner: ModuleType) -> list[str]:
    p = RING_WORLD
    ranks = run_learner(learner, _ring_worker, p)
    for case, shape in enumerate(RING_SHAPES[:len(ranks[0])]):
        inputs = [_ring_input(shape, r) for r in range(p)]
        total = torch.stack(inputs).sum(0)
        got = [ranks[r][case] for r in range(p)]
        if all(torch.equal(g["x"], total) for g in got):
            if not all(g["in place"] for g in got):
                raise CheckFailed("the tensor holds the sum, but ring_all_reduce did not "
                                  "return it: return tensor (the same object) at the end")
            _check_ring_traffic(got[0]["sends"], p, total.numel())
            continue
        if all(g["returned"] is not None and torch.equal(g["returned"], total) for g in got):
            raise CheckFailed("you returned the sum in a new tensor and left the caller's "
                              "tensor unchanged: ring_all_reduce works in place (write into "
                              "the chunks, which are views of tensor) and returns tensor")
        if all(torch.allclose(g["x"], total / p) for g in got):
            raise CheckFailed("you averaged instead of summed: every rank holds the sum "
                              f"divided by {p}. all_reduce's default op is SUM (DDP divides "
                              "by the world size itself)")
        for message, knobs in _ring_mistakes(p):
            simulated = simulate_ring(inputs, **knobs)
            if simulated is not None and all(torch.equal(g["x"], s)
                                             for g, s in zip(got, simulated)):
                raise CheckFailed(f"{message}.\n  With {p} ranks and a tensor of shape "
                                  f"{list(shape)}, rank 0 holds {_fmt(got[0]['x'])}; the sum "
                                  f"is {_fmt(total)}")
        raise CheckFailed(_wrong_phase(got, total, p, shape))
    return [f"{p} ranks: every rank holds the exact sum, in place, for {len(RING_SHAPES)} "
            "tensors (a 3x4 matrix; 10 elements, split unevenly)",
            f"2(p-1) = {2 * p - 2} sends of 1/p of the tensor each, per all-reduce",
            "no deadlock: the sends do not wait for the receives"]
