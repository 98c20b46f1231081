"""EP x DP = 2 x 2 (expert_data_parallel.py) trained against one process: the training, the
reference, the bound, the bytes each group moves, and the two classic mistakes, planted as
their own sync functions to show that the comparison catches them.

    python -m snippets.scratch.expert_data_parallel_check
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, GPTConfig, shift_for_next_token
from snippets.scratch.expert_data_parallel import (AUX_WEIGHT, BATCH, CONFIG, DP, EP, EXPERTS,
                                                   LR, SEQ, STEPS, TOP_K, build_ep_dp_groups,
                                                   ep_dp_mesh, layout_table, moe_gpt,
                                                   parallelize_ep_dp, sync_gradients)
from snippets.scratch.moe import MoE, is_expert_parameter, moe_aux_loss
from snippets.scratch.three_d import Mesh, average_gradients
from snippets.scratch.three_d_check import tolerance


# --8<-- [start:mistakes]
def experts_over_the_world(dense_buckets: list, expert_buckets: list, groups: dict) -> dict:
    """Mistake 1, plain data parallelism for every weight: experts averaged over every rank,
    adding other experts' gradients of the same shapes. Nothing raises."""
    return {"dense": average_gradients(dense_buckets, groups["dense"]),
            "experts": average_gradients(expert_buckets, groups["dense"])}


def experts_without_ep(dense_buckets: list, expert_buckets: list, groups: dict) -> dict:
    """Mistake 2: the right group for the experts, but the mean stops at its dp ranks: every
    expert gradient ep times too large."""
    return {"dense": average_gradients(dense_buckets, groups["dense"]),
            "experts": average_gradients(expert_buckets, groups["expert_dp"])}


GRAD_SYNCS = {"expert-dp": sync_gradients, "world": experts_over_the_world,
              "expert-dp-mean": experts_without_ep}  # the right one, then the two mistakes
# --8<-- [end:mistakes]


# --8<-- [start:train]
@contextmanager
def count_all_to_all(sent: list):
    """Record the payload of every all_to_all_single that moe.py's dispatch makes, forward and
    backward, by wrapping the one function it calls for as long as the block runs."""
    original = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield
    finally:
        dist.all_to_all_single = original


def global_state(model: GPT) -> dict:
    """The state dict under one process's names: local expert j is expert first_expert + j."""
    state = {n: t.clone() for n, t in model.state_dict().items() if not is_expert_parameter(n)}
    for name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        for j, expert in enumerate(moe.experts):
            for key, t in expert.state_dict().items():
                state[f"{name}.experts.{moe.first_expert + j}.{key}"] = t.clone()
    return state


def train_ep_dp(rank: int, world_size: int, mesh: Mesh, groups: dict,
                grad_sync: str = "expert-dp") -> dict:
    """one_process's training (SGD with momentum, the same batches) over the mesh: each rank
    takes its own 1/world of every batch, routes its own tokens, and its EP group runs them."""
    model = moe_gpt()
    dense_buckets, expert_buckets = parallelize_ep_dp(model, groups)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for tokens in random_token_batches(STEPS, BATCH, SEQ, CONFIG.vocab_size):
        inputs, targets = shift_for_next_token(tokens.chunk(world_size)[rank])
        all_to_all = []
        with count_all_to_all(all_to_all):
            _, lm_loss = model(inputs, targets)
            (lm_loss + AUX_WEIGHT * moe_aux_loss(model)).backward()
        sent = GRAD_SYNCS[grad_sync](dense_buckets, expert_buckets, groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(lm_loss.item())
    return {"coords": mesh.coords(rank), "losses": losses, "state": global_state(model),
            "sent": {**sent, "ep": sum(all_to_all)}}
# --8<-- [end:train]


# --8<-- [start:reference]
def one_process(world_size: int) -> tuple[dict, list]:
    """The same training in one process: a batch's world shards one after another (routing and
    the balancing loss are per shard, as on the ranks), losses averaged, one step."""
    model = moe_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for tokens in random_token_batches(STEPS, BATCH, SEQ, CONFIG.vocab_size):
        total, lm = 0, []  # lm: the shards' losses, averaged in rank order as compare does
        for shard in tokens.chunk(world_size):
            _, lm_loss = model(*shift_for_next_token(shard))
            total = total + (lm_loss + AUX_WEIGHT * moe_aux_loss(model)) / world_size
            lm.append(lm_loss.item())
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(lm) / world_size)
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


def gather_state(results: list[dict]) -> dict:
    """One process's state dict from the ranks' parts. Every copy of a weight must hold the very
    same bits (an all-reduce gives every member the same sum)."""
    full = {}
    for rank, result in enumerate(results):
        for name, t in result["state"].items():
            if not torch.equal(full.setdefault(name, t), t):
                raise AssertionError(f"rank {rank}: {name} differs from another copy")
    return full


def compare(results: list[dict], reference: dict, ref_losses: list) -> tuple:
    """(largest weight difference, per-step loss differences) against one process."""
    full = gather_state(results)
    worst = max((full[k] - reference[k]).abs().max().item() for k in reference)
    losses = [sum(r["losses"][s] for r in results) / len(results) for s in range(STEPS)]
    return worst, [abs(a - b) for a, b in zip(losses, ref_losses)]


