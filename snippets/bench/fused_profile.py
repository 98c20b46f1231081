"""Eager against fused (snippets/models/fused.py) on one training step, and where the time goes.

Trains the small GPT both ways, and the nanoGPT-shaped model of the same FLOPs per token
(snippets/models/nanogpt.py), on the same batch, interleaved (median_seconds, one thread). For
each it prints the CPU time of a step, the minor page faults in it (getrusage; Linux and macOS)
and the step's fixed cost: its time at a batch of 1 x 4 tokens, where the arithmetic is
negligible and what is left is Python, dispatch and autograd. Then it profiles three steps of
eager and fused with torch.profiler:

    python -m snippets.bench.fused_profile
"""

from __future__ import annotations

import resource

import torch
from torch.profiler import ProfilerActivity, profile

from snippets.machine import cpu_model, set_threads
from snippets.models.fused import fuse
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.models.nanogpt import NanoGPT, matched_to
from snippets.scripts.precision_and_accumulation import median_seconds


def training_step(model, optimizer, inputs, targets) -> None:
    _, loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def operator_table(model, optimizer, inputs, targets, steps: int = 3,
                   rows: int = 8) -> list[tuple]:
    """(operator, calls per step, share of the time) of the busiest operators of a few
    training steps.

    The profiler times operators by the wall clock, so on a busy machine another process's
    turn on the core lands in whichever operator was running. Shares of the total are less
    disturbed than milliseconds: the interruptions fall on each operator about in proportion
    to its time."""
    training_step(model, optimizer, inputs, targets)  # warm-up, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            training_step(model, optimizer, inputs, targets)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.count // steps, e.self_cpu_time_total / total) for e in events[:rows]]


def costs_per_step(steps: dict, repeats: int) -> dict:
    """{name: (CPU ms, minor page faults)} per step, medians of interleaved rounds.

    A minor page fault is the kernel handing the process a page of memory, on the first touch
    of memory the C library has just taken from the kernel: for instance because it gave it back
    at the end of the previous step. The kernel zeroes and maps each page, in system time, which
    process CPU time includes."""
    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu = median_seconds(steps, repeats=repeats, warmup=1)
    faulted = median_seconds(steps, repeats=repeats, warmup=1, clock=faults)
    return {name: (1e3 * cpu[name], faulted[name]) for name in steps}


def main(config_name: str = "small", batch_size: int = 8, repeats: int = 5) -> None:
    set_threads(1, "the profile compares operators, not parallel speed-up")
    config = get_config(config_name)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.max_position_embeddings + 1))
    inputs, targets = shift_for_next_token(tokens)
    models = {}
    for label in ("eager", "fused"):
        torch.manual_seed(0)
        models[label] = GPT(config) if label == "eager" else fuse(GPT(config))
    models["nanoGPT"] = NanoGPT(matched_to(config))
    with torch.no_grad():
        difference = (models["eager"](inputs)[0] - models["fused"](inputs)[0]).abs().max()
    optimizers = {label: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
                  for label, m in models.items()}

    def steps_on(batch_inputs, batch_targets):
        return {label: (lambda m=m, o=optimizers[label]:
                        training_step(m, o, batch_inputs, batch_targets))
                for label, m in models.items()}
    costs = costs_per_step(steps_on(inputs, targets), repeats)
    fixed = median_seconds(steps_on(inputs[:1, :4], targets[:1, :4]), repeats=5 * repeats,
                           warmup=1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread")
    print(f"{config_name} GPT, batch {batch_size} x {config.max_position_embeddings} tokens, "
          f"largest logit difference {difference:.1e}")
    print(f"training step (forward + backward + AdamW), median of {repeats}:")
    print(f"  {'':<8} {'CPU ms':>8} {'page faults':>12} {'fixed ms':>9}")
    for label, (cpu_ms, faults) in costs.items():
        print(f"  {label:<8} {cpu_ms:>8.1f} {faults:>12.0f} {1e3 * fixed[label]:>9.1f}")
    print(f"  (fixed: the same step at batch 1 x 4 tokens, median of {5 * repeats})")
    print(f"fused at {costs['eager'][0] / costs['fused'][0]:.2f}x eager's speed, "
          f"{costs['nanoGPT'][0] / costs['fused'][0]:.2f}x nanoGPT's (equal FLOPs per token)")
    for label in ("eager", "fused"):
        print(f"\n{label}: busiest operators of 3 steps (torch.profiler, share of self time)")
        rows = operator_table(models[label], optimizers[label], inputs, targets)
        for name, calls, share in rows:
            print(f"  {name:<58} {calls:>4} calls/step {share:>6.1%}")


if __name__ == "__main__":
    main()
