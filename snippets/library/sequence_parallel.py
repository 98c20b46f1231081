"""Sequence parallelism with DTensor, as TorchTitan applies it, with a vocabulary-parallel loss.

The from-scratch version (snippets/scratch/sequence_parallel.py) writes the all-gathers and
reduce-scatters itself. Here the plan says where tensors are sharded along the sequence
(Shard(1) of (B, T, hidden)): SequenceParallel on every norm; the column-parallel layers take a
Shard(1) input, which PrepareModuleInput all-gathers once per region; the row-parallel layers
hand back Shard(1), a reduce-scatter. The embedding and the output layer are split by
vocabulary, and `loss_parallel()` computes the cross-entropy on logits sharded by vocabulary,
never gathering the (B, T, vocab) tensor.

    python -m snippets.library.sequence_parallel    # 2 CPU processes against one process
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.tensor_parallel import check_tensor_parallel_sizes
from snippets.flags import Parser


# --8<-- [start:plan]
def block_plan() -> dict:
    """One Block: the norms on sequence shards, attention and MLP as in TP between them."""
    enter = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": enter,  # all-gather the tokens once, for q, k and v
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter
        "post_attention_layernorm": SequenceParallel(),
        "mlp": enter,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def model_plan() -> dict:
    """The ends of the model: embedding rows split by vocabulary, its output reduce-scattered
    to sequence shards; the final norm on them; the output layer gathers the tokens and
    returns logits sharded by vocabulary, as a DTensor, for loss_parallel."""
    return {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
# --8<-- [end:plan]


# --8<-- [start:apply]
def apply_sp(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Tensor and sequence parallelism over tp_mesh, in place. Call forward and backward
    inside `with loss_parallel():`."""
    check_tensor_parallel_sizes(model.config, tp_mesh.size())
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan())
    parallelize_module(model, tp_mesh, model_plan())
    if model.config.tie_word_embeddings:
        # Each style wrapped the shared weight in a Parameter of its own; both are Shard(0)
        # (by vocabulary) on the same mesh, so one of them can serve both modules again.
        model.lm_head.weight = model.embed_tokens.weight
# --8<-- [end:apply]


# --8<-- [start:demo]
def first_step(model: GPT, batch: torch.Tensor):
    """Loss and every parameter's whole gradient, after one forward and backward."""
    with loss_parallel():
        logits, loss = model(*shift_for_next_token(batch))
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return logits, loss, grads


def demo_worker(rank: int, world_size: int, batch: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    apply_sp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    logits, loss, grads = first_step(model, batch)
    return {"loss": loss.full_tensor().item(), "logits": logits.placements,
            "local_logits": tuple(logits.to_local().shape), "grads": grads}


def main(argv: list[str] | None = None) -> None:
    from snippets.dist import spawn

    # No flags: one given by mistake is refused, not silently ignored.
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    world_size = 2
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    _, loss = model(*shift_for_next_token(batch))
    loss.backward()
    ranks = spawn(demo_worker, world_size, batch, timeout_s=120)
    print(f"single device:  loss {loss.item():.6f}")
    for rank, r in enumerate(ranks):
        print(f"DTensor rank {rank}: loss {r['loss']:.6f}, logits {r['logits']}, "
              f"local {r['local_logits']}")
    worst = max((ranks[0]["grads"][n] - p.grad).abs().max().item()
                for n, p in model.named_parameters())
    print(f"largest gradient difference to single device: {worst:.1e}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
