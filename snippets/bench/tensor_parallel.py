"""Tensor parallelism on 2 ranks against one process: step time, and the bytes all-reduced per
step measured against the formula. gloo, the "small" GPT, forward + backward + SGD step.

Variants, all built in the same two processes and timed in turns (one step each per round, the
order rotating), as in ddp_step_time:

- "one process": the whole model on each rank, no communication. Both ranks run it at once with
  one thread each, so it is the single-process step time under the same load as the others.
- "TP from scratch": snippets/scratch/tensor_parallel.py.
- "TP DTensor": snippets/library/tensor_parallel.py, the TorchTitan-style plan.
- "TP DTensor, no PrepareModuleInput": the same plan without the input preparation of the
  attention and the MLP, so every column-parallel layer all-reduces its own input gradient.

Bytes are measured, not computed: a dispatch mode sees every all-reduce op the step issues
(c10d's for the from-scratch layers, the functional collectives DTensor uses) and adds up the
sizes of the tensors handed to it.

    python -m snippets.bench.tensor_parallel            # prints a table
    python -m snippets.bench --only tensor_parallel     # the same numbers, into bench.json
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.library.tensor_parallel import apply_tp
from snippets.scratch.tensor_parallel import all_reduce_bytes_per_step, apply_tensor_parallel

REFERENCE = "one process"


# --8<-- [start:meter]
class AllReduceMeter(TorchDispatchMode):
    """Counts the all-reduce ops dispatched while active, and the bytes of their inputs."""

    ALL_REDUCE_OPS = {torch.ops.c10d.allreduce_.default,  # dist.all_reduce
                      torch.ops._c10d_functional.all_reduce.default}  # DTensor's collectives

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ALL_REDUCE_OPS:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def measure_step(model, inputs, targets) -> dict:
    """All-reduces of one forward and one backward, measured separately."""
    with AllReduceMeter() as forward:
        _, loss = model(inputs, targets)
    with AllReduceMeter() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"forward_calls": forward.calls, "forward_bytes": forward.bytes,
            "backward_calls": backward.calls, "backward_bytes": backward.bytes}
# --8<-- [end:meter]


def build(name: str, config, world_size: int):
    torch.manual_seed(0)
    model = GPT(config)
    if name == "TP from scratch":
        apply_tensor_parallel(model)
    elif name.startswith("TP DTensor"):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        apply_tp(model, mesh, prepare_inputs="no PrepareModuleInput" not in name)
    return model


def time_all_reduces(numel: int, count: int, repeats: int = 5) -> float:
    """Median seconds for `count` back-to-back all-reduces of `numel` fp32 values: the
    communication of one TP step with nothing else running."""
    tensor = torch.randn(numel)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --8<-- [start:timing]
VARIANTS = ["one process", "TP from scratch", "TP DTensor", "TP DTensor, no PrepareModuleInput"]


def time_variants(rank, world_size, config_name, batch_size, seq_len, rounds, warmup):
    config = get_config(config_name)
    g = torch.Generator().manual_seed(0)  # TP: every rank the same batch
    inputs, targets = shift_for_next_token(
        torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g))
    models = {name: build(name, config, world_size) for name in VARIANTS}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    measured = {name: measure_step(models[name], inputs, targets) for name in VARIANTS[1:]}
    # Wall-clock time, and this process's CPU time: on a machine shared with other jobs the
    # scheduler stretches wall time unevenly; CPU time counts only the work this rank did.
    wall = torch.zeros(len(VARIANTS), rounds, dtype=torch.float64)
    cpu = torch.zeros(len(VARIANTS), rounds, dtype=torch.float64)
    for r in range(warmup + rounds):
        shift = r % len(VARIANTS)
        for i in [*range(shift, len(VARIANTS)), *range(shift)]:
            name = VARIANTS[i]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            _, loss = models[name](inputs, targets)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if r >= warmup:
                wall[i, r - warmup] = time.perf_counter() - start
                cpu[i, r - warmup] = time.process_time() - start_cpu
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a step lasts as long as its slower rank
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    medians, ratios = {}, {}
    for kind, times in (("wall", wall), ("cpu", cpu)):
        paired = times / times[VARIANTS.index(REFERENCE)]  # within a round, then the median
        medians[kind] = {n: statistics.median(times[i].tolist()) for i, n in enumerate(VARIANTS)}
        ratios[kind] = {n: statistics.median(paired[i].tolist()) for i, n in enumerate(VARIANTS)}
    theory = all_reduce_bytes_per_step(config, batch_size, seq_len)
    comm_s = time_all_reduces(batch_size * seq_len * config.hidden_size,
                              theory["forward_calls"] + theory["backward_calls"])
    return {"median_s": medians, "ratio": ratios, "measured": measured, "theory": theory,
            "comm_s": comm_s}
# --8<-- [end:timing]


def run(config_name: str = "small", batch_size: int = 4, seq_len: int = 128, rounds: int = 15,
        warmup: int = 2) -> dict:
    config = get_config(config_name)
    world_size = 2
    result = spawn(time_variants, world_size, config_name, batch_size, seq_len, rounds, warmup,
                   timeout_s=120)[0]
    return {
        "backend": "gloo",
        "world_size": world_size,
        "config": config_name,
        "parameters": GPT(config).num_parameters(),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "rounds": rounds,
        "median_step_ms": {n: round(s * 1e3, 2) for n, s in result["median_s"]["wall"].items()},
        "ratio_to_one_process": {n: round(r, 3) for n, r in result["ratio"]["wall"].items()},
        "median_step_cpu_ms": {n: round(s * 1e3, 2)
                               for n, s in result["median_s"]["cpu"].items()},
        "cpu_ratio_to_one_process": {n: round(r, 3) for n, r in result["ratio"]["cpu"].items()},
        "all_reduces_measured": result["measured"],
        "all_reduces_theory": result["theory"],
        "all_reduce_only_ms": round(result["comm_s"] * 1e3, 2),
    }


def format_table(result: dict) -> str:
    lines = [f"{result['config']} GPT ({result['parameters']:,} parameters), "
             f"{result['world_size']} ranks on {result['backend']}, batch "
             f"{result['batch_size']} x {result['seq_len']} tokens (the same on both ranks), "
             f"median of {result['rounds']} steps",
             f"{'variant':<34}{'wall ms':>8}{'ratio':>7}{'CPU ms':>8}{'ratio':>7}"
             f"{'all-reduces fwd+bwd':>21}{'MB':>7}"]
    rows = [(name, result["all_reduces_measured"].get(name)) for name in result["median_step_ms"]]
    for name, m in rows:
        calls = f"{m['forward_calls']}+{m['backward_calls']}" if m else "0"
        mb = f"{(m['forward_bytes'] + m['backward_bytes']) / 1e6:.2f}" if m else "0"
        lines.append(f"{name:<34}{result['median_step_ms'][name]:>8.1f}"
                     f"{result['ratio_to_one_process'][name]:>6.2f}x"
                     f"{result['median_step_cpu_ms'][name]:>8.1f}"
                     f"{result['cpu_ratio_to_one_process'][name]:>6.2f}x{calls:>21}{mb:>7}")
    theory = result["all_reduces_theory"]
    calls = f"{theory['forward_calls']}+{theory['backward_calls']}"
    mb = f"{(theory['forward_bytes'] + theory['backward_bytes']) / 1e6:.2f}"
    lines.append(f"{'theory: 2 per block each way':<64}{calls:>21}{mb:>7}")
    lines.append(f"those {theory['forward_calls'] + theory['backward_calls']} all-reduces alone, "
                 f"back to back: {result['all_reduce_only_ms']:.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run()))
