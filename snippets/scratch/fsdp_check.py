"""Watch FSDP from scratch (snippets/scratch/fsdp.py) take training steps on 2 processes:

    python -m snippets.scratch.fsdp_check            # what rank 0 holds; the order of one step
    python -m snippets.scratch.fsdp_check --times    # + when each event happened, prefetch on/off

The order of events on a rank is fixed by the program; the times are not (they depend on the
machine and its load), so only the first form prints the same thing on every run.
"""

import statistics
import time

import torch

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, RMSNorm, get_config, shift_for_next_token
from snippets.scratch.fsdp import FSDP, MixedPrecision
from snippets.flags import Parser

STEPS, GLOBAL_BATCH, SEQ = 4, 8, 32
SHOWN = ["embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight",
         "layers.0.self_attn.q_proj.weight", "layers.0.mlp.up_proj.weight",
         "layers.0.mlp.down_proj.weight"]


# --8<-- [start:check]
def train_steps(rank, world_size, prefetch):
    """A few AdamW steps; returns what rank 0 holds after the last backward, and the timeline
    (seconds since the step began, event, unit) of every step."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            fp32_modules=(RMSNorm,))
    fsdp = FSDP(model, mp=policy, replicate_below=100, prefetch=prefetch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timelines = []
    for batch in random_token_batches(STEPS, GLOBAL_BATCH, SEQ):
        fsdp.timeline, start = [], time.perf_counter()
        inputs, targets = shift_for_next_token(batch.chunk(world_size)[rank])
        model(inputs, targets)[1].backward()
        held = {n: (shapes[n], p.numel(), p.dtype, p.grad.numel())
                for n, p in model.named_parameters()}
        fsdp.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        timelines.append([(t - start, event, unit) for t, event, unit in fsdp.timeline])
    return held, timelines


def main(times: bool, world_size: int = 2):
    print(f"tiny GPT on {world_size} ranks: bf16 compute, fp32 gradient sums, RMSNorm weights "
          "in fp32, parameters under 100 elements replicated")
    held, timelines = spawn(train_steps, world_size, True)[0]  # rank 0's view
    print("\nrank 0 after backward: each parameter holds its shard, .grad its gradient")
    print(f"{'parameter':<34}{'full shape':>12}{'held':>16}{'dtype':>9}{'.grad':>8}")
    for name in SHOWN:
        shape, numel, dtype, grad = held[name]
        full = torch.Size(shape).numel()
        print(f"{name:<34}{str(shape):>12}{f'{numel:,} of {full:,}':>16}"
              f"{str(dtype).removeprefix('torch.'):>9}{grad:>8,}")
    off = spawn(train_steps, world_size, False)[0][1] if times else None
    print("\nthe last step on rank 0, prefetch on" + (" (ms since the step began; the same "
                                                     "step with prefetch off)" if times else ""))
    for i, (t, event, unit) in enumerate(timelines[-1]):
        when = f"{1e3 * t:8.2f}" if times else ""
        print(f"{i + 1:>3} {event:<19}{unit:<10}{when}".rstrip())
    if times:
        for t, event, unit in off[-1]:
            print(f"    {event:<19}{unit:<10}{'':8}{1e3 * t:8.2f}")
        for label, runs in (("on", timelines), ("off", off)):
            waits = [sum(t - w for (w, e, _), (t, *_) in zip(steps, steps[1:]) if e == "wait")
                     for steps in runs[1:]]  # the first step also warms up
            print(f"waiting for all-gathers, prefetch {label}: median "
                  f"{1e3 * statistics.median(waits):.2f} ms per step")
# --8<-- [end:check]


if __name__ == "__main__":
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", action="store_true", help="print when each event happened")
    main(parser.parse_args().times)
