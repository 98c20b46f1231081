"""The tiny GPT trained under context parallelism (snippets/scratch/context_parallel_gpt.py),
against one process on the same global batches: cp=2 on 2 processes, then DP x CP = 2 x 2 on 4.
Each run is repeated with the classic mistake planted (gradients averaged over the DP ranks
only, not over DP x CP), to show that the comparison catches it.

    python -m snippets.scratch.context_parallel_gpt_check
"""

from __future__ import annotations

import torch

from snippets.dist import spawn
from snippets.models.gpt import GPT, GPTConfig, get_config, shift_for_next_token
from snippets.scratch.context_parallel import ring_bytes_per_rank
from snippets.scratch.context_parallel_gpt import apply_context_parallel, shard_batch
from snippets.scratch.ddp import make_buckets
from snippets.scratch.parallelize import Layout, gradient_groups, shard_dims
from snippets.scratch.reference import SGD, single_process, token_batches
from snippets.scratch.tensor_parallel import apply_tensor_parallel
from snippets.scratch.three_d import average_gradients, build_groups

STEPS, BATCH, SEQ = 3, 4, 32


# --8<-- [start:layout]
def grad_groups(layout: Layout, groups: dict, grad_sync: str) -> list:
    """The groups a gradient is averaged over, one after the other. Right ("dp_cp"): DP and
    CP, parallelize.gradient_groups; a mean over DP then over CP is the mean over their
    product. The mistake ("dp"): DP only, as if the CP ranks had seen the same tokens."""
    if grad_sync not in ("dp_cp", "dp"):
        raise ValueError(f"grad_sync={grad_sync!r}: use 'dp_cp' (right) or 'dp' (the mistake)")
    return gradient_groups(layout, groups) if grad_sync == "dp_cp" else [groups["dp"]]
# --8<-- [end:layout]


