"""Checks of the parallelisms the learner writes (exercises 16 onward).

Like checks_model.py, each check takes the learner's module and returns what passed, or raises
CheckFailed. The wrong answers learners usually write are computed here too (a ring simulated
with the wrong direction, a schedule with one warm-up forward too many, a g that all-reduces in
backward, ...), so that an output matching one of them is named.

Checks that need processes run the learner's file on gloo processes through gang.run_learner: one
start per check, a hard time limit, and a deadlock reported with each waiting rank's call.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


# ---------------------------------------------------------------- exercise 16: ring all-reduce

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


# ---------------------------------------------------------------- exercise 17: the sampler

SAMPLER_CASES = (  # (dataset_len, num_replicas, shuffle, seed, drop_last)
    (10, 4, True, 0, False), (10, 4, True, 3, True), (12, 4, True, 0, False),
    (10, 4, False, 0, False), (7, 3, False, 0, True),
)


def _sampler_orders(cls, n, replicas, shuffle, seed, drop_last, epoch) -> list[list[int]]:
    orders = []
    for rank in range(replicas):
        sampler = cls(n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                      drop_last=drop_last)
        sampler.set_epoch(epoch)
        orders.append([int(i) for i in sampler])
    return orders


def _torch_orders(n, replicas, shuffle, seed, drop_last, epoch) -> list[list[int]]:
    from torch.utils.data import DistributedSampler

    def make(dataset_len, num_replicas, rank, shuffle, seed, drop_last):
        return DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
    return _sampler_orders(make, n, replicas, shuffle, seed, drop_last, epoch)


def check_sampler(learner: ModuleType) -> list[str]:
    cls = learner.ShardedSampler
    for n, replicas, shuffle, seed, drop_last in SAMPLER_CASES:
        setting = (f"{n} examples on {replicas} ranks (shuffle={shuffle}, seed={seed}, "
                   f"drop_last={drop_last})")
        for epoch in (0, 1):
            got = _sampler_orders(cls, n, replicas, shuffle, seed, drop_last, epoch)
            want = _torch_orders(n, replicas, shuffle, seed, drop_last, epoch)
            if got == want:
                continue
            where = f"with {setting}, epoch {epoch}"
            sizes = [len(o) for o in got]
            if len(set(sizes)) > 1:
                raise CheckFailed(
                    f"{where}, the ranks got different numbers of examples ({sizes}): a rank "
                    "with fewer batches leaves its epoch early while the others wait for it in "
                    "the gradient all-reduce, forever. Give every rank ceil(n / replicas) by "
                    "repeating indices from the start (or n // replicas with drop_last)")
            counted = [len(cls(n, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)) for r in range(replicas)]
            if counted != sizes:
                raise CheckFailed(f"{where}, len(sampler) is {counted[0]} but it yields "
                                  f"{sizes[0]} indices: __len__ must say how many it yields")
            if sizes != [len(o) for o in want]:
                raise CheckFailed(
                    f"{where}, each rank got {sizes[0]} examples; expected {len(want[0])}: "
                    + ("drop_last=True drops the remainder, n // replicas each" if drop_last
                       else "drop_last=False pads to ceil(n / replicas) each, so no example "
                            "is lost"))
            seen = [i for o in got for i in o]
            if not drop_last and set(seen) != set(range(n)):
                lost = sorted(set(range(n)) - set(seen))
                same = "seed + rank: every rank must build the SAME permutation (seed + epoch)"
                raise CheckFailed(
                    f"{where}, examples {lost} are never seen while others go to several "
                    f"ranks: the ranks do not split one permutation. Did you seed with {same}?"
                    if shuffle else f"{where}, examples {lost} are never seen")
            if shuffle and epoch == 1 and got == _sampler_orders(cls, n, replicas, shuffle,
                                                                 seed, drop_last, 0):
                raise CheckFailed(f"{where} repeats epoch 0's order: set_epoch has no effect. "
                                  "Seed the generator with self.seed + self.epoch")
            order = [i for group in zip(*want) for i in group]  # the global order, strided
            blocks = [order[r * sizes[0]:(r + 1) * sizes[0]] for r in range(replicas)]
            if got == blocks:
                raise CheckFailed(
                    f"{where}, rank 0 got {got[0]}, a contiguous block of the permutation; "
                    f"DistributedSampler strides: rank r takes positions r, r + {replicas}, "
                    f"r + {2 * replicas}, ... (indices[rank::num_replicas]), so rank 0 gets "
                    f"{want[0]}")
            if not shuffle:
                raise CheckFailed(f"{where}, rank 0 got {got[0]}; expected {want[0]}: "
                                  "shuffle=False keeps the order 0, 1, 2, ...")
            raise CheckFailed(
                f"{where}, rank 0 got {got[0]}; DistributedSampler gives {want[0]}. The "
                "permutation is torch.randperm(n, generator=torch.Generator()."
                "manual_seed(seed + epoch)), padded or trimmed, then strided")
    return [f"index for index the same as DistributedSampler in {len(SAMPLER_CASES)} settings "
            "and 2 epochs: shuffled or not, padded or dropped, strided over the ranks",
            "every rank gets the same number of examples; set_epoch reshuffles"]


# ---------------------------------------------------------------- exercise 18: 1F1B

SCHEDULE_CASES = ((2, 4), (4, 8), (4, 4), (4, 2), (3, 5))  # (stages p, micro-batches m)


def _one_f_one_b(m, s, p, warmup, backward_first=False, cool_down_reversed=False) -> list:
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        pair = [("F", warmup + i), ("B", i)]
        actions += pair[::-1] if backward_first else pair
    owed = [("B", i) for i in range(m - warmup, m)]
    return actions + (owed[::-1] if cool_down_reversed else owed)


SCHEDULE_MISTAKES = (
    ("stage s ran p - s warm-up forwards, one too many: it then holds one micro-batch's "
     "activations more than 1F1B needs. Stage s runs min(p - s - 1, m) forwards before its "
     "first backward (the last stage none)",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s, m))),
    ("the warm-up is counted from the wrong end: you gave stage s s warm-up forwards. The "
     "FIRST stage waits longest for its first gradient, so it runs the most: "
     "min(p - s - 1, m), and the last stage none",
     lambda m, s, p: _one_f_one_b(m, s, p, min(s, m))),
    ("that is the GPipe schedule (all forwards, then all backwards): every stage holds all m "
     "micro-batches' activations. 1F1B starts backwards after a warm-up of p - s - 1 forwards",
     lambda m, s, p: _one_f_one_b(m, s, p, m)),
    ("in the steady state each pair must be forward, then backward: F(warmup + i), B(i). "
     "Backward first makes the last stage wait for a gradient of a micro-batch it has not "
     "run forward yet",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s - 1, m), backward_first=True)),
    ("the cool-down runs the owed backwards in reverse order. The next stage runs its "
     "backwards, and sends their gradients back, oldest micro-batch first; a stage that asks "
     "for the newest first sits idle while the gradient it could use now waits unread, and "
     "keeps every owed micro-batch's activations until the last gradient comes. Run the "
     "owed backwards oldest first, in the order their gradients arrive",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s - 1, m), cool_down_reversed=True)),
)


def simulate_pipeline(schedules: list[list]) -> str | None:
    """None when stages running these orders (stage s's list, in order) all finish; else
    where the first stuck stage waits. F(i) on stage s needs F(i) on s-1; B(i) needs F(i)
    on the same stage and B(i) on s+1."""
    p, done, pos = len(schedules), set(), [0] * len(schedules)
    while True:
        moved = False
        for s, actions in enumerate(schedules):
            while pos[s] < len(actions):
                kind, i = actions[pos[s]]
                needs = ([("F", i, s - 1)] if kind == "F" and s > 0 else []) + (
                    [("F", i, s)] + ([("B", i, s + 1)] if s < p - 1 else [])
                    if kind == "B" else [])
                if not all(n in done for n in needs):
                    break
                done.add((kind, i, s))
                pos[s] += 1
                moved = True
        if all(pos[s] == len(a) for s, a in enumerate(schedules)):
            return None
        if not moved:
            s = next(s for s, a in enumerate(schedules) if pos[s] < len(a))
            kind, i = schedules[s][pos[s]]
            return f"stage {s} waits forever at {kind}{i}"


def _peak(actions: list) -> int:
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def check_one_f_one_b(learner: ModuleType) -> list[str]:
    from snippets.scratch.pipeline import one_f_one_b_schedule as reference

    for p, m in SCHEDULE_CASES:
        got = [[tuple(a) for a in learner.one_f_one_b_schedule(m, s, p)] for s in range(p)]
        want = [reference(m, s, p) for s in range(p)]
        if got == want:
            continue
        where = f"with p = {p} stages and m = {m} micro-batches"
        for s in range(p):
            if sorted(got[s]) != sorted(want[s]):
                out_of_range = sorted({i for _, i in got[s] if not 0 <= i < m})
                extra = (f" (micro-batches {out_of_range} do not exist: with fewer "
                         "micro-batches than stages the warm-up is min(p - s - 1, m))"
                         if out_of_range else "")
                raise CheckFailed(f"{where}, stage {s}'s actions are {_fmt_actions(got[s])}: "
                                  f"each of F0..F{m - 1} and B0..B{m - 1} must appear "
                                  f"exactly once{extra}")
        for message, variant in SCHEDULE_MISTAKES:
            if all([variant(m2, s, p2) for s in range(p2)] ==
                   [[tuple(a) for a in learner.one_f_one_b_schedule(m2, s, p2)]
                    for s in range(p2)] for p2, m2 in SCHEDULE_CASES):
                raise CheckFailed(f"{message}.\n  W{where[1:]}, stage 0 ran "
                                  f"{_fmt_actions(got[0])}; 1F1B is {_fmt_actions(want[0])}")
        stuck = simulate_pipeline(got)
        s = next(s for s in range(p) if got[s] != want[s])
        raise CheckFailed(
            f"{where}, stage {s} runs {_fmt_actions(got[s])}; 1F1B is "
            f"{_fmt_actions(want[s])}"
            + (f": the pipeline deadlocks ({stuck}: the action it needs comes later in "
               "another stage's order)" if stuck else
               f" (it holds up to {_peak(got[s])} micro-batches' activations; 1F1B at most "
               f"{_peak(want[s])})"))
    return [f"the 1F1B order on every stage for {len(SCHEDULE_CASES)} (stages, micro-batches) "
            "settings, fewer micro-batches than stages included",
            "stage s holds at most p - s micro-batches' activations"]


def _fmt_actions(actions: list) -> str:
    return " ".join(f"{k}{i}" for k, i in actions)


# ---------------------------------------------------------------- exercise 19: f, g, TP linears

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


# ---------------------------------------------------------------- DDP: shared by exercises 20, 27
#
# The model, the data, the reference and the async all-reduce's handle of both DDP checks;
# exercise 20's check is in checks_overlap.py.

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


# ---------------------------------------------------------------- exercise 27: bucketed DDP
#
# make_buckets is judged in this process, against the assignments the usual mistakes give
# (computed here); then BucketedDDP.sync_gradients runs on 2 gloo processes against the mean of
# the ranks' gradients, as exercise 20.

# Bytes: 4 buckets, then 2, of _ddp_model's 128 + 32 + 96 + 12 bytes. 100 first: there every
# mistake below gives its own assignment (at 200, counting elements and closing a bucket after
# it overflowed both give one bucket).
BUCKET_CAPS = (100, 200)
BUCKET_MISTAKES = {
    "forward": "your buckets follow the registration order, first layer first: backward "
               "produces the LAST layer's gradients first, so in that order the first bucket "
               "fills last and nothing can start early. Walk reversed(params)",
    "elements": "you counted elements against the cap, not bytes: a float32 element is 4 "
                "bytes (p.numel() * p.element_size()), so your buckets are 4 times too big",
    "after": "you close a bucket only after a parameter has overflowed it, so every bucket "
             "but the last is over the cap: check size + this parameter's bytes against the "
             "cap BEFORE adding it",
    "frozen": "a parameter with requires_grad=False is in a bucket: it never gets a gradient, "
              "so pack() finds p.grad None, and a hook-driven bucket would never fill. Keep "
              "only the parameters that require grad",
}


def _simulate_buckets(model: torch.nn.Module, cap_bytes: int, *, order: str = "backward",
                      unit: str = "bytes", close: str = "before",
                      frozen: bool = False) -> list[list[str]]:
    """make_buckets' assignment by parameter name, or a usual mistake's."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or frozen]
    buckets, current, size = [], [], 0
    for name, p in (reversed(named) if order == "backward" else named):
        nbytes = p.numel() * (p.element_size() if unit == "bytes" else 1)
        if close == "before" and current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        if close == "after" and size > cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


def _bucket_cases():
    """(model, cap in bytes) pairs: the caps above, then one with a frozen parameter."""
    for cap in BUCKET_CAPS:
        yield _ddp_model(), cap
    model = _ddp_model()
    model[0].bias.requires_grad_(False)
    yield model, BUCKET_CAPS[0]


def _judge_make_buckets(learner: ModuleType) -> None:
    for model, cap in _bucket_cases():
        names = {id(p): n for n, p in model.named_parameters()}
        buckets = learner.make_buckets(model, cap / 2**20)
        try:
            got = [[names[id(p)] for p in b.params] for b in buckets]
        except (AttributeError, KeyError, TypeError):
            raise CheckFailed(f"make_buckets returned {buckets!r:.80}: return a list of "
                              "Bucket(params) objects, each holding some of the module's own "
                              "parameters") from None
        want = _simulate_buckets(model, cap)
        if got == want:
            continue
        setting = f"with a cap of {cap} bytes, your buckets are {got}"
        for name, variant in (("forward", {"order": "forward"}), ("elements", {"unit": "elements"}),
                              ("after", {"close": "after"}), ("frozen", {"frozen": True})):
            if got == _simulate_buckets(model, cap, **variant):
                raise CheckFailed(f"{setting}: {BUCKET_MISTAKES[name]}")
        flat = [n for b in got for n in b]
        if sorted(flat) != sorted(n for b in want for n in b):
            raise CheckFailed(f"{setting}: every parameter that requires grad must be in "
                              "exactly one bucket")
        raise CheckFailed(f"{setting}; expected {want}: walk the parameters in reverse, and "
                          "start a new bucket when the next one would take it over the cap")


def _bucketed_worker(learner, rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from snippets.exercises.runner import _describe

    handles = _track_all_reduces()
    model = _ddp_model()
    ddp = learner.BucketedDDP(model, bucket_cap_mb=DDP_BUCKET_MB)
    out = {"grads": [], "unwaited": [], "async": [], "error": None}
    for step in range(2):
        x, y = _ddp_batch(step, rank)
        F.mse_loss(ddp(x), y).backward()
        try:
            ddp.sync_gradients()
        except Exception as err:  # noqa: BLE001 - the parent reports it with the step
            return out | {"error": _describe(err, Path(learner.__file__)), "step": step}
        out["unwaited"].append(sum(not h.waited for h in handles))
        out["async"].append(len(handles))
        handles.clear()
        out["grads"].append([p.grad.clone() for p in model.parameters()])
        _sgd_step(model)
    return out


@shows_prints
def check_bucketed_ddp(learner: ModuleType) -> list[str]:
    _judge_make_buckets(learner)
    p = DDP_WORLD
    ranks = run_learner(learner, _bucketed_worker, p)
    ref = _ddp_reference(p)
    for r, got in enumerate(ranks):
        if got["error"]:
            raise CheckFailed(f"on {p} processes, rank {r}'s sync_gradients raised "
                              f"{got['error']}")
    found = _first_unaveraged(ranks, ref, p)
    if found:
        step, r, what = found
        if what == "unwaited":
            raise CheckFailed(
                f"in step {step + 1}, rank {r} started {ranks[r]['unwaited'][step]} async "
                "all-reduce(s) and never waited on the handle: the buffer is not sure to hold "
                "the sum before work.wait() (this check lands it only at the wait, as a GPU "
                "may). A blocking dist.all_reduce(bucket.buffer) is all sync_gradients needs")
        if what == "local/p" and ranks[r]["async"][step]:
            raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are its own divided "
                              f"by {p}: {UNPACKED_BEFORE_WAIT}")
        if what == "sum":
            raise CheckFailed(
                f"the gradients are {p} times the mean: gradients not divided by the world "
                "size. all_reduce sums; each rank's loss is a mean over its own examples, "
                "so unpack with 1 / world")
        if what in ("local", "local/p"):
            raise CheckFailed(
                f"after step {step + 1}, rank {r}'s gradients are its own"
                f"{' divided by ' + str(p) if what == 'local/p' else ''}: the all-reduced "
                "sums never reached them. For each bucket: pack(), "
                "all_reduce(bucket.buffer), then unpack(1 / world), in that order")
        raise CheckFailed(f"after step {step + 1}, rank {r}'s gradients are not the mean "
                          "of the ranks' gradients")
    return [f"make_buckets, caps of {' and '.join(map(str, BUCKET_CAPS))} bytes and a frozen "
            "parameter: reverse order, bytes against the cap, a new bucket before it would "
            "overflow",
            f"{p} ranks: after each of 2 steps every gradient is the mean over the ranks "
            "(fp32, 1e-5)"]
