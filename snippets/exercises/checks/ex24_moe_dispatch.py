"""Check of exercise 24: dispatch_to_experts (moe.py)."""

from __future__ import annotations

from types import ModuleType

import torch

import snippets.models.gpt  # noqa: F401 - the learner's moe.py imports it: preloaded once
from snippets.exercises.checks._ranks import _describe, _same
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed


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
