"""Ring attention (snippets/scratch/context_parallel.py) on 2 and then 4 processes, against
`F.scaled_dot_product_attention` on one: the output and the three input gradients, the bytes
each rank sent against the formula, and the scores each rank computed.

    python -m snippets.scratch.context_parallel_check
"""

from __future__ import annotations

import torch

from snippets.scratch.context_parallel import (Ring, RingAttention, causal_scores_per_rank,
                                               ring_bytes_per_rank, shard_sequence,
                                               unshard_sequence)


# --8<-- [start:demo]
def demo_worker(rank: int, world_size: int, q, k, v, d_out) -> dict:
    ring = Ring()
    mine = [shard_sequence(t, rank, world_size).requires_grad_() for t in (q, k, v)]
    out = RingAttention.apply(*mine, ring)
    out.backward(shard_sequence(d_out, rank, world_size))
    return {"out": out.detach(), "grads": [t.grad for t in mine], "sent": dict(ring.bytes_sent),
            "scores": ring.scores["forward"] // (q.shape[0] * q.shape[1])}


def main() -> None:
    import torch.nn.functional as F

    from snippets.dist import spawn

    batch, heads, seq_len, head_dim = 2, 2, 32, 8
    generator = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(batch, heads, seq_len, head_dim, generator=generator)
                      for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(d_out)
    print(f"B={batch} heads={heads} T={seq_len} head_dim={head_dim}, fp32")
    for world_size in (2, 4):
        ranks = spawn(demo_worker, world_size, q, k, v, d_out)
        got = [unshard_sequence([r["out"] for r in ranks]),
               *(unshard_sequence([r["grads"][i] for r in ranks]) for i in range(3))]
        worst = max((a - b).abs().max().item()
                    for a, b in zip(got, [expected, *(t.grad for t in leaves)]))
        print(f"N={world_size}: output, dQ, dK, dV vs one process: max |diff| "
              f"{'< 1e-5' if worst < 1e-5 else f'= {worst:.1e}'}")
        theory = ring_bytes_per_rank(batch, heads, seq_len, head_dim, world_size)
        for phase in ("forward", "backward"):
            sent = sorted({r["sent"].get(phase, 0) for r in ranks})
            print(f"  {phase:8} bytes sent per rank {sent}, formula {theory[phase][1]:,}")
        print(f"  scores computed per rank {[r['scores'] for r in ranks]}; causal pairs needed, "
              f"balanced {causal_scores_per_rank(seq_len, world_size, True)}, contiguous "
              f"{causal_scores_per_rank(seq_len, world_size, False)} (per batch and head)")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
