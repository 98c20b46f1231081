"""Lab 2: what DistributedSampler does when the dataset does not divide by the world size.

    python snippets/labs/lab2_samplers.py

Ten examples on four ranks. Every rank must run the same number of steps (a rank that ran out
early would leave the others waiting in an all-reduce forever), so the sampler either pads the
data by repeating examples (drop_last=False, the default) or cuts it to a multiple of the world
size (drop_last=True). Each case is computed with torch's DistributedSampler and with the
course's ShardedSampler (snippets/scratch/sampler.py), which must agree index for index.
"""

from collections import Counter

from torch.utils.data import DistributedSampler

from snippets.scratch.sampler import ShardedSampler


def shards(num_examples: int, world_size: int, epoch: int = 0, **options) -> list[list[int]]:
    """Every rank's indices for one epoch, checked equal between the two samplers."""
    result = []
    for rank in range(world_size):
        theirs = DistributedSampler(range(num_examples), world_size, rank, **options)
        ours = ShardedSampler(num_examples, world_size, rank, **options)
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        if list(ours) != list(theirs):
            raise AssertionError(f"rank {rank}: ShardedSampler {list(ours)} != "
                                 f"DistributedSampler {list(theirs)}")
        result.append(list(theirs))
    return result


def describe(title: str, per_rank: list[list[int]], num_examples: int) -> None:
    seen = Counter(i for shard in per_rank for i in shard)
    print(title)
    for rank, shard in enumerate(per_rank):
        print(f"  rank {rank}: {shard}")
    twice = sorted(i for i, n in seen.items() if n > 1)
    never = sorted(set(range(num_examples)) - set(seen))
    print(f"  {len(per_rank[0])} per rank; seen twice: {twice}; never seen: {never}")


def main() -> None:
    n, world = 10, 4
    describe("drop_last=False, shuffle=False: pad to 12 by repeating from the start",
             shards(n, world, shuffle=False), n)
    describe("drop_last=True, shuffle=False: cut to 8",
             shards(n, world, shuffle=False, drop_last=True), n)
    epoch0 = shards(n, world, shuffle=True, seed=0, epoch=0)
    describe("shuffle=True, seed=0, set_epoch(0)", epoch0, n)
    describe("shuffle=True, seed=0, set_epoch(1): a new permutation",
             shards(n, world, shuffle=True, seed=0, epoch=1), n)
    # A sampler whose set_epoch is never called stays at epoch 0: every epoch repeats it.
    forgetful = DistributedSampler(range(n), world, 0, shuffle=True, seed=0)
    print(f"without set_epoch, rank 0 gets {list(forgetful)} in epoch 0 and "
          f"{list(forgetful)} again in epoch 1")
    print("ShardedSampler == DistributedSampler in every case above")


if __name__ == "__main__":
    main()
