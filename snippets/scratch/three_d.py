"""3-D parallelism from the course's own parts: data x tensor x pipeline (DP x TP x PP).

Each of the three cuts the work along its own axis: TP splits every matrix of a layer
(tensor_parallel.py), PP cuts the stack of layers into stages (pipeline.py), DP gives each copy
of the whole pipeline its own slice of the batch (ddp.py). With all three, a rank holds one TP
shard of one stage, of one replica, and talks to three groups of ranks:

- its TP group: the other shards of the same stage of the same replica (all-reduce per layer);
- its PP group: the same shard of the other stages of the same replica (send/recv);
- its DP group: the same shard of the same stage in the other replicas (gradient all-reduce).

The DP group is the subtle one. Averaging gradients over "every rank that holds this stage"
would add up different TP shards (other heads, other MLP columns) that happen to have the same
shape: no error, and a model that silently trains wrong. Only replicas of the same stage *and*
the same shard hold the same parameters.

Only torch.distributed primitives are used (new_group, all_reduce, isend, recv);
tests/test_three_d.py checks the result against one process. To run DP x TP x PP = 2 x 2 x 2:
`python -m snippets.scratch.three_d`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist

from snippets.dist import DEFAULT_TIMEOUT_S, spawn
from snippets.models.gpt import GPT, ConfigError, GPTConfig, get_config
from snippets.planner.cost_model import MODELS, messages_per_rank
from snippets.scratch.ddp import make_buckets
from snippets.scratch.pipeline import (one_f_one_b_schedule, pipeline_train_step,
                                       single_process, split_into_stages)
from snippets.scratch.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                              all_reduce_bytes_per_step, apply_tensor_parallel)


# --8<-- [start:mesh]
@dataclass(frozen=True)
class Mesh:
    """How world_size = dp * pp * tp ranks are laid out: rank = ((d * pp) + p) * tp + t.

    `order` lists the axes from outermost (changes slowest with the rank) to innermost.
    TP is innermost because it talks most (two all-reduces of activations per layer, forward
    and backward, on the critical path): torchrun and SLURM put consecutive ranks on one node,
    so a TP group rides the fastest links (NVLink). PP sends one activation per micro-batch to
    a neighbour; DP all-reduces the gradients once per step, overlappable with backward.
    """

    dp: int
    pp: int
    tp: int
    order: tuple = ("dp", "pp", "tp")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> dict:
        """{"dp": d, "pp": p, "tp": t} of a rank: its digits in the mixed base of `order`."""
        coords = {}
        for axis in reversed(self.order):
            rank, coords[axis] = divmod(rank, getattr(self, axis))
        return coords

    def rank(self, **coords) -> int:  # the inverse of coords
        rank = 0
        for axis in self.order:
            rank = rank * getattr(self, axis) + coords[axis]
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks whose other two coordinates are equal."""
        others = [a for a in self.order if a != axis]
        return [[self.rank(**{axis: i, others[0]: a, others[1]: b})
                 for i in range(getattr(self, axis))]
                for a, b in product(range(getattr(self, others[0])),
                                    range(getattr(self, others[1])))]

    def table(self) -> str:
        lines = ["rank  dp pp tp  TP group  PP group  DP group"]
        for r in range(self.size):
            c = self.coords(r)
            mine = [next(g for g in self.groups(a) if r in g) for a in ("tp", "pp", "dp")]
            lines.append(f"{r:>4}  {c['dp']:>2} {c['pp']:>2} {c['tp']:>2}  "
                         + "  ".join(f"{str(g):<8}" for g in mine).rstrip())
        return "\n".join(lines)


def build_groups(mesh: Mesh, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """This rank's {"dp", "pp", "tp"} process groups, all cut from the one mesh.

    new_group is itself a collective over the whole world: every rank must create every group,
    its own or not, in the same order, or the ranks wait for each other until the timeout.
    A group's timeout is not inherited from the world's (gloo's default is 30 minutes): pass it.
    """
    if dist.get_world_size() != mesh.size:
        raise ConfigError(f"world size {dist.get_world_size()} is not dp*pp*tp = "
                          f"{mesh.dp}*{mesh.pp}*{mesh.tp} = {mesh.size}; start {mesh.size} "
                          "processes, or choose sizes whose product is the world size")
    mine, rank = {}, dist.get_rank()
    for axis in ("tp", "pp", "dp"):
        for ranks in mesh.groups(axis):
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                mine[axis] = group
    return mine
# --8<-- [end:mesh]


# --8<-- [start:parallelize]
def parallelize_3d(model: GPT, mesh: Mesh, groups: dict):
    """TP inside every block, then this rank's pipeline stage. The model is the plain GPT;
    the training loop below never looks inside it. Returns (stage, TensorParallelCommStats)."""
    tp_stats = apply_tensor_parallel(model, groups["tp"])
    stage = split_into_stages(model, mesh.pp)[mesh.coords(dist.get_rank())["pp"]]
    return stage, tp_stats


def average_gradients(buckets: list, group) -> int:
    """Mean of the gradients over `group`: ddp.py's buckets, all-reduced over a group instead
    of the world. Returns the payload in bytes."""
    size, sent = dist.get_world_size(group), 0
    for bucket in buckets:
        bucket.pack()
        dist.all_reduce(bucket.buffer, group=group)
        bucket.unpack(1 / size)
        sent += bucket.buffer.numel() * bucket.buffer.element_size()
    return sent
# --8<-- [end:parallelize]


# --8<-- [start:train]
def train_3d(rank: int, world_size: int, mesh: Mesh, steps: int, batch_size: int, seq_len: int,
             micro_batches: int, grad_sync: str = "dp") -> dict:
    """pipeline.single_process's training (tiny GPT, one layer per stage, SGD with momentum,
    the same batches), spread over the mesh. Each DP replica takes its own 1/dp of the batch.

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
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.9)
    buckets = make_buckets(stage, bucket_cap_mb=25)
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=g)
        mine = tokens.chunk(mesh.dp)[c["dp"]]
        tp_stats.reset()
        loss, trace = pipeline_train_step(stage, one_f_one_b_schedule, mine, micro_batches,
                                          c["pp"], mesh.pp, group=groups["pp"])
        dp_bytes = average_gradients(buckets, sync_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    sent = {"tp": tp_stats.forward_bytes + tp_stats.backward_bytes,
            "pp": pp_bytes_sent(trace, mine.shape[0] // micro_batches, seq_len, stage, mesh,
                                c["pp"]),
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
    return sends * message + (stage.embed_tokens if p == 0 else stage.lm_head).weight.numel() * 4


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
    print("bytes per step, per rank   TP all-reduce   PP send   DP all-reduce")
    plan = dict(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, zero_stage=0, precision="fp32", seq_len=SEQ,
                micro_batch_size=BATCH // mesh.dp // MICRO_BATCHES, micro_batches=MICRO_BATCHES)
    for p in range(mesh.pp):  # the planner prices every stage as its busiest, the first
        rows = {"counted": ranks[mesh.rank(dp=0, pp=p, tp=0)]["dp"]["sent"],
                "formula": bytes_per_step(config, mesh, BATCH, SEQ, p),
                "planner": messages_per_rank(dict(MODELS["tiny"], num_hidden_layers=mesh.pp), plan)}
        for what, row in rows.items():
            print(f"stage {p}, {what}:{row['tp']:>20,.0f} {row['pp']:>9,.0f} {row['dp']:>15,.0f}")
    worst, _ = compare([r["stage"] for r in ranks], mesh, reference, ref_losses)
    print(f"gradients averaged over all DP x TP ranks of a stage: max |diff| {worst:.0e}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
