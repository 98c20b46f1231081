"""3-D parallelism (snippets/scratch/three_d.py) trained on 8 processes, DP x TP x PP = 2 x 2 x 2,
against one process (reference.py), with the bytes each group moves beside a formula:

    python -m snippets.scratch.three_d_check

It also trains with the classic mistake, gradients averaged over every rank of a stage instead
of the DP group, to show that the comparison catches it. tests/test_three_d.py runs the same
workers and holds them to the bound derived in `tolerance`; snippets/bench/three_d_bytes.py
puts the planner's prices beside the bytes counted here.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist

from snippets.dist import DEFAULT_TIMEOUT_S, spawn
from snippets.models.gpt import GPT, GPTConfig, get_config
from snippets.scratch.ddp import make_buckets
from snippets.scratch.pipeline import one_f_one_b_schedule, pipeline_train_step
from snippets.scratch.reference import SGD, single_process, token_batches
from snippets.scratch.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              all_reduce_bytes_per_step)
from snippets.scratch.three_d import Mesh, average_gradients, build_groups, parallelize_3d


# --8<-- [start:train]
def train_3d(rank: int, world_size: int, mesh: Mesh, steps: int, batch_size: int, seq_len: int,
             micro_batches: int, grad_sync: str = "dp") -> dict:
    """reference.py's training (tiny GPT, one layer per stage, SGD with momentum, the same
    batches), spread over the mesh. Each DP replica takes its own 1/dp of the batch.

    grad_sync="stage" is the classic mistake, kept to show that the test catches it: average
    over every rank of the same stage (DP x TP ranks) instead of the DP group.
    """
    if grad_sync not in ("dp", "stage"):
        raise ValueError(f"grad_sync={grad_sync!r}: use 'dp' (right) or 'stage' (the mistake)")
    groups = build_groups(mesh)
    c = mesh.coords(rank)
    torch.manual_seed(0)  # the same initial weights as single_process
    model = GPT(get_config("tiny", num_hidden_layers=mesh.pp))
    stage, tp_stats = parallelize_3d(model, mesh, groups)
    sync_group = groups["dp"]
    if grad_sync == "stage":  # every rank creates every group, as build_groups does
        for ranks in [[r for r in range(mesh.size) if mesh.coords(r)["pp"] == p]
                      for p in range(mesh.pp)]:
            wrong = dist.new_group(ranks, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
            sync_group = wrong if rank in ranks else sync_group
    optimizer = torch.optim.SGD(stage.parameters(), **SGD)
    buckets = make_buckets(stage, bucket_cap_mb=25)
    losses = []
    for tokens in token_batches(model.config.vocab_size, steps, batch_size, seq_len):
        mine = tokens.chunk(mesh.dp)[c["dp"]]
        tp_stats.reset()
        loss, trace = pipeline_train_step(stage, one_f_one_b_schedule, mine, micro_batches,
                                          c["pp"], mesh.pp, group=groups["pp"])
        dp_bytes = average_gradients(buckets, sync_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    micro_batch = mine.shape[0] // micro_batches
    sent = {"tp": tp_stats.forward_bytes + tp_stats.backward_bytes,
            "pp": pp_bytes_sent(trace, micro_batch, seq_len, stage, mesh, c["pp"]),
            "dp": dp_bytes}
    shard_dims = {f"{name}.weight": 0 if isinstance(m, ColumnParallelLinear) else 1
                  for name, m in stage.named_modules()
                  if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    return {"coords": c, "losses": losses, "sent": sent, "shard_dims": shard_dims,
            "state": {k: v.clone() for k, v in stage.state_dict().items()}}
# --8<-- [end:train]


# --8<-- [start:bytes]
def pp_bytes_sent(trace, micro_batch: int, seq_len: int, stage, mesh: Mesh, p: int) -> int:
    """What this stage handed to isend in the last step, counted from the schedule it ran:
    an activation after each forward (all but the last stage), a gradient after each backward
    (all but the first), and the tied embedding's gradient between first and last stage."""
    message = micro_batch * seq_len * stage.hidden_size * 4
    sends = sum((k == "F" and p < mesh.pp - 1) or (k == "B" and p > 0) for k, *_ in trace.events)
    if not (stage.tied_embeddings and mesh.pp > 1 and p in (0, mesh.pp - 1)):
        return sends * message
    tied = stage.embed_tokens if p == 0 else stage.lm_head
    return sends * message + tied.weight.numel() * 4


