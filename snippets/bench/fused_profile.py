"""Eager against fused (snippets/models/fused.py) on one training step, and where the time goes.

Trains the small GPT both ways on the same batch, interleaved (median_seconds, one thread),
then profiles three steps of each with torch.profiler:

    python -m snippets.bench.fused_profile
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from snippets.machine import cpu_model, set_threads
from snippets.models.fused import fuse
from snippets.models.gpt import GPT, get_config, shift_for_next_token
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
    with torch.no_grad():
        difference = (models["eager"](inputs)[0] - models["fused"](inputs)[0]).abs().max()
    optimizers = {label: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
                  for label, m in models.items()}
    steps = {label: (lambda m=m, o=optimizers[label]: training_step(m, o, inputs, targets))
             for label, m in models.items()}
    seconds = median_seconds(steps, repeats=repeats, warmup=1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread")
    print(f"{config_name} GPT, batch {batch_size} x {config.max_position_embeddings} tokens, "
          f"largest logit difference {difference:.1e}")
    print(f"training step (forward + backward + AdamW), median of {repeats}: "
          f"eager {1e3 * seconds['eager']:.1f} ms, fused {1e3 * seconds['fused']:.1f} ms, "
          f"fused at {seconds['eager'] / seconds['fused']:.2f}x eager's speed")
    for label, model in models.items():
        print(f"\n{label}: busiest operators of 3 steps (torch.profiler, share of self time)")
        for name, calls, share in operator_table(model, optimizers[label], inputs, targets):
            print(f"  {name:<58} {calls:>4} calls/step {share:>6.1%}")


if __name__ == "__main__":
    main()
