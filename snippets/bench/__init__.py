"""Benchmarks behind `make bench`, and the measuring demos the pages run.

Each benchmark is a module in this package with a `run() -> dict` function, listed in BENCHMARKS.
The other modules here (pipeline_memory, zero_accounting, zero_check, moe_check,
tensor_parallel_check, three_d_bytes) measure or check one parallelism for its page, beside the
planner's formulas where they need them, and are run by the pages, not by `make bench`.
`python -m snippets.bench` runs them and writes one JSON file with the machine they ran on.
Compare numbers as ratios taken in the same run: absolute times on shared machines are noise.
"""

BENCHMARKS = [
    "snippets.bench.matmul",
    "snippets.bench.train_throughput",
    "snippets.bench.fused",
    "snippets.bench.ddp_step_time",
    "snippets.bench.allreduce_bandwidth",
    "snippets.bench.pipeline_bubble",
    "snippets.bench.zero_memory",
    "snippets.bench.tensor_parallel",
    "snippets.cluster.scaling",
]