def update_gap(state: dict, init: dict, a: int, b: int) -> float:
    """How differently experts a and b moved from their initial weights, over every layer."""
    keys = [k for k in state if f".experts.{a}." in k]
    twin = {k: k.replace(f".experts.{a}.", f".experts.{b}.") for k in keys}
    return max(((state[k] - init[k]) - (state[twin[k]] - init[twin[k]])).abs().max().item()
               for k in keys)
# --8<-- [end:reference]


# --8<-- [start:tolerance]
# How close is equal? The same fp32 numbers are added as in one process, in another order: an
# expert multiplies its EP group's shards' rows in one matmul, not a shard at a time (BLAS may
# order a dot product's K <= intermediate_size terms differently for another row count), sums their
# token terms into its weight gradient at once, and the expert-data all-reduce adds the other
# replica's; a dense gradient sums a shard's tokens, then the all-reduce the 4 ranks', where one
# process accumulates 4 backward passes. Divisions are by 2 or 4: exact. As in
# three_d_check.tolerance: a reordered sum of n terms moves by at most (n-1) u sum|terms|,
# u = 2^-24, about (K + B*T) u of the result for terms of one sign; SGD with momentum keeps a
# weight's error that share of how far it moved; doubled for cancellation: 2 (K + B*T) u * scale,
# scale = the largest weight change (or the loss). Not covered: rounding flipping a router's top-k
# between experts tied to the last bit: that sends a token to another expert, a difference far
# outside the bound, so it could fail a run but never pass a wrong one. main() and the test run
# one thread per rank and in the reference. The wrong group is off by a whole update.
def bound(scale: float) -> float:
    return tolerance(CONFIG, BATCH, SEQ, scale)
# --8<-- [end:tolerance]


# --8<-- [start:bytes]
def bytes_per_group(config: GPTConfig, mesh: Mesh, num_experts: int, top_k: int,
                    batch_size: int, seq_len: int) -> dict:
    """Bytes handed to each group's collectives per step, summed over its ranks, from sizes
    alone. dense: each rank, every weight outside the experts: embedding V*h (tied with the
    head), per layer attention 4h^2, two norms 2h, router E*h; the final norm h. experts: each
    of dp ranks, its E/ep experts per layer, 3*h*i each. ep: per MoE layer, each rank's E counts
    (int64), then each of its T*k assignments' h values four times: to its expert and back, in
    forward and in backward. Rows sent are rows received: the group's total needs no routing."""
    h, i, v, layers = (config.hidden_size, config.intermediate_size, config.vocab_size,
                       config.num_hidden_layers)
    dense = v * h + layers * (4 * h * h + 2 * h + num_experts * h) + h
    experts = layers * (num_experts // mesh.tp) * 3 * h * i
    tokens = batch_size * seq_len // mesh.size  # T: one rank's shard
    per_layer = 8 * num_experts + 4 * tokens * top_k * h * 4
    return {"dense": mesh.size * dense * 4, "experts": mesh.dp * experts * 4,
            "ep": mesh.tp * layers * per_layer}
# --8<-- [end:bytes]


# --8<-- [start:demo]
def demo_worker(rank: int, world_size: int, mesh: Mesh) -> dict:
    groups = build_ep_dp_groups(mesh)
    return {sync: train_ep_dp(rank, world_size, mesh, groups, sync) for sync in GRAD_SYNCS}


def counted_per_group(results: list[dict], mesh: Mesh) -> list:
    formula = bytes_per_group(CONFIG, mesh, EXPERTS, TOP_K, BATCH, SEQ)
    rows = [("dense all-reduce", list(range(mesh.size)), "dense")]
    rows += [("expert all-reduce", g, "experts") for g in mesh.groups("dp")]
    rows += [("all-to-all", g, "ep") for g in mesh.groups("tp")]
    return [(what, g, sum(results[r]["sent"][key] for r in g), formula[key])
            for what, g, key in rows]


def main() -> None:
    torch.set_num_threads(1)  # the reference too: one thread, the same sums on every machine
    mesh = ep_dp_mesh(EP, DP)
    print(layout_table(mesh, EXPERTS))
    ranks = spawn(demo_worker, mesh.size, mesh, timeout_s=60)
    reference, ref_losses = one_process(mesh.size)
    init = moe_gpt().state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    worst, loss_diffs = compare([r["expert-dp"] for r in ranks], reference, ref_losses)
    for step, (diff, loss) in enumerate(zip(loss_diffs, ref_losses)):
        print(f"step {step}: loss, |diff| < bound: {diff < bound(loss)}")
    print(f"weights after {STEPS} steps, max |diff| < bound ({bound(moved):.0e}): "
          f"{worst < bound(moved)}")
    print("bytes per step, summed over the group's ranks".ljust(50) + "counted    formula")
    for what, group, counted, formula in counted_per_group([r["expert-dp"] for r in ranks], mesh):
        print(f"{what:<18} {str(group):<12} {counted:>25,} {formula:>10,}")
    for sync in list(GRAD_SYNCS)[1:]:  # the two mistakes
        results = [r[sync] for r in ranks]
        worst, _ = compare(results, reference, ref_losses)
        gap = update_gap(gather_state(results), init, 0, EXPERTS // EP)
        print(f'grad_sync="{sync}": max |diff| {worst:.0e}, > 100 x bound: '
              f"{worst > 100 * bound(moved)}; experts 0 and {EXPERTS // EP} moved alike: "
              f"{gap < bound(moved)}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
