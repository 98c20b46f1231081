"""Which examples each process loads: Accelerate's prepared DataLoader beside
torch.utils.data.DistributedSampler and the course's ShardedSampler.

    python snippets/library/accelerate_sharding.py
    python snippets/library/accelerate_sharding.py --examples 10 --batch-size 2 --processes 3

`accelerator.prepare(loader)` calls `accelerate.data_loader.prepare_data_loader` with the
launch's process count and this process's index. Called with each index in turn, it shows every
process's share from one process, without launching anything.
"""

import argparse

from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, DistributedSampler

from snippets.scratch.sampler import ShardedSampler
from snippets.flags import Parser, int_at_least


# --8<-- [start:shards]
def accelerate_shards(examples: int, batch_size: int, processes: int, **options) -> list[list]:
    """Each process's batches from a plain, unshuffled DataLoader prepared by Accelerate."""
    loader = DataLoader(list(range(examples)), batch_size=batch_size)
    return [[batch.tolist() for batch in prepare_data_loader(loader, num_processes=processes,
                                                            process_index=index, **options)]
            for index in range(processes)]


def sampler_shards(make_sampler, examples: int, batch_size: int, processes: int) -> list[list]:
    """Each rank's batches from a DataLoader with its own sampler, make_sampler(rank)."""
    return [[batch.tolist() for batch in DataLoader(list(range(examples)), batch_size=batch_size,
                                                    sampler=make_sampler(rank))]
            for rank in range(processes)]
# --8<-- [end:shards]


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--examples", type=int_at_least(1), default=10)
    p.add_argument("--batch-size", type=int_at_least(1), default=2)
    p.add_argument("--processes", type=int_at_least(1), default=2)
    args = p.parse_args(argv)
    examples, batch_size, processes = args.examples, args.batch_size, args.processes
    rows = {
        "accelerate (default)": accelerate_shards(examples, batch_size, processes),
        "accelerate even_batches=False": accelerate_shards(examples, batch_size, processes,
                                                           even_batches=False),
        "DistributedSampler": sampler_shards(
            lambda rank: DistributedSampler(range(examples), processes, rank, shuffle=False),
            examples, batch_size, processes),
        "ShardedSampler (scratch)": sampler_shards(
            lambda rank: ShardedSampler(examples, processes, rank, shuffle=False),
            examples, batch_size, processes),
    }
    if batch_size % processes == 0:  # split_batches cuts every batch into one piece per process
        rows["accelerate split_batches=True"] = accelerate_shards(examples, batch_size, processes,
                                                                  split_batches=True)
    print(f"{examples} examples, batch size {batch_size}, {processes} processes")
    print(f"{'':31}" + "".join(f"{f'process {p}':27}" for p in range(processes)).rstrip())
    for name, shards in rows.items():
        cells = [" ".join(str(batch) for batch in shard) for shard in shards]
        print(f"{name:31}" + "".join(f"{cell:27}" for cell in cells).rstrip())


if __name__ == "__main__":
    main()
