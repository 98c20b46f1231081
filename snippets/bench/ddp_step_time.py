"""Step time of DDP from scratch (naive, bucketed, overlapped) against torch's
DistributedDataParallel: 2 processes on gloo, the "small" GPT, forward + backward + gradient
synchronisation + SGD step.

Every variant lives in the same two processes and they take turns, one step each per round (the
order rotating every round), so a slowdown of the shared machine hits all of them alike. Each
step starts after a barrier; its time is the slower rank's. We report each variant's median step
time and the median, over rounds, of its ratio to torch DDP (default 25 MB buckets) in the same
round. "local (no sync)" is the same step with no communication at all: the floor every DDP is
measured against (its replicas drift apart, so it is a timing reference, not a way to train).

    python -m snippets.bench.ddp_step_time            # prints a table
    python -m snippets.bench --only ddp_step_time     # the same numbers, into bench.json
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.ddp import BucketedDDP, NaiveDDP, OverlappedDDP, make_buckets

REFERENCE = "torch DDP 25MB"

# --8<-- [start:variants]
# name -> function wrapping a model. 25 MB is both libraries' default bucket size and holds the
# whole 3.15 MB gradient of the small GPT in one bucket. 1 MB gives several buckets (four of ours,
# three of torch's: it closes a bucket once it passes the cap, we before), so an overlapped DDP
# can start communicating before backward ends.
VARIANTS = {
    "local (no sync)": lambda m: m,
    "naive": NaiveDDP,
    "bucketed 25MB": lambda m: BucketedDDP(m, bucket_cap_mb=25),
    "bucketed 1MB": lambda m: BucketedDDP(m, bucket_cap_mb=1),
    "overlapped 25MB": lambda m: OverlappedDDP(m, bucket_cap_mb=25),
    "overlapped 1MB": lambda m: OverlappedDDP(m, bucket_cap_mb=1),
    "torch DDP 25MB": lambda m: DistributedDataParallel(m, bucket_cap_mb=25),
    "torch DDP 1MB": lambda m: DistributedDataParallel(m, bucket_cap_mb=1),
}


def make_step(name, config, inputs, targets):
    """One variant's model, wrapper and optimizer, and a function doing one training step."""
    torch.manual_seed(0)
    model = GPT(config)
    ddp = VARIANTS[name](model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    # Naive and bucketed DDP average after backward; overlapped and torch's do it inside it.
    sync = ddp.sync_gradients if isinstance(ddp, (NaiveDDP, BucketedDDP)) else (lambda: None)

    def step():
        _, loss = ddp(inputs, targets)
        loss.backward()
        sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return ddp, step
# --8<-- [end:variants]


def all_reduces_per_step(wrapped) -> int:
    """How many all-reduces one step sends: one per parameter, one per bucket, or none."""
    if isinstance(wrapped, NaiveDDP):
        return sum(1 for p in wrapped.parameters() if p.requires_grad)
    if isinstance(wrapped, (BucketedDDP, OverlappedDDP)):
        return len(wrapped.buckets)
    if isinstance(wrapped, DistributedDataParallel):  # its buckets, as rebuilt after step 1
        data = wrapped._get_ddp_logging_data()
        return len(data.get("rebuilt_bucket_sizes", data["bucket_sizes"]).split(","))
    return 0


def copy_time(config, inputs, targets, bucket_cap_mb: float, repeats: int = 20) -> float:
    """Median seconds our buckets spend per step copying gradients in (pack) and out (unpack).
    torch's DDP makes the same two copies by default; gradient_as_bucket_view=True avoids them."""
    torch.manual_seed(0)
    model = GPT(config)
    model(inputs, targets)[1].backward()
    buckets = make_buckets(model, bucket_cap_mb)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for bucket in buckets:
            bucket.pack()
            bucket.unpack(1.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --8<-- [start:timing]
def time_variants(rank, world_size, config_name, batch_size, seq_len, rounds, warmup):
    config = get_config(config_name)
    g = torch.Generator().manual_seed(rank)  # each rank its own data, as in real training
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g)
    inputs, targets = shift_for_next_token(tokens)
    names = list(VARIANTS)
    wrapped, steps = {}, {}
    for name in names:
        wrapped[name], steps[name] = make_step(name, config, inputs, targets)
    times = torch.zeros(len(names), rounds, dtype=torch.float64)
    for r in range(warmup + rounds):
        shift = r % len(names)  # rotate who goes first, so no variant always follows the same one
        for i in [*range(shift, len(names)), *range(shift)]:
            dist.barrier()  # both ranks start the step together
            start = time.perf_counter()
            steps[names[i]]()
            if r >= warmup:
                times[i, r - warmup] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slower rank
    # Ratios within a round, then their median: a paired comparison, so drift in the machine's
    # load between rounds cancels out.
    ratios = times / times[names.index(REFERENCE)]
    medians = {name: statistics.median(times[i].tolist()) for i, name in enumerate(names)}
    ratio = {name: statistics.median(ratios[i].tolist()) for i, name in enumerate(names)}
    copies = {f"{cap}MB": copy_time(config, inputs, targets, cap) for cap in (25, 1)}
    return {"median_s": medians, "ratio": ratio, "copy_s": copies,
            "messages": {name: all_reduces_per_step(w) for name, w in wrapped.items()}}
# --8<-- [end:timing]


def run(config_name: str = "small", batch_size: int = 1, seq_len: int | None = None,
        rounds: int = 30, warmup: int = 2) -> dict:
    """batch_size sequences of seq_len tokens (default: the full context) per rank. One sequence
    keeps the step short, so that communication is a visible share of it, as on fast GPUs."""
    config = get_config(config_name)
    seq_len = seq_len or config.max_position_embeddings
    world_size = 2
    result = spawn(time_variants, world_size, config_name, batch_size, seq_len, rounds, warmup)[0]
    medians = result["median_s"]
    params = sum(p.numel() for p in GPT(config).parameters())
    return {
        "backend": "gloo",
        "world_size": world_size,
        "config": config_name,
        "parameters": params,
        "gradient_MB": round(params * 4 / 2**20, 2),
        "batch_size_per_rank": batch_size,
        "seq_len": seq_len,
        "rounds": rounds,
        "all_reduces_per_step": result["messages"],
        "median_step_ms": {name: round(s * 1e3, 2) for name, s in medians.items()},
        "ratio_to_torch_ddp": {name: round(r, 3) for name, r in result["ratio"].items()},
        "bucket_copy_ms": {cap: round(s * 1e3, 3) for cap, s in result["copy_s"].items()},
    }


def format_table(result: dict) -> str:
    lines = [f"{result['config']} GPT ({result['parameters']:,} parameters, "
             f"{result['gradient_MB']} MiB of fp32 gradients), {result['world_size']} ranks on "
             f"{result['backend']}, batch {result['batch_size_per_rank']} x "
             f"{result['seq_len']} tokens per rank, median of {result['rounds']} steps",
             f"{'variant':<18}{'all-reduces':>12}{'step ms':>10}{'vs torch DDP':>14}"]
    for name, ms in result["median_step_ms"].items():
        messages = result["all_reduces_per_step"][name]
        lines.append(f"{name:<18}{messages:>12}{ms:>10.1f}"
                     f"{result['ratio_to_torch_ddp'][name]:>13.2f}x")
    copies = ", ".join(f"{ms:.2f} ms ({cap} buckets)"
                       for cap, ms in result["bucket_copy_ms"].items())
    lines.append(f"copying gradients into our buckets and back, per step: {copies}")
    return "\n".join(lines)


def main(argv=None) -> None:
    from snippets.flags import Parser, int_at_least

    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int_at_least(1), default=30,
                        help="rounds to take the median over (30, as in `make bench`; fewer for a "
                             "quick, noisier look)")
    print(format_table(run(rounds=parser.parse_args(argv).rounds)))


if __name__ == "__main__":
    main()
