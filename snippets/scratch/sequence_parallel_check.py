"""Sequence parallelism (snippets/scratch/sequence_parallel.py) on 2 processes against one:

    python -m snippets.scratch.sequence_parallel_check

The loss, the logits' shape (each rank's own tokens), the first norm's gradient, and the
collectives each rank issued in one step beside the formula. tests/test_sequence_parallel.py
holds the same numbers to their bounds.
"""

from __future__ import annotations

import torch

from snippets.models.gpt import GPT, get_config
from snippets.scratch.sequence_parallel import apply_sequence_parallel, collective_payloads_per_step


# --8<-- [start:demo]
def demo_worker(rank: int, world_size: int, tokens: torch.Tensor) -> dict:
    torch.manual_seed(0)  # the same initial weights as the single-device model below
    model = GPT(get_config("tiny"))
    stats = apply_sequence_parallel(model)
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return {"loss": loss.item(), "logits": tuple(logits.shape),
            "norm_grad": model.layers[0].input_layernorm.weight.grad, "stats": stats}


def main(world_size: int = 2) -> None:
    from snippets.dist import spawn

    config = get_config("tiny")  # hidden 64, 4 heads, intermediate 172, 2 blocks
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (4, 33), generator=generator)
    torch.manual_seed(0)
    model = GPT(config)
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ranks = spawn(demo_worker, world_size, tokens)
    print(f"single device: loss {loss.item():.6f}, logits {tuple(logits.shape)}")
    for rank, r in enumerate(ranks):
        print(f"SP rank {rank}:     loss {r['loss']:.6f}, logits {r['logits']} (its tokens)")
    norm_grad = model.layers[0].input_layernorm.weight.grad
    print(f"first norm's gradient, rank 0 vs single device: max difference "
          f"{(ranks[0]['norm_grad'] - norm_grad).abs().max().item():.1e}")
    stats, theory = ranks[0]["stats"], collective_payloads_per_step(config, 4, 32)
    for key in sorted(stats.calls):
        formula = "formula {} calls, {:,} bytes".format(*theory[key]) if key in theory else ""
        print(f"{key[0]:8} {key[1]:14} {stats.calls[key]} calls, {stats.payload[key]:7,} bytes  "
              f"{formula}".rstrip())
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
