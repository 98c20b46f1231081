"""Tensor parallelism with DTensor, as TorchTitan applies it, and 2-D parallelism (FSDP2 + TP).

The from-scratch version (snippets/scratch/tensor_parallel.py) replaces layers by hand and
writes the all-reduces itself. PyTorch's version describes the same split declaratively: a
DeviceMesh names the ranks, a plan maps module names to parallel styles (ColwiseParallel,
RowwiseParallel, PrepareModuleInput), and `parallelize_module` swaps each weight for a DTensor
shard and installs hooks that insert the collectives. As in TorchTitan, the plain model is
built first and parallelized afterwards; the training loop does not know.

    python -m snippets.library.tensor_parallel    # 2-D: FSDP x TP on a 2 x 2 mesh of 4 CPU processes
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from snippets.data.dataset import random_token_batches
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.tensor_parallel import check_tensor_parallel_sizes
from snippets.flags import Parser


# --8<-- [start:plan]
def block_plan(prepare_inputs: bool = True) -> dict:
    """The tensor-parallel plan of one GPT Block: module name (relative to the block) -> style.

    ColwiseParallel shards a linear's weight by output features (Shard(0) of the (out, in)
    matrix) and, by default, hands the next op a plain local tensor: the view to
    (B, T, -1, head_dim) inside attention then sees the local heads only.
    RowwiseParallel shards by input features (Shard(1)) and all-reduces the partial outputs.
    PrepareModuleInput marks the attention's and the MLP's input as a Replicate DTensor once,
    so the gradients of q, k and v (or gate and up) are summed before a single all-reduce.
    """
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if prepare_inputs:
        for region in ("self_attn", "mlp"):
            plan[region] = PrepareModuleInput(input_layouts=(Replicate(),),
                                              desired_input_layouts=(Replicate(),))
    return plan
# --8<-- [end:plan]


# --8<-- [start:apply-tp]
def apply_tp(model: GPT, tp_mesh: DeviceMesh, prepare_inputs: bool = True) -> None:
    """Shard every block's attention heads and MLP columns over tp_mesh, in place.

    The embedding, the norms and the tied output layer stay ordinary, replicated tensors.
    """
    check_tensor_parallel_sizes(model.config, tp_mesh.size())
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(prepare_inputs))
# --8<-- [end:apply-tp]


# --8<-- [start:apply-fsdp]
def apply_fsdp(model: GPT, dp_mesh: DeviceMesh) -> None:
    """FSDP2 over dp_mesh: each block its own unit (all-gathered just before it runs), then the
    root for what is left (embedding, final norm, tied output layer)."""
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize_2d(model: GPT, dp: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    """TP inside groups of `tp` ranks, FSDP across the `dp` groups: dp * tp processes.

    Ranks r = d * tp + t: the tp ranks of one group are neighbours, which on a real cluster
    means the same node (TP's all-reduces, every layer, take the fast links)."""
    mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))
    apply_tp(model, mesh["tp"])  # TP first: FSDP then shards the TP shards further
    apply_fsdp(model, mesh["dp"])
    return mesh
# --8<-- [end:apply-fsdp]


# --8<-- [start:full-weights]
def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one whole tensor on every rank, gathering DTensor shards."""
    weights = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            # One mesh dimension at a time: one all-gather each (FSDP's dp shard first).
            for dim in range(p.device_mesh.ndim):
                placements = [Replicate() if i <= dim else pl for i, pl in enumerate(p.placements)]
                p = p.redistribute(p.device_mesh, placements)
            p = p.to_local()
        weights[name] = p.detach().clone()
    return weights
# --8<-- [end:full-weights]


# --8<-- [start:demo]
def train(model: torch.nn.Module, batches, dp_rank: int = 0, dp: int = 1) -> list[float]:
    """The single-device loop: each data-parallel rank takes its slice of every global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for batch in batches:
        _, loss = model(*shift_for_next_token(batch.chunk(dp)[dp_rank]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def demo_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    mesh = parallelize_2d(model, dp=2, tp=2)
    q = model.layers[0].self_attn.q_proj.weight
    losses = train(model, random_token_batches(3, 8, 32), mesh["dp"].get_local_rank(), dp=2)
    return {"coordinate": mesh.get_coordinate(), "losses": losses,
            "q_placements": q.placements, "q_local": tuple(q.to_local().shape),
            "weights": full_weights(model)}


def main(argv: list[str] | None = None) -> None:
    from snippets.dist import spawn

    # No flags: one given by mistake is refused, not silently ignored.
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(0)
    reference = GPT(get_config("tiny"))
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    reference_losses = train(reference, random_token_batches(3, 8, 32))
    ranks = spawn(demo_worker, 4, timeout_s=120)
    for rank, r in enumerate(ranks):
        print(f"rank {rank} (dp, tp) = {tuple(r['coordinate'])}: losses on its half "
              f"{[round(x, 4) for x in r['losses']]}, q_proj {r['q_local']} of (64, 64)")
    print(f"q_proj placements: {ranks[0]['q_placements']}")
    # Ranks 0 and 2 hold the two halves of each global batch (dp 0 and dp 1, tp 0).
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])]
    print(f"mean of the two halves:   {[round(x, 4) for x in mean]}")
    print(f"single process, batch 8: {[round(x, 4) for x in reference_losses]}")
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters())
    worst = max((ranks[0]["weights"][n] - p.detach()).abs().max().item()
                for n, p in reference.named_parameters())
    print(f"after 3 steps, max weight difference to single process: {worst:.1e} "
          f"(training moved weights by up to {moved:.1e})")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
