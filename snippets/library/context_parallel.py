"""Context parallelism with PyTorch's own ring attention, on CPU.

The public API, torch.distributed.tensor.experimental.context_parallel, patches
F.scaled_dot_product_attention so that it runs on DTensors sharded along the sequence, and
hands the SDPA kernels it knows (flash, memory-efficient, cuDNN: all CUDA kernels) to its ring
implementation. On CPU, SDPA calls aten._scaled_dot_product_flash_attention_for_cpu, which it
does not know, and DTensor has no sharding rule for it: `public_api_error` shows the error.

The ring itself (_templated_ring_attention and its backward, in
torch/distributed/tensor/experimental/_context_parallel/_attention.py) takes the attention
kernel as an argument, and the CPU flash kernel and its backward have the keyword arguments it
passes. Called with them, below the public API, the library's ring runs on gloo:
`library_ring_attention` does that, on this rank's shard in the same head-tail layout as
snippets/scratch/context_parallel.py.

    python -m snippets.library.context_parallel    # both, on 2 ranks
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from snippets.flags import Parser

aten = torch.ops.aten


# --8<-- [start:public-api]
def public_api_error(q, k, v) -> str:
    """Run causal SDPA under context_parallel on a 1-D CPU mesh; the error it raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = q.clone(), k.clone(), v.clone()  # context_parallel shards its buffers in place
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
# --8<-- [end:public-api]


# --8<-- [start:ring]
def library_ring_attention(q, k, v, d_out, group=None):
    """PyTorch's ring attention forward and backward on this rank's shard (head-tail layout,
    sequence dimension 2), with the CPU flash kernels: (out, dq, dk, dv)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options,
        _templated_ring_attention,
        _templated_ring_attention_backward,
    )

    # The defaults, stated: chunks r and 2N-1-r; K/V rotated by one all-gather, not send/recv.
    assert _cp_options.enable_load_balance and _cp_options.rotate_method.name == "ALL_GATHER"
    group = group or dist.group.WORLD
    out, lse = _templated_ring_attention(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, is_causal=True)
    d_q, d_k, d_v = _templated_ring_attention_backward(
        group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=d_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out,
        logsumexp=lse, is_causal=True, dropout_p=0.0)[:3]
    return out, d_q, d_k, d_v
# --8<-- [end:ring]


def demo_worker(rank: int, world_size: int, q, k, v, d_out) -> dict:
    from snippets.scratch.context_parallel import shard_sequence

    mine = [shard_sequence(t, rank, world_size) for t in (q, k, v, d_out)]
    return {"error": public_api_error(q, k, v), "ring": library_ring_attention(*mine)}


def main(argv: list[str] | None = None) -> None:
    from snippets.dist import spawn
    from snippets.scratch.context_parallel import unshard_sequence

    # No flags: one given by mistake is refused, not silently ignored.
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    world_size = 2
    generator = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(2, 2, 32, 8, generator=generator) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    expected.backward(d_out)
    ranks = spawn(demo_worker, world_size, q, k, v, d_out)
    print(f"context_parallel on CPU: {ranks[0]['error']}")
    got = [unshard_sequence([r["ring"][i] for r in ranks]) for i in range(4)]
    worst = max((a - b).abs().max().item()
                for a, b in zip(got, [expected, *(t.grad for t in leaves)]))
    print(f"_templated_ring_attention with the CPU flash kernels, {world_size} ranks: output and "
          f"dQ, dK, dV vs one process: max |diff| {'< 1e-5' if worst < 1e-5 else f'= {worst:.1e}'}")


if __name__ == "__main__":
    main()
