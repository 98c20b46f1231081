"""The pipeline bubble, measured, against (p-1)/(m+p-1); and a real GPT pipeline's step time
against one process.

Part 1, the bubble. The formula assumes that each stage has a device of its own, so that a
stage's forward takes the same time whatever the other stages are doing. Four processes on two
shared CPU cores break that assumption: when all four compute at once each runs at half speed
or less, and the timeline measures the CPU's sharing, not the schedule. So each stage's compute
here is `FixedTimeLinear`: a forward that does real matrix multiplications until 50 ms of wall
time have passed, and a backward that does the same for 100 ms. It is busy work, not sleep: the
process really occupies a core, so the sends, receives and wake-ups between stages pay their
real cost on a loaded machine. What is measured is then the schedule plus the communication,
the two things the formula is about. Every rank records each op's start and end
(`run_schedule`); per step, bubble = 1 - busy / span for each stage, where the span runs from
the first op to start on any stage to the last op to end; the table shows the mean over the
stages, median over the timed steps.

Part 2, a real model. The small GPT (4 layers, hidden 128) cut into 2 stages on 2 processes
(one core each, one thread each), global batch 8 x 128 tokens, against one process with the
whole model and one thread: the step time of each, and the bubble measured from the real
forwards and backwards. With 4 stages on 2 cores the real-model numbers are oversubscribed,
reported but not comparable to the formula.

    python -m snippets.bench.pipeline_bubble           # prints the tables
    python -m snippets.bench --only pipeline_bubble    # the same numbers, into bench.json
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.pipeline import SCHEDULES, pipeline_train_step, run_schedule, split_into_stages
from snippets.scratch.pipeline_trace import measured_bubble, theoretical_bubble

STAGES, MICRO_BATCHES = (2, 4), (2, 4, 8)
HIDDEN, TOKENS = 64, 16


# --8<-- [start:fixed-time]
def busy_matmuls(seconds: float) -> None:
    """Real arithmetic (64 x 64 matmuls), not sleep, until `seconds` of wall time have passed."""
    a, out = torch.full((64, 64), 1e-3), torch.empty(64, 64)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, a, out=out)


class FixedTimeLinear(torch.autograd.Function):
    """x @ weight, whose forward and backward each hold the CPU for a fixed wall time: a stage
    that behaves as if it had a device of its own."""

    @staticmethod
    def forward(ctx, x, weight, forward_s, backward_s):
        busy_matmuls(forward_s)
        ctx.save_for_backward(x, weight)
        ctx.backward_s = backward_s
        return x @ weight

    @staticmethod
    def backward(ctx, grad):
        busy_matmuls(ctx.backward_s)
        x, weight = ctx.saved_tensors
        grad_weight = x.reshape(-1, x.shape[-1]).T @ grad.reshape(-1, grad.shape[-1])
        return grad @ weight.T, grad_weight, None, None


class FixedTimeStage(nn.Module):
    def __init__(self, hidden: int, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(hidden))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return FixedTimeLinear.apply(x, self.weight, self.forward_s, self.backward_s)
# --8<-- [end:fixed-time]


# --8<-- [start:bubble-worker]
def bubble_worker(rank, world_size, micro_batch_counts, steps, forward_s, backward_s):
    """Per (schedule, m): this stage's trace of every timed step (after one warm-up step)."""
    stage = FixedTimeStage(HIDDEN, forward_s, backward_s)
    shape = (1, TOKENS, HIDDEN)
    traces = {}
    for m in micro_batch_counts:
        for name, schedule in SCHEDULES.items():
            actions = schedule(m, rank, world_size)
            traces[name, m] = []
            for _ in range(1 + steps):
                dist.barrier()
                _, trace = run_schedule(stage, actions, rank, world_size,
                                        [torch.randn(shape) for _ in range(m)], [None] * m,
                                        lambda y, _: y.pow(2).mean(), shape)
                stage.zero_grad(set_to_none=True)
                traces[name, m].append(trace)
            traces[name, m] = traces[name, m][1:]
    return traces
# --8<-- [end:bubble-worker]


def median_bubble(rank_traces: list) -> float:
    """rank_traces[rank][step] -> the median over steps of the mean over stages."""
    steps = range(len(rank_traces[0]))
    return statistics.median(statistics.mean(measured_bubble([t[s] for t in rank_traces]))
                             for s in steps)


def measure_bubbles(steps: int, forward_s: float, backward_s: float) -> list:
    rows = []
    for p in STAGES:
        ranks = spawn(bubble_worker, p, list(MICRO_BATCHES), steps, forward_s, backward_s,
                      timeout_s=120)
        for m in MICRO_BATCHES:
            theory = theoretical_bubble(p, m)
            row = {"stages": p, "micro_batches": m, "theory": round(theory, 4)}
            for name in SCHEDULES:
                bubble = median_bubble([r[name, m] for r in ranks])
                row[name] = round(bubble, 4)
                row[f"{name}_ratio"] = round(bubble / theory, 3)
            # How much longer than asked each op ran (descheduled near its deadline).
            late = [e[3] - e[2] - (forward_s if e[0] == "F" else backward_s)
                    for r in ranks for t in r["1f1b", m] for e in t.events]
            row["op_overrun_ms"] = round(statistics.median(late) * 1e3, 3)
            rows.append(row)
    return rows


