"""Benchmarks behind `make bench`.

Each benchmark is a module in this package with a `run() -> dict` function, listed in BENCHMARKS.
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
