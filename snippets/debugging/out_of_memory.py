"""Out of memory: estimate before the run, then shrink what runs out.

    python -m snippets.debugging.out_of_memory [--config small] [--repeats 3]

A CPU does not run out of memory the way a GPU does (it swaps, or the kernel kills the process
much later), so this reproduces the *diagnosis* instead: the model state from a formula, the
activations measured by counting what autograd saves, and what the two usual cures, a smaller
micro-batch and activation checkpointing, do to the measured activation bytes and to the time
of a forward and backward pass.
"""

from __future__ import annotations


import torch

from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.planner.memory import measure_activation_bytes, model_state_bytes
from snippets.flags import Parser, int_at_least
from snippets.scripts.precision_and_accumulation import median_seconds
from snippets.machine import set_threads

MiB = 2**20


# --8<-- [start:estimate]
def estimate(config_name: str, micro_batch: int, checkpointing: bool,
             precision: str = "fp32") -> dict:
    """Bytes one rank needs for a training step: model state by formula (weights, gradients,
    AdamW moments) plus the activations of one micro-batch, measured on a real forward pass."""
    config = get_config(config_name, gradient_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = GPT(config).train()  # checkpointing only applies in training mode
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.max_position_embeddings + 1))
    inputs, targets = shift_for_next_token(tokens)
    state = model_state_bytes(model.num_parameters(), precision)["total"]
    activations = measure_activation_bytes(model, inputs, targets)
    return {"micro_batch": micro_batch, "checkpointing": checkpointing,
            "model_state": state, "activations": activations, "total": state + activations}
# --8<-- [end:estimate]


# --8<-- [start:checkpointing-cost]
def checkpointing_cost(config_name: str, micro_batch: int, repeats: int = 5) -> dict:
    """Median seconds of one forward + backward with and without activation checkpointing,
    interleaved round by round, and the largest gradient difference between the two."""
    models, grads = {}, {}
    config = get_config(config_name)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.max_position_embeddings + 1))
    inputs, targets = shift_for_next_token(tokens)
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same weights in both models
        models[checkpointing] = GPT(get_config(config_name, gradient_checkpointing=checkpointing))

    def step(checkpointing: bool):
        model = models[checkpointing]
        model.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        grads[checkpointing] = [p.grad for p in model.parameters()]

    seconds = median_seconds({"plain": lambda: step(False), "checkpointed": lambda: step(True)},
                             repeats=repeats)
    difference = max((a - b).abs().max().item() for a, b in zip(grads[False], grads[True]))
    return {"plain_s": seconds["plain"], "checkpointed_s": seconds["checkpointed"],
            "slowdown": seconds["checkpointed"] / seconds["plain"],
            "max_grad_difference": difference}
# --8<-- [end:checkpointing-cost]


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--micro-batches", type=int_at_least(1), nargs="+", default=[8, 4, 2])
    parser.add_argument("--repeats", type=int_at_least(1), default=3)
    args = parser.parse_args(argv)
    try:
        get_config(args.config)
    except ConfigError as err:
        parser.error(f"argument --config: {err}")
    set_threads(1, "the timings compare variants in one process; one thread is steadier")

    print(f"{args.config} GPT, fp32 + AdamW, one rank: bytes for one training step")
    print(f"{'micro-batch':>11} {'checkpointing':>13} {'model state':>12} {'activations':>12} "
          f"{'total':>10}")
    rows = [estimate(args.config, b, ckpt) for b in args.micro_batches for ckpt in (False, True)]
    for r in rows:
        print(f"{r['micro_batch']:>11} {'on' if r['checkpointing'] else 'off':>13} "
              f"{r['model_state'] / MiB:>8.1f} MiB {r['activations'] / MiB:>8.1f} MiB "
              f"{r['total'] / MiB:>6.1f} MiB")
    first = {r["checkpointing"]: r["activations"] for r in rows[:2]}
    print(f"activations at micro-batch {args.micro_batches[0]}: checkpointing keeps "
          f"{first[True] / first[False]:.2f}x of them")

    cost = checkpointing_cost(args.config, args.micro_batches[0], args.repeats)
    print(f"forward + backward at micro-batch {args.micro_batches[0]} (median of {args.repeats}): "
          f"{1e3 * cost['plain_s']:.0f} ms plain, {1e3 * cost['checkpointed_s']:.0f} ms "
          f"checkpointed, {cost['slowdown']:.2f}x the time")
    print(f"largest gradient difference, checkpointed vs plain: {cost['max_grad_difference']:.1e}")


if __name__ == "__main__":
    main()
