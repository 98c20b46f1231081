"""Check of exercise 17: ShardedSampler (sampler.py)."""

from __future__ import annotations

from types import ModuleType

from snippets.exercises.runner import CheckFailed


SAMPLER_CASES = (  # (dataset_len, num_replicas, shuffle, seed, drop_last)
    (10, 4, True, 0, False), (10, 4, True, 3, True), (12, 4, True, 0, False),
    (10, 4, False, 0, False), (7, 3, False, 0, True),
)


def _sampler_orders(cls, n, replicas, shuffle, seed, drop_last, epoch) -> list[list[int]]:
    orders = []
    for rank in range(replicas):
        sampler = cls(n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                      drop_last=drop_last)
        sampler.set_epoch(epoch)
        orders.append([int(i) for i in sampler])
    return orders


def _torch_orders(n, replicas, shuffle, seed, drop_last, epoch) -> list[list[int]]:
    from torch.utils.data import DistributedSampler

    def make(dataset_len, num_replicas, rank, shuffle, seed, drop_last):
        return DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
    return _sampler_orders(make, n, replicas, shuffle, seed, drop_last, epoch)


def check_sampler(learner: ModuleType) -> list[str]:
    cls = learner.ShardedSampler
    for n, replicas, shuffle, seed, drop_last in SAMPLER_CASES:
        setting = (f"{n} examples on {replicas} ranks (shuffle={shuffle}, seed={seed}, "
                   f"drop_last={drop_last})")
        for epoch in (0, 1):
            got = _sampler_orders(cls, n, replicas, shuffle, seed, drop_last, epoch)
            want = _torch_orders(n, replicas, shuffle, seed, drop_last, epoch)
            if got == want:
                continue
            where = f"with {setting}, epoch {epoch}"
            sizes = [len(o) for o in got]
            if len(set(sizes)) > 1:
                raise CheckFailed(
                    f"{where}, the ranks got different numbers of examples ({sizes}): a rank "
                    "with fewer batches leaves its epoch early while the others wait for it in "
                    "the gradient all-reduce, forever. Give every rank ceil(n / replicas) by "
                    "repeating indices from the start (or n // replicas with drop_last)")
            counted = [len(cls(n, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)) for r in range(replicas)]
            if counted != sizes:
                raise CheckFailed(f"{where}, len(sampler) is {counted[0]} but it yields "
                                  f"{sizes[0]} indices: __len__ must say how many it yields")
            if sizes != [len(o) for o in want]:
                raise CheckFailed(
                    f"{where}, each rank got {sizes[0]} examples; expected {len(want[0])}: "
                    + ("drop_last=True drops the remainder, n // replicas each" if drop_last
                       else "drop_last=False pads to ceil(n / replicas) each, so no example "
                            "is lost"))
            seen = [i for o in got for i in o]
            if not drop_last and set(seen) != set(range(n)):
                lost = sorted(set(range(n)) - set(seen))
                same = "seed + rank: every rank must build the SAME permutation (seed + epoch)"
                raise CheckFailed(
                    f"{where}, examples {lost} are never seen while others go to several "
                    f"ranks: the ranks do not split one permutation. Did you seed with {same}?"
                    if shuffle else f"{where}, examples {lost} are never seen")
            if shuffle and epoch == 1 and got == _sampler_orders(cls, n, replicas, shuffle,
                                                                 seed, drop_last, 0):
                raise CheckFailed(f"{where} repeats epoch 0's order: set_epoch has no effect. "
                                  "Seed the generator with self.seed + self.epoch")
            order = [i for group in zip(*want) for i in group]  # the global order, strided
            blocks = [order[r * sizes[0]:(r + 1) * sizes[0]] for r in range(replicas)]
            if got == blocks:
                raise CheckFailed(
                    f"{where}, rank 0 got {got[0]}, a contiguous block of the permutation; "
                    f"DistributedSampler strides: rank r takes positions r, r + {replicas}, "
                    f"r + {2 * replicas}, ... (indices[rank::num_replicas]), so rank 0 gets "
                    f"{want[0]}")
            if not shuffle:
                raise CheckFailed(f"{where}, rank 0 got {got[0]}; expected {want[0]}: "
                                  "shuffle=False keeps the order 0, 1, 2, ...")
            raise CheckFailed(
                f"{where}, rank 0 got {got[0]}; DistributedSampler gives {want[0]}. The "
                "permutation is torch.randperm(n, generator=torch.Generator()."
                "manual_seed(seed + epoch)), padded or trimmed, then strided")
    return [f"index for index the same as DistributedSampler in {len(SAMPLER_CASES)} settings "
            "and 2 epochs: shuffled or not, padded or dropped, strided over the ranks",
            "every rank gets the same number of examples; set_epoch reshuffles"]
