"""Memory, traffic and step time of ZeRO 1, 2 and 3 from scratch against data parallelism
(torch's DistributedDataParallel), on gloo with 2 and 4 processes, the "small" GPT, fp32 AdamW.

For each variant, measured in the same processes:

- model-state bytes per rank: counted from the storages of the parameters, gradients and
  optimizer state the rank holds after a step (snippets.scratch.zero.model_state_bytes), beside
  the paper's formula and their ratio;
- peak bytes per rank: those model-state bytes plus the most bytes allocated at once during one
  step (forward, backward, optimizer step), from the CPU allocator's events recorded by
  torch.profiler;
- bytes sent per rank per step, counted by CommStats (DDP's through a counting communication
  hook), beside the ring formulas;
- step time: variants take turns, one step each per round, and we report the median over rounds
  of each variant's time divided by DDP's in the same round.

    python -m snippets.bench.zero_memory          # prints the tables
    python -m snippets.bench --only zero_memory   # the same numbers, into bench.json

FSDP2 (torch's fully_shard, one unit per block then the root, as snippets/training/fsdp_trainer.py
wraps the model) is measured beside them as the library's ZeRO-3; its traffic is not counted
(its collectives do not go through CommStats), so its "sent" fields are None.

The result holds {"by_world_size": {"2": {variant: row}, "4": {...}}}.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.bench.zero_accounting import (
    expected_model_state_bytes, expected_traffic_bytes, model_state_bytes)
from snippets.scratch.zero import CommStats, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3

ADAMW = dict(lr=1e-3, weight_decay=0.1)
STAGES = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}


# --8<-- [start:variants]
def counting_allreduce_hook(comm: CommStats, bucket):
    """DDP's default all-reduce of a gradient bucket, counted by CommStats."""
    buffer = bucket.buffer()
    comm.count("all_reduce", buffer)
    buffer /= dist.get_world_size()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def build(name: str, config, comm: CommStats):
    """(model to call, plain model, optimizer) for one variant, from the same initial weights."""
    torch.manual_seed(0)
    model = GPT(config)
    if name == "DDP":
        # Gradients as views into DDP's buckets: no second copy, 4 bytes per parameter.
        net = DistributedDataParallel(model, gradient_as_bucket_view=True)
        net.register_comm_hook(comm, counting_allreduce_hook)
        return net, model, torch.optim.AdamW(model.parameters(), **ADAMW)
    if name == "ZeRO-1":
        return model, model, ZeRO1Optimizer(model.parameters(), comm=comm, **ADAMW)
    if name == "ZeRO-2":  # 1 MB buckets: the small GPT's 3.3 MB of gradients in 4 buckets
        return model, model, ZeRO2Optimizer(model.parameters(), comm=comm, bucket_cap_mb=1,
                                            **ADAMW)
    if name == "FSDP2":  # the library's ZeRO-3
        for unit in [*model.layers, model]:
            fully_shard(unit, reshard_after_forward=unit is not model)
        return model, model, torch.optim.AdamW(model.parameters(), **ADAMW)
    net = ZeRO3(model, comm=comm)
    return net, model, torch.optim.AdamW(net.parameters(), **ADAMW)


