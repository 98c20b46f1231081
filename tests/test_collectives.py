"""Ring all-reduce from send/recv equals torch.distributed.all_reduce (gloo, 2 and 4 processes)."""

import pytest
import torch
import torch.distributed as dist

from snippets.dist import spawn
from snippets.scratch.collectives import measure_all_reduce, ring_all_reduce

SIZES = [1, 3, 7, 10, 1000, 2**16 + 1]  # smaller than, not divisible by, and divisible by 2 and 4


# --8<-- [start:ring-equals-library]
def ring_vs_library(rank, world_size):
    out = []
    for numel in SIZES:
        g = torch.Generator().manual_seed(1000 * rank + numel)
        integers = torch.randint(-100, 100, (numel,), generator=g).float()
        floats = torch.randn(numel, generator=g)
        for x in (integers, floats.view(-1, 1)):  # a 2-D tensor is reduced as its flat view
            ours, theirs = x.clone(), x.clone()
            ring_all_reduce(ours)
            dist.all_reduce(theirs)
            out.append((numel, x.dtype, ours, theirs))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    per_rank = spawn(ring_vs_library, world_size)
    for numel, _, ours, theirs in per_rank[0][0::2]:
        # Integer-valued floats: every partial sum is exact in fp32, whatever the order.
        assert torch.equal(ours, theirs), numel
    for numel, _, ours, theirs in per_rank[0][1::2]:
        # Random floats: the ring adds in a different order than gloo, and fp32 addition is not
        # associative, so results agree to rounding (a few ulps of the sum), not bit for bit.
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for other in per_rank[1:]:  # every rank ends with the identical result
        for (_, _, a, _), (_, _, b, _) in zip(per_rank[0], other):
            assert torch.equal(a, b)
# --8<-- [end:ring-equals-library]


# --8<-- [start:busbw-factor]
def bandwidth(rank, world_size):
    return measure_all_reduce(ring_all_reduce, 2**16, repeats=2)


def test_bus_bandwidth_is_algorithm_bandwidth_times_ring_factor():
    a, b, c, d = spawn(bandwidth, 4)
    assert a == b == c == d  # every rank reports the slowest rank's time
    assert a["busbw_GBps"] == pytest.approx(a["algbw_GBps"] * 2 * 3 / 4)
# --8<-- [end:busbw-factor]


def non_contiguous(rank, world_size):
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.zeros(4, 4).t())
    return True


def test_non_contiguous_input_is_refused():
    assert spawn(non_contiguous, 2) == [True, True]