# --8<-- [start:train]
def train_cp(rank: int, world_size: int, layout: Layout, steps: int, batch_size: int,
             seq_len: int, grad_sync: str = "dp_cp", tp_after_cp: bool = False) -> dict:
    """reference.single_process's training (tiny GPT, SGD with momentum, the same batches) on
    the layout (three_d's Mesh, with a cp axis and no pipeline): each DP replica takes its 1/dp
    of the batch, each CP rank T/cp of its tokens."""
    mesh = layout.mesh()
    groups, c = build_groups(mesh), mesh.coords(rank)
    torch.manual_seed(0)  # the same initial weights as single_process
    model = GPT(get_config("tiny"))
    if layout.tp > 1 and not tp_after_cp:
        apply_tensor_parallel(model, groups["tp"])
    ring = apply_context_parallel(model, groups["cp"])
    if layout.tp > 1 and tp_after_cp:
        apply_tensor_parallel(model, groups["tp"])
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    buckets = make_buckets(model, bucket_cap_mb=25)
    losses = []
    for tokens in token_batches(model.config.vocab_size, steps, batch_size, seq_len):
        inputs, targets = shift_for_next_token(tokens.chunk(layout.dp)[c["dp"]])
        _, loss = model(*shard_batch(inputs, targets, c["cp"], layout.cp))
        loss.backward()  # the mean over this rank's tokens: an equal share of the batch's
        for group in grad_groups(layout, groups, grad_sync):
            average_gradients(buckets, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"coords": c, "losses": losses, "shard_dims": shard_dims({0: model}),
            "sent": {phase: sent // steps for phase, sent in ring.bytes_sent.items()},
            "state": {k: v.clone() for k, v in model.state_dict().items()}}
# --8<-- [end:train]


# --8<-- [start:compare]
def full_state(results: list[dict], layout: Layout, d: int, c: int) -> dict:
    """Replica (d, c)'s weights in one model's layout: its TP shards put back together."""
    shards = [results[layout.mesh().rank(dp=d, pp=0, cp=c, tp=t)] for t in range(layout.tp)]
    return {name: first if (dim := shards[0]["shard_dims"].get(name)) is None
            else torch.cat([s["state"][name] for s in shards], dim)
            for name, first in shards[0]["state"].items()}


def compare(results: list[dict], layout: Layout, reference: dict, ref_losses: list) -> dict:
    """Against one process: the largest weight difference over every DP x CP replica, the
    per-step loss differences (the mean of the ranks' losses: equal shares of the tokens), and
    whether every replica holds the very same bits (an all-reduce gives each the same sum)."""
    replicas = [full_state(results, layout, d, c)
                for d in range(layout.dp) for c in range(layout.cp)]
    worst = max((r[k] - reference[k]).abs().max().item() for r in replicas for k in reference)
    losses = [sum(results[layout.mesh().rank(dp=d, pp=0, cp=c, tp=0)]["losses"][s]
                  for d in range(layout.dp) for c in range(layout.cp)) / (layout.dp * layout.cp)
              for s in range(len(ref_losses))]
    same = all(torch.equal(r[k], replicas[0][k]) for r in replicas for k in reference)
    return {"weights": worst, "losses": [abs(a - b) for a, b in zip(losses, ref_losses)],
            "replicas_equal": same}
# --8<-- [end:compare]


# --8<-- [start:tolerance]
def tolerance(config: GPTConfig, batch_size: int, seq_len: int, scale: float,
              training: bool = True) -> float:
    """How far fp32 rounding alone may move a result of size `scale` from one process's.

    CP adds the same numbers as one process, in another order: a dot product of length
    K <= intermediate_size may be blocked differently for T/cp rows than for T (and split into
    tp partial sums under TP); a query's softmax sums up to T keys block by block, merged
    through log-sum-exps; and in training a weight's gradient, and the loss, sum B*T token
    terms in dp*cp pieces instead of one. Reordering a sum of n terms moves it by at most
    (n-1) u sum|terms|, u = 2^-24: about (K + T + B*T) u of the result where the terms mostly
    share a sign, as in three_d.tolerance. A weight's error is that share of how far it moved
    (scale: the largest weight change), a loss's of the loss, a logit's of the largest logit
    (forward only: no B*T sum). Doubled for the cancellation this does not see. A gradient
    not averaged over CP is wrong by the size of the update itself, hundreds of bounds.
    """
    u = 2.0 ** -24
    terms = config.intermediate_size + seq_len + (batch_size * seq_len if training else 0)
    return 2 * terms * u * scale
# --8<-- [end:tolerance]


# --8<-- [start:demo]
def demo_worker(rank: int, world_size: int, layout: Layout) -> dict:
    return {sync: train_cp(rank, world_size, layout, STEPS, BATCH, SEQ, sync)
            for sync in ("dp_cp", "dp")}


def main() -> None:
    config = get_config("tiny")  # attention is replaced under CP; the reference uses sdpa
    reference, ref_losses = single_process(STEPS, BATCH, SEQ)
    torch.manual_seed(0)
    init = GPT(config).state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    bound = tolerance(config, BATCH, SEQ, moved)
    print(f"tiny GPT, batch {BATCH} x {SEQ} tokens, {STEPS} steps of SGD with momentum, fp32")
    for layout in (Layout(cp=2), Layout(dp=2, cp=2)):
        ranks = spawn(demo_worker, layout.size, layout, timeout_s=60)
        print(f"dp={layout.dp} x cp={layout.cp}: each rank {BATCH // layout.dp} sequences x "
              f"{SEQ // layout.cp} of their {SEQ} tokens")
        right = compare([r["dp_cp"] for r in ranks], layout, reference, ref_losses)
        loss_ok = [d < tolerance(config, BATCH, SEQ, loss)
                   for d, loss in zip(right["losses"], ref_losses)]
        print(f"  gradients averaged over dp x cp: losses |diff| < bound {loss_ok}, weights "
              f"|diff| < bound: {right['weights'] < bound}, replicas equal: "
              f"{right['replicas_equal']}")
        heads, head_dim = config.num_attention_heads, config.head_dim
        formula = ring_bytes_per_rank(BATCH // layout.dp, heads, SEQ, head_dim, layout.cp)
        for phase in ("forward", "backward"):
            sent = sorted({r["dp_cp"]["sent"][phase] for r in ranks})
            print(f"  ring {phase:8} bytes per step {', '.join(f'{b:,}' for b in sent)}, the "
                  f"same on every rank: {len(sent) == 1}; formula {config.num_hidden_layers} "
                  f"layers x {formula[phase][1]:,}")
        wrong = compare([r["dp"] for r in ranks], layout, reference, ref_losses)
        print(f"  planted, no average over cp (dp only): weights |diff| > 100 x bound: "
              f"{wrong['weights'] > 100 * bound}, replicas equal: {wrong['replicas_equal']}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
