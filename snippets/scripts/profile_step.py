"""Profile a few training steps of the GPT with torch.profiler: where does a step's time go?

    python snippets/scripts/profile_step.py --config small --trace runs/profile/trace.json
    python snippets/scripts/profile_step.py --config small --throughput --steps 8

Each step is split into four labelled phases (data, forward, backward, optimizer) with
``record_function``, so the profile says how the step divides between them as well as which
operators (matmuls, attention, the optimizer's element-wise updates) take the time. The trace
file opens in https://ui.perfetto.dev or chrome://tracing as a timeline of every operator.

``--throughput`` skips the profiler and prints one line per step instead: data time, compute
time and tokens per second, the numbers to watch in a long run. ``--data-delay-ms`` makes the
data loader artificially slow, to show what a data bottleneck looks like in both views.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from snippets.data.dataset import RandomWindowSampler, load_tokens
from snippets.machine import DeviceError, pick_device, set_threads
from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.flags import Parser, float_at_least, int_at_least

PHASES = ("data", "forward", "backward", "optimizer")


# --8<-- [start:train-step]
def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued so far.

    CUDA and MPS run kernels asynchronously: a Python call returns as soon as its kernel is
    queued. Without waiting at the end of a phase, that phase's label would measure how long
    it took to *queue* the work, and the wait would show up in whichever phase first needs a
    result. Waiting removes the CPU/GPU overlap, so use it to attribute time, not to race.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def train_step(model, optimizer, sampler, device: torch.device) -> torch.Tensor:
    """One optimizer step, each phase under a label the profiler reports by name."""
    with record_function("data"):
        batch = sampler.next_batch().to(device)
        inputs, targets = shift_for_next_token(batch)
    with record_function("forward"):
        _, loss = model(inputs, targets)
        synchronize(device)
    with record_function("backward"):
        loss.backward()
        synchronize(device)
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
    return loss.detach()
# --8<-- [end:train-step]


# --8<-- [start:profile]
def profile_training(model, optimizer, sampler, device: torch.device, active_steps: int = 3,
                     record_shapes: bool = False, profile_memory: bool = False,
                     trace_path: str | Path | None = None) -> profile:
    """Run 1 + 1 + active_steps training steps under the profiler; return it."""
    activities = [ProfilerActivity.CPU]  # operators as the CPU dispatches them
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)  # kernel times on the GPU itself (CUPTI)
    # wait=1: run one step unrecorded; it creates AdamW's state and warms the allocator.
    # warmup=1: record one step and throw it away, since the profiler's own start-up lands in
    # it. active: the steps that are kept and reported.
    steps = schedule(wait=1, warmup=1, active=active_steps)
    with profile(activities=activities, schedule=steps, record_shapes=record_shapes,
                 profile_memory=profile_memory) as prof:
        for _ in range(1 + 1 + active_steps):
            train_step(model, optimizer, sampler, device)
            prof.step()  # tells the schedule that a step ended
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return prof
# --8<-- [end:profile]


# --8<-- [start:summary]
def phase_shares(prof: profile) -> dict[str, float]:
    """Fraction of the profiled step time inside each labelled phase.

    The profiler wraps every step in a "ProfilerStep#N" range, averaged here under
    "ProfilerStep*". "other" is what no label covers: the Python between the labels and the
    profiler's own bookkeeping. The shares add up to 1.
    """
    events = {e.key: e for e in prof.key_averages()}
    step_us = events["ProfilerStep*"].cpu_time_total
    shares = {name: events[name].cpu_time_total / step_us for name in PHASES}
    shares["other"] = 1.0 - sum(shares.values())
    return shares


def top_ops(prof: profile, steps: int, n: int = 5, on_device: bool = False) -> list[dict]:
    """The n operators with the most *self* time (their own work, not their callees').

    With on_device (CUDA), operators are ranked by the GPU time of the kernels they launched;
    the kernels' own rows are left out, so each piece of work is counted once.
    """
    events = prof.key_averages()
    step_us = {e.key: e for e in events}["ProfilerStep*"].cpu_time_total
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    ops = [e for e in events if e.device_type == DeviceType.CPU
           and e.key not in PHASES and not e.key.startswith("ProfilerStep")]
    ops.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key, "share": getattr(e, key) / step_us, "calls_per_step": e.count / steps}
            for e in ops[:n]]
# --8<-- [end:summary]


# --8<-- [start:throughput]
class SlowSampler:
    """Wraps a sampler and sleeps before every batch: a stand-in for a loader that reads,
    decompresses or tokenizes on the training process's critical path."""

    def __init__(self, sampler, delay_s: float):
        self.sampler, self.delay_s = sampler, delay_s

    def next_batch(self) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.sampler.next_batch()


def log_throughput(model, optimizer, sampler, device: torch.device, steps: int) -> list[dict]:
    """Print data time, compute time and tokens/s for every step; return the records."""

    def compute():
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    records = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()  # data is CPU work (and a copy): wall-clock time
        inputs, targets = shift_for_next_token(sampler.next_batch().to(device))
        synchronize(device)
        data_ms = 1e3 * (time.perf_counter() - t0)
        loss, compute_ms = device_milliseconds(compute, device)
        record = {"step": step, "loss": loss.item(), "data_ms": data_ms,
                  "compute_ms": compute_ms,
                  "tokens_per_s": inputs.numel() / ((data_ms + compute_ms) / 1e3)}
        records.append(record)
        print(f"step {step:3d} | loss {record['loss']:.3f} | data {data_ms:6.1f} ms | "
              f"compute {compute_ms:6.1f} ms | {record['tokens_per_s']:7,.0f} tokens/s | "
              f"data share {data_ms / (data_ms + compute_ms):4.0%}")
    return records
# --8<-- [end:throughput]


# --8<-- [start:device-time]
def device_milliseconds(fn, device: torch.device):
    """Run fn(); return its result and the milliseconds the device spent on it.

    On CUDA, two events are recorded into the GPU's stream around fn's kernels. The GPU
    timestamps each one when it reaches it, so the CPU never waits between the kernels;
    only elapsed_time() needs the end event to be done. Elsewhere: wall-clock time, after
    waiting for the device (MPS runs asynchronously too).
    """
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, 1e3 * (time.perf_counter() - t0)
# --8<-- [end:device-time]


def build(args: argparse.Namespace):
    """The model, optimizer and data sampler to profile, from the command-line arguments."""
    device = pick_device(args.device)
    config = get_config(args.config)
    context_length = config.max_position_embeddings
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    # AdamW picks its implementation by device: a loop over parameters on CPU and MPS,
    # "foreach" kernels (one launch for all parameters) on CUDA. --adamw forces one.
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[args.adamw]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **impl)
    sampler = RandomWindowSampler(load_tokens(None, context_length=context_length),
                                  args.batch_size, context_length, seed=args.seed)
    if args.data_delay_ms:
        sampler = SlowSampler(sampler, args.data_delay_ms / 1e3)
    return device, config, model, optimizer, sampler