def local_piece(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
# --8<-- [end:variants]


# --8<-- [start:peak]
def peak_step_bytes(step) -> int:
    """The most bytes allocated at once during step(), beyond what was allocated before it:
    the running sum of the CPU allocator's allocation (+) and free (-) events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
# --8<-- [end:peak]


# --8<-- [start:measure]
def measure_variants(rank, world_size, config_name, seq_len, rounds, warmup=2):
    config = get_config(config_name)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    tokens = torch.randint(0, config.vocab_size, (1, seq_len + 1), generator=g)
    inputs, targets = shift_for_next_token(tokens)
    rows, steps = {}, {}
    for name in STAGES:
        comm = CommStats()
        net, model, optimizer = build(name, config, comm)

        def step(net=net, optimizer=optimizer):
            net(inputs, targets)[1].backward()
            optimizer.step()

        for _ in range(warmup):  # AdamW creates its moments at the first step
            optimizer.zero_grad()
            step()
        comm.reset()
        optimizer.zero_grad()
        peak = peak_step_bytes(step)  # one step: forward, backward, optimizer step
        rows[name] = {"held": model_state_bytes(model, optimizer, local=local_piece),
                      "traffic": None if name == "FSDP2" else dict(comm.bytes),
                      "peak_extra": peak}
        steps[name] = (step, optimizer)
    names = list(STAGES)
    if rounds == 0:  # memory and traffic only
        return rows
    times = torch.zeros(len(names), rounds, dtype=torch.float64)
    for r in range(rounds):
        shift = r % len(names)  # rotate who goes first
        for i in [*range(shift, len(names)), *range(shift)]:
            step, optimizer = steps[names[i]]
            optimizer.zero_grad()
            dist.barrier()
            start = time.perf_counter()
            step()
            times[i, r] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slower rank
    for i, name in enumerate(names):
        rows[name]["step_ms"] = statistics.median(times[i].tolist()) * 1e3
        rows[name]["step_vs_ddp"] = statistics.median((times[i] / times[0]).tolist())
    return rows
# --8<-- [end:measure]


def summarise(rows: dict, num_params: int, world_size: int) -> dict:
    """Add the formulas and ratios to one world size's measured rows."""
    out = {}
    for name, row in rows.items():
        stage = STAGES[name]
        formula = expected_model_state_bytes(stage, num_params, world_size)
        theory = sum(expected_traffic_bytes(stage, num_params, world_size).values())
        ddp_theory = sum(expected_traffic_bytes(0, num_params, world_size).values())
        sent = None if row["traffic"] is None else sum(row["traffic"].values())
        out[name] = {
            "state_bytes": row["held"],
            "state_formula_bytes": {k: round(v) for k, v in formula.items()},
            "state_ratio_to_formula": round(row["held"]["total"] / formula["total"], 4),
            "peak_bytes": row["held"]["total"] + row["peak_extra"],
            "sent_bytes_per_step": sent,
            "sent_by_collective": row["traffic"],
            "sent_theory_bytes": round(theory),
            "sent_ratio_to_theory": None if sent is None else round(sent / theory, 4),
            "sent_theory_vs_ddp": round(theory / ddp_theory, 2),
        }
        if "step_ms" in row:
            out[name]["step_ms"] = round(row["step_ms"], 2)
            out[name]["step_time_vs_ddp"] = round(row["step_vs_ddp"], 3)
    return out


def run(config_name: str = "small", seq_len: int = 128, world_sizes=(2, 4),
        rounds: int = 10) -> dict:
    num_params = GPT(get_config(config_name)).num_parameters()
    result = {"backend": "gloo", "config": config_name, "parameters": num_params,
              "precision": "fp32", "batch_per_rank": f"1 x {seq_len} tokens", "rounds": rounds,
              "by_world_size": {}}
    for n in world_sizes:
        rows = spawn(measure_variants, n, config_name, seq_len, rounds, timeout_s=120)[0]
        result["by_world_size"][str(n)] = summarise(rows, num_params, n)
    return result


def format_tables(result: dict) -> str:
    mb = 2**20
    lines = [f"{result['config']} GPT, {result['parameters']:,} parameters, fp32 AdamW, "
             f"{result['backend']}, {result['batch_per_rank']} per rank"]
    for n, rows in result["by_world_size"].items():
        lines += ["", f"{n} ranks",
                  f"{'variant':<8}{'state MiB':>10}{'formula':>9}{'ratio':>7}{'peak MiB':>9}"
                  f"{'sent MiB':>9}{'theory':>8}{'vs DDP':>8}{'step vs DDP':>13}"]
        for name, row in rows.items():
            sent = row["sent_bytes_per_step"]
            lines.append(
                f"{name:<8}{row['state_bytes']['total'] / mb:>10.2f}"
                f"{row['state_formula_bytes']['total'] / mb:>9.2f}"
                f"{row['state_ratio_to_formula']:>7.3f}{row['peak_bytes'] / mb:>9.2f}"
                f"{'n/a' if sent is None else f'{sent / mb:.2f}':>9}"
                f"{row['sent_theory_bytes'] / mb:>8.2f}"
                f"{row['sent_theory_vs_ddp']:>7.1f}x"
                f"{row.get('step_time_vs_ddp', float('nan')):>12.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_tables(run()))
