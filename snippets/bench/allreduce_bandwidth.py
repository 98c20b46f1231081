"""Bus bandwidth of the ring all-reduce built from send/recv against dist.all_reduce, by message
size, with 2 and 4 processes on gloo.

For each size the two take turns (ring, library, ring, library, ...) so that a change in the
machine's load hits both; each turn is `measure_all_reduce` (a warm-up call, then `repeats`
timed calls, the slowest rank's time), and we keep the median turn: on a busy machine a few
calls stall for a whole scheduler tick, and the median is the typical call, not the unlucky one.

    python -m snippets.bench.allreduce_bandwidth           # prints a table
    python -m snippets.bench --only allreduce_bandwidth    # the same numbers, into bench.json
"""

import statistics

import torch.distributed as dist

from snippets.dist import spawn
from snippets.scratch.collectives import measure_all_reduce, ring_all_reduce

SIZES_BYTES = [4 * 2**k for k in range(10, 23, 2)]  # 4 KB, 16 KB, ... 16 MB of fp32


def significant(x: float, digits: int = 4) -> float:
    """Round to significant digits: bandwidths here span 0.0001 to 10 GB/s."""
    return float(f"{x:.{digits}g}")


# --8<-- [start:measure]
def bandwidth_by_size(rank, world_size, sizes_bytes, repeats, rounds):
    rows = []
    for size in sizes_bytes:
        numel = size // 4
        turns = {"ring": [], "dist": []}
        for _ in range(rounds):
            turns["ring"].append(measure_all_reduce(ring_all_reduce, numel, repeats))
            turns["dist"].append(measure_all_reduce(dist.all_reduce, numel, repeats))
        row = {"bytes": size}
        for name, results in turns.items():
            seconds = statistics.median(r["seconds"] for r in results)
            algbw = size / seconds / 1e9
            row[name] = {"us": significant(seconds * 1e6), "algbw_GBps": significant(algbw),
                         "busbw_GBps": significant(algbw * 2 * (world_size - 1) / world_size)}
        row["ring_over_dist"] = significant(row["dist"]["us"] / row["ring"]["us"])
        rows.append(row)
    return rows
# --8<-- [end:measure]


def run(world_sizes=(2, 4), sizes_bytes=SIZES_BYTES, repeats: int = 2, rounds: int = 11) -> dict:
    out = {"backend": "gloo", "dtype": "float32", "repeats": repeats, "rounds": rounds}
    for world in world_sizes:
        # Every rank returns the same numbers (measure_all_reduce reports the slowest rank).
        rows = spawn(bandwidth_by_size, world, list(sizes_bytes), repeats, rounds)[0]
        out[f"world_{world}"] = {"ring_factor": round(2 * (world - 1) / world, 3), "sizes": rows}
    return out


def human(size: int) -> str:
    return f"{size // 2**20} MB" if size >= 2**20 else f"{size // 2**10} KB"


def format_table(result: dict) -> str:
    lines = ["bandwidths in GB/s; ring/dist > 1 means our ring was faster"]
    for key, world in result.items():
        if not key.startswith("world_"):
            continue
        n = key.removeprefix("world_")
        lines += [f"{n} ranks on {result['backend']}: busbw = algbw x 2({n}-1)/{n} = algbw x "
                  f"{world['ring_factor']}",
                  f"{'size':>7} {'ring time':>10} {'ring algbw':>11} {'ring busbw':>11} "
                  f"{'dist time':>10} {'dist busbw':>11} {'ring/dist':>10}"]
        for row in world["sizes"]:
            ring, lib = row["ring"], row["dist"]
            lines.append(f"{human(row['bytes']):>7} {ring['us'] / 1e3:>7.2f} ms "
                         f"{ring['algbw_GBps']:>11.4f} {ring['busbw_GBps']:>11.4f} "
                         f"{lib['us'] / 1e3:>7.2f} ms {lib['busbw_GBps']:>11.4f} "
                         f"{row['ring_over_dist']:>9.2f}x")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> None:
    from snippets.flags import Parser, int_at_least

    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int_at_least(1), default=11,
                        help="rounds to take the median over (11, as in `make bench`; fewer for a "
                             "quick, noisier look)")
    print(format_table(run(rounds=parser.parse_args(argv).rounds)))


if __name__ == "__main__":
    main()