def run(args: argparse.Namespace) -> dict:
    """Profile (or, with --throughput, time) the training steps; print and return a summary."""
    threads = torch.get_num_threads()
    if args.threads:
        set_threads(args.threads, "--threads (0 leaves PyTorch's choice)")
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # leave in-process callers (tests) as they were


def _run(args: argparse.Namespace) -> dict:
    device, config, model, optimizer, sampler = build(args)
    tokens_per_step = args.batch_size * config.max_position_embeddings
    print(f"device {device} | config {args.config} ({model.num_parameters():,} parameters) | "
          f"batch {args.batch_size} x {config.max_position_embeddings} tokens | "
          f"{torch.get_num_threads()} CPU thread(s) | AdamW {args.adamw}")
    if args.throughput:
        records = log_throughput(model, optimizer, sampler, device, args.steps)
        return {"throughput": records}

    if device.type == "mps":
        print("note: on MPS the profiler sees only the CPU side of each operator (the time to "
              "encode its Metal kernel); the labelled phases include GPU time because each "
              "phase ends with torch.mps.synchronize()")
    prof = profile_training(model, optimizer, sampler, device, args.steps,
                            record_shapes=args.record_shapes, profile_memory=args.profile_memory,
                            trace_path=args.trace)
    on_device = device.type == "cuda"
    if args.profile_memory:
        sort_by = "self_cuda_memory_usage" if on_device else "self_cpu_memory_usage"
    else:
        sort_by = "self_cuda_time_total" if on_device else "self_cpu_time_total"
    averages = prof.key_averages(group_by_input_shape=args.record_shapes)
    print(averages.table(sort_by=sort_by, row_limit=args.row_limit, max_name_column_width=64))

    step_ms = {e.key: e for e in prof.key_averages()}["ProfilerStep*"].cpu_time_total / 1e3
    step_ms /= args.steps
    shares = phase_shares(prof)
    ops = top_ops(prof, args.steps, 5, on_device=on_device)
    print(f"{args.steps} profiled steps: {step_ms:.1f} ms per step, "
          f"{tokens_per_step / step_ms * 1e3:,.0f} tokens/s (with the profiler's overhead)")
    print("share of step time: " + " | ".join(f"{k} {v:.1%}" for k, v in shares.items()))
    measure = "the GPU time of their kernels" if on_device else "self CPU time"
    print(f"top operators by {measure}, as a share of step time:")
    for op in ops:
        print(f"  {op['share']:6.1%}  {op['name']}  ({op['calls_per_step']:g} calls/step)")
    if device.type == "cuda":  # the caching allocator's high-water mark over the whole run
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated(device) / 2**20:,.1f}"
              f" MiB")
    elif device.type == "mps":
        print(f"MPS memory now: {torch.mps.current_allocated_memory() / 2**20:,.1f} MiB in "
              f"tensors, {torch.mps.driver_allocated_memory() / 2**20:,.1f} MiB from the driver")
    if args.trace:
        size_mb = Path(args.trace).stat().st_size / 1e6
        print(f"wrote {args.trace} ({size_mb:.1f} MB): open it in https://ui.perfetto.dev "
              "or chrome://tracing")
    return {"step_ms": step_ms, "shares": shares, "top_ops": ops}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="small", help="model config: tiny|small|medium|...")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--steps", type=int_at_least(1), default=3,
                   help="steps to profile (after 1 skipped and 1 warm-up step), or to log "
                        "with --throughput")
    p.add_flag("batch-size", type=int_at_least(1), default=8, help="sequences per step")
    p.add_argument("--threads", type=int_at_least(0), default=1,
                   help="CPU threads for PyTorch, as in train_tiny_transformer.py; "
                        "0 = PyTorch's own choice")
    p.add_argument("--adamw", default="default", choices=["default", "foreach", "fused"],
                   help="AdamW implementation; default lets PyTorch choose by device")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--row-limit", type=int_at_least(1), default=12, help="rows of the operator table")
    p.add_argument("--record-shapes", action="store_true",
                   help="record input shapes and group the table by them")
    p.add_argument("--profile-memory", action="store_true",
                   help="record allocations and sort the table by memory")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome trace (JSON) of the profiled steps to PATH")
    p.add_argument("--throughput", action="store_true",
                   help="no profiler: print data time, compute time and tokens/s per step")
    p.add_argument("--data-delay-ms", type=float_at_least(0), default=0.0,
                   help="sleep this long before every batch: simulates a slow data loader")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except (DeviceError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
