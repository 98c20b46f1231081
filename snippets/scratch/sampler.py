"""A distributed sampler from scratch: which examples each rank trains on, epoch by epoch.

Every rank builds the same permutation (same seed + epoch, no communication needed), pads or
trims it to a multiple of the world size, and takes every world_size-th index starting at its
rank. Index for index the same as torch.utils.data.DistributedSampler (tests/test_sampler.py).
"""

import math

import torch


# --8<-- [start:sampler]
class ShardedSampler:
    def __init__(self, dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:  # every rank gets the same number: drop the remainder
            self.num_samples = dataset_len // num_replicas
        else:  # every rank gets the same number: repeat examples from the start to fill up
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: without it every epoch repeats the same order."""
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            # Seeded by seed + epoch on every rank: all ranks agree on the permutation.
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            indices = list(range(self.dataset_len))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            padding = self.total_size - len(indices)
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        # Strided, not contiguous, shards: rank r takes positions r, r + N, r + 2N, ...
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
# --8<-- [end:sampler]
