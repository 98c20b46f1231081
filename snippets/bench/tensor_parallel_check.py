"""Run the tensor parallelism of snippets/scratch/tensor_parallel.py: the tiny GPT split over 2
processes against the whole model in one, with the all-reduces counted beside the formula.

    python -m snippets.bench.tensor_parallel_check

tests/test_tensor_parallel.py makes the same comparison on 2 and 4 ranks, over 3 training steps.
"""

import torch

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config
from snippets.scratch.tensor_parallel import all_reduce_bytes_per_step, apply_tensor_parallel


# --8<-- [start:demo]
def demo_worker(rank: int, world_size: int, tokens: torch.Tensor) -> dict:
    torch.manual_seed(0)  # the same initial weights as the single-device model below
    model = GPT(get_config("tiny"))
    stats = apply_tensor_parallel(model)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    q = model.layers[0].self_attn.q_proj.weight
    return {"loss": loss.item(), "q_shard": tuple(q.shape), "q_grad": q.grad,
            "stats": stats}


def main(world_size: int = 2) -> None:
    config = get_config("tiny")  # hidden 64, 4 heads, intermediate 172, 2 blocks
    tokens = torch.randint(0, config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = GPT(config)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ranks = spawn(demo_worker, world_size, tokens)
    q_grad = torch.cat([r["q_grad"] for r in ranks], dim=0)  # the row blocks, stacked back
    q_full = model.layers[0].self_attn.q_proj.weight
    print(f"single device: loss {loss.item():.6f}, q_proj weight {tuple(q_full.shape)}")
    for rank, r in enumerate(ranks):
        print(f"TP rank {rank}:     loss {r['loss']:.6f}, q_proj weight {r['q_shard']}")
    print(f"q_proj gradient, TP shards stacked vs single device: max difference "
          f"{(q_grad - q_full.grad).abs().max().item():.1e}")
    theory = all_reduce_bytes_per_step(config, batch_size=4, seq_len=32)
    s = ranks[0]["stats"]
    print(f"all-reduces per step: forward {s.forward_calls} ({s.forward_bytes:,} bytes), "
          f"backward {s.backward_calls} ({s.backward_bytes:,} bytes)")
    print(f"theory, 2 per block each way of B*T*hidden*4 bytes: forward "
          f"{theory['forward_calls']} ({theory['forward_bytes']:,} bytes), backward "
          f"{theory['backward_calls']} ({theory['backward_bytes']:,} bytes)")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
