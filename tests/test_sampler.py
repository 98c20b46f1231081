"""ShardedSampler from scratch against torch.utils.data.DistributedSampler, index for index."""

import itertools

import pytest
from torch.utils.data import DistributedSampler

from snippets.scratch.sampler import ShardedSampler

pytestmark = pytest.mark.kernel_independent("integer indices")


# --8<-- [start:same-indices]
@pytest.mark.parametrize("dataset_len", [1, 3, 10, 11, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle, drop_last", list(itertools.product([True, False], repeat=2)))
def test_same_indices_as_torch(dataset_len, world_size, shuffle, drop_last):
    dataset = range(dataset_len)
    for rank in range(world_size):
        ours = ShardedSampler(dataset_len, world_size, rank, shuffle=shuffle, seed=7,
                              drop_last=drop_last)
        theirs = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=7,
                                    drop_last=drop_last)
        for epoch in range(3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
            assert len(ours) == len(theirs)
# --8<-- [end:same-indices]


def test_shards_cover_the_dataset_without_overlap_when_divisible():
    shards = [list(ShardedSampler(12, 4, r, seed=1)) for r in range(4)]
    assert sorted(sum(shards, [])) == list(range(12))


def test_padding_repeats_examples_and_set_epoch_reshuffles():
    shards = [list(ShardedSampler(10, 4, r, shuffle=False)) for r in range(4)]
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]  # 0 and 1 seen twice
    sampler = ShardedSampler(100, 2, 0, seed=3)
    first = list(sampler)
    assert list(sampler) == first  # forgot set_epoch: same order again
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_bad_rank_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rank=4 must be in \[0, num_replicas=4\)"):
        ShardedSampler(10, 4, 4)