# --8<-- [start:gpt-worker]
def gpt_step_worker(rank, world_size, micro_batches, steps, batch_size, seq_len):
    """Step times of the small GPT as a 1F1B pipeline of world_size stages and, in the same
    processes, as one whole model on rank 0 (the other ranks wait): the two take turns, so a
    change in the machine's load hits both. Also the pipeline's per-step traces."""
    config = get_config("small")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g)
    torch.manual_seed(0)
    stage = split_into_stages(GPT(config), world_size)[rank]
    stage_optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3, momentum=0.9)
    whole = GPT(config) if rank == 0 else None
    whole_optimizer = torch.optim.SGD(whole.parameters(), lr=1e-3) if whole else None
    traces = []

    def pipeline_step():
        _, trace = pipeline_train_step(stage, SCHEDULES["1f1b"], tokens, micro_batches, rank,
                                       world_size)
        traces.append(trace)
        stage_optimizer.step()
        stage_optimizer.zero_grad(set_to_none=True)

    def one_process_step():
        if whole is not None:
            whole(*shift_for_next_token(tokens))[1].backward()
            whole_optimizer.step()
            whole_optimizer.zero_grad(set_to_none=True)

    times = torch.zeros(2, 1 + steps, dtype=torch.float64)
    for r in range(1 + steps):  # step 0 is a warm-up
        for i, step in enumerate((pipeline_step, one_process_step)):
            dist.barrier()
            start = time.perf_counter()
            step()
            times[i, r] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {"pipeline_s": times[0, 1:].tolist(), "one_process_s": times[1, 1:].tolist(),
            "traces": traces[1:]}
# --8<-- [end:gpt-worker]


def measure_gpt(steps: int, batch_size: int, seq_len: int) -> list:
    rows = []
    for p in STAGES:
        for m in MICRO_BATCHES:
            ranks = spawn(gpt_step_worker, p, m, steps, batch_size, seq_len, timeout_s=120)
            pipeline_s, one_s = ranks[0]["pipeline_s"], ranks[0]["one_process_s"]
            rows.append({"stages": p, "micro_batches": m,
                         "theory": round(theoretical_bubble(p, m), 4),
                         "1f1b": round(median_bubble([r["traces"] for r in ranks]), 4),
                         "step_ms": round(statistics.median(pipeline_s) * 1e3, 1),
                         "one_process_step_ms": round(statistics.median(one_s) * 1e3, 1),
                         "speedup_vs_one_process": round(statistics.median(
                             o / q for o, q in zip(one_s, pipeline_s)), 3),
                         "ideal_speedup": round(p * m / (m + p - 1), 3)})
    return rows


def run(steps: int = 3, forward_ms: float = 50, backward_ms: float = 100,
        gpt_steps: int = 5, batch_size: int = 8, seq_len: int = 128) -> dict:
    return {
        "backend": "gloo",
        "method": "fixed wall-time busy stages (real matmuls, no sleep); bubble = 1 - busy/span "
                  "per stage, mean over stages, median over steps",
        "forward_ms": forward_ms, "backward_ms": backward_ms, "timed_steps": steps,
        "bubble": measure_bubbles(steps, forward_ms / 1e3, backward_ms / 1e3),
        "gpt": {"config": "small", "batch_size": batch_size, "seq_len": seq_len,
                "timed_steps": gpt_steps, "schedule": "1f1b",
                "pipelines": measure_gpt(gpt_steps, batch_size, seq_len)},
    }


def format_tables(result: dict) -> str:
    lines = [f"Bubble, fixed-time stages (forward {result['forward_ms']:g} ms, backward "
             f"{result['backward_ms']:g} ms of busy matmuls), gloo, median of "
             f"{result['timed_steps']} steps",
             f"{'p':>2}{'m':>3}{'theory':>9}{'1F1B':>9}{'ratio':>8}{'GPipe':>9}{'ratio':>8}"
             f"{'op overrun ms':>15}"]
    for r in result["bubble"]:
        lines.append(f"{r['stages']:>2}{r['micro_batches']:>3}{r['theory']:>9.3f}"
                     f"{r['1f1b']:>9.3f}{r['1f1b_ratio']:>8.2f}{r['gpipe']:>9.3f}"
                     f"{r['gpipe_ratio']:>8.2f}{r['op_overrun_ms']:>15.2f}")
    gpt = result["gpt"]
    lines += ["",
              f"Small GPT (4 layers), batch {gpt['batch_size']} x {gpt['seq_len']} tokens, 1F1B, "
              f"one thread per process, median of {gpt['timed_steps']} steps",
              f"{'p':>2}{'m':>3}{'theory':>9}{'bubble':>9}{'PP ms':>8}{'1-proc ms':>11}"
              f"{'speedup':>9}{'ideal':>8}"]
    for r in gpt["pipelines"]:
        note = "   (4 processes on 2 cores: oversubscribed)" if r["stages"] > 2 else ""
        lines.append(f"{r['stages']:>2}{r['micro_batches']:>3}{r['theory']:>9.3f}"
                     f"{r['1f1b']:>9.3f}{r['step_ms']:>8.1f}{r['one_process_step_ms']:>11.1f}"
                     f"{r['speedup_vs_one_process']:>8.2f}x"
                     f"{r['ideal_speedup']:>7.2f}x{note}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_tables(run()))
