"""Ring all-reduce from point-to-point messages: the algorithm NCCL uses for large all-reduces
(it picks trees and others where they are faster).

Each of N ranks talks only to its two ring neighbours. The tensor is cut into N chunks;
a reduce-scatter pass (N-1 steps) leaves each rank with the full sum of one chunk, and an
all-gather pass (N-1 steps) passes the finished chunks around the ring. Every step sends 1/N of
the tensor, so each rank sends 2(N-1)/N of its size in total, whatever N is: that is why the ring
is bandwidth-optimal, and why `bus bandwidth = algorithm bandwidth x 2(N-1)/N`.

Run: torchrun --nproc_per_node=4 snippets/scratch/collectives.py
"""

import time

import torch
import torch.distributed as dist


# --8<-- [start:ring-all-reduce]
def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place, with a ring of send/recv. Returns `tensor`.

    Every rank of the default process group calls it at once, with a contiguous tensor of the
    same shape and dtype; its size need not divide by the world size. Only point-to-point
    messages between ring neighbours (rank r sends to r + 1 and receives from r - 1, mod the
    world size: dist.isend, dist.send, dist.irecv, dist.recv), never a collective: 2(world - 1)
    sends of one chunk, about 1/world of the tensor, each. No rank may block on a message that
    no rank is sending yet.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return tensor
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor; pass t.contiguous()")
    # tensor_split allows sizes that do not divide by world: chunks differ by at most one element.
    chunks = list(tensor.view(-1).tensor_split(world))  # views: writing them writes the tensor
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(send_index: int, recv_index: int) -> torch.Tensor:
        received = torch.empty_like(chunks[recv_index])
        # isend, not send: if every rank blocked in send first, no one would be receiving.
        request = dist.isend(chunks[send_index], right)
        dist.recv(received, left)
        request.wait()
        return received

    # Reduce-scatter: at step s, pass chunk (rank - s) right and add the chunk arriving from the
    # left into our copy. After N-1 steps chunk (rank + 1) % N holds the sum over all ranks.
    for step in range(world - 1):
        send_index, recv_index = (rank - step) % world, (rank - step - 1) % world
        chunks[recv_index] += exchange(send_index, recv_index)

    # All-gather: pass the finished chunks around the ring, overwriting stale partial sums.
    for step in range(world - 1):
        send_index, recv_index = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv_index].copy_(exchange(send_index, recv_index))
    return tensor
# --8<-- [end:ring-all-reduce]


# --8<-- [start:bandwidth]
def measure_all_reduce(all_reduce, numel: int, repeats: int = 5) -> dict:
    """Time an all-reduce of `numel` fp32 values; report algorithm and bus bandwidth in GB/s.

    algorithm bandwidth = bytes / time: what the caller sees.
    bus bandwidth = algorithm bandwidth x 2(N-1)/N: the traffic each rank's link actually
    carried, comparable across world sizes and with the link's rated speed.
    """
    world = dist.get_world_size()
    tensor = torch.ones(numel)
    all_reduce(tensor)  # warm-up: connections, buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        all_reduce(tensor)
    seconds = (time.perf_counter() - start) / repeats
    # Every rank must report the same time, so take the slowest rank's.
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = slowest.item()
    algorithm = numel * 4 / seconds / 1e9
    return {"bytes": numel * 4, "seconds": seconds, "algbw_GBps": algorithm,
            "busbw_GBps": algorithm * 2 * (world - 1) / world}
# --8<-- [end:bandwidth]


def main() -> None:
    from snippets.dist import init_from_env, leave_process_group

    env = init_from_env("gloo")
    rank, world = env["rank"], env["world_size"]
    # Check against the library's all-reduce on a size that does not divide by the world size.
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    expected = x.clone()
    dist.all_reduce(expected)
    ring_all_reduce(x)
    if rank == 0:
        print(f"{world} ranks, 10 elements: ring {x.tolist()}")
        print(f"{world} ranks, 10 elements: dist {expected.tolist()}  equal: {torch.equal(x, expected)}")
        print(f"{'size':>10} {'ring busbw':>12} {'dist busbw':>12}  (GB/s, gloo on this machine)")
    for numel in (2**14, 2**18, 2**22):
        ours = measure_all_reduce(ring_all_reduce, numel)
        theirs = measure_all_reduce(dist.all_reduce, numel)
        if rank == 0:
            print(f"{numel * 4 / 2**20:>8.2f}MB {ours['busbw_GBps']:>12.3f} {theirs['busbw_GBps']:>12.3f}")
    leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