def bytes_per_step(config: GPTConfig, mesh: Mesh, batch_size: int, seq_len: int, p: int) -> dict:
    """Payload per rank per step, fp32, from sizes alone (a ring all-reduce sends 2(N-1)/N x)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    layers = config.num_hidden_layers // mesh.pp
    local = batch_size // mesh.dp  # tokens of this replica: TP and PP move activations of these
    tp = all_reduce_bytes_per_step(replace(config, num_hidden_layers=layers), local, seq_len)
    first, last = p == 0, p == mesh.pp - 1
    activations = local * seq_len * h * 4 * ((not last) + (not first))
    tied = config.tie_word_embeddings and mesh.pp > 1 and (first or last)
    # DP: all the rank holds. TP splits attention and MLP (4h^2 + 3hi), not norms, embedding, head
    params = layers * (h * (4 * h + 3 * i) // mesh.tp + 2 * h) + v * h * first + (h + v * h) * last
    return {"tp": tp["forward_bytes"] + tp["backward_bytes"],
            "pp": activations + (v * h * 4 if tied else 0), "dp": params * 4}
# --8<-- [end:bytes]


# --8<-- [start:gather]
def gather_full_state(results: list[dict], mesh: Mesh) -> dict:
    """The one-process model's state_dict, rebuilt from replica 0's shards: TP shards
    concatenated along the dimension they were cut, stages merged. Every replica, and every TP
    copy of a replicated weight, must hold the very same bits (an all-reduce gives each member
    the same sum)."""
    full = {}
    for p in range(mesh.pp):
        shards = [results[mesh.rank(dp=0, pp=p, tp=t)] for t in range(mesh.tp)]
        for name, first in shards[0]["state"].items():
            dim = shards[0]["shard_dims"].get(name)
            parts = [s["state"][name] for s in shards]
            full[name] = first if dim is None else torch.cat(parts, dim=dim)
            for d, t in product(range(mesh.dp), range(mesh.tp)):
                other = results[mesh.rank(dp=d, pp=p, tp=t)]["state"][name]
                if not torch.equal(other, parts[t] if dim is not None else first):
                    raise AssertionError(f"replica {d} of stage {p}, shard {t}: {name} differs")
    return full
# --8<-- [end:gather]


# --8<-- [start:tolerance]
def tolerance(config: GPTConfig, batch_size: int, seq_len: int, scale: float) -> float:
    """How far fp32 rounding alone may move a result of size `scale` from one process's.

    The 3-D run adds the same numbers as one process, in another order, in three places:
    TP sums a row-parallel dot product of length K <= intermediate_size in tp partial sums;
    PP and DP sum a weight's gradient (and the loss) over B*T token terms in dp*m pieces
    instead of one. Reordering a sum of n terms moves it by at most (n-1) u sum|terms|, with
    u = 2^-24 the fp32 unit roundoff: relative to the result, about (K + B*T) u where the
    terms mostly share a sign (a loss; a weight's gradient over tokens early in training).
    SGD with momentum moves a weight by a sum of such gradients, so its error stays that share
    of how far it moved: scale = the largest weight change, or the loss. Doubled for the
    cancellation this does not see: 2 (K + B*T) u * scale, 3.6e-5 * scale here. A gradient
    averaged over the wrong ranks is wrong by the size of the update itself.
    """
    u = 2.0 ** -24
    return 2 * (config.intermediate_size + batch_size * seq_len) * u * scale
# --8<-- [end:tolerance]


# --8<-- [start:demo]
STEPS, BATCH, SEQ, MICRO_BATCHES = 3, 8, 16, 2


def demo_worker(rank: int, world_size: int, mesh: Mesh) -> dict:
    return {sync: train_3d(rank, world_size, mesh, STEPS, BATCH, SEQ, MICRO_BATCHES, sync)
            for sync in ("dp", "stage")}


def compare(results: list[dict], mesh: Mesh, reference: dict, ref_losses: list) -> tuple:
    """(largest weight difference, per-step loss differences) against one process."""
    full = gather_full_state(results, mesh)
    worst = max((full[k] - reference[k]).abs().max().item() for k in reference)
    last = [r for r in results if r["coords"]["pp"] == mesh.pp - 1 and r["coords"]["tp"] == 0]
    losses = [sum(r["losses"][s] for r in last) / mesh.dp for s in range(len(ref_losses))]
    return worst, [abs(a - b) for a, b in zip(losses, ref_losses)]


BYTES_HEADER = "bytes per step, per rank   TP all-reduce   PP send   DP all-reduce"


def bytes_row(p: int, what: str, row: dict) -> str:
    return f"stage {p}, {what}:{row['tp']:>20,.0f} {row['pp']:>9,.0f} {row['dp']:>15,.0f}"


def main() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    print(mesh.table())
    ranks = spawn(demo_worker, mesh.size, mesh, timeout_s=60)
    reference, ref_losses = single_process(STEPS, BATCH, SEQ, num_layers=mesh.pp)
    torch.manual_seed(0)
    init = GPT(get_config("tiny", num_hidden_layers=mesh.pp)).state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    config = get_config("tiny", num_hidden_layers=mesh.pp)
    bound = tolerance(config, BATCH, SEQ, moved)
    worst, loss_diffs = compare([r["dp"] for r in ranks], mesh, reference, ref_losses)
    for step, (diff, loss) in enumerate(zip(loss_diffs, ref_losses)):
        print(f"step {step}: loss, |diff| < bound: {diff < tolerance(config, BATCH, SEQ, loss)}")
    print(f"weights after {STEPS} steps, max |diff| < bound ({bound:.0e}): {worst < bound}")
    print(BYTES_HEADER)
    for p in range(mesh.pp):
        print(bytes_row(p, "counted", ranks[mesh.rank(dp=0, pp=p, tp=0)]["dp"]["sent"]))
        print(bytes_row(p, "formula", bytes_per_step(config, mesh, BATCH, SEQ, p)))
    worst, _ = compare([r["stage"] for r in ranks], mesh, reference, ref_losses)
    print(f"gradients averaged over all DP x TP ranks of a stage: max |diff| {worst:.0e}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
