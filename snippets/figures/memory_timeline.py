"""Live tensor memory over one training step of the tiny GPT: plain, and with activation
checkpointing.

What is measured. `LiveTensorMemory`, the pipeline page's counter (snippets/bench/
pipeline_memory.py), sees every operator of the step, backward, recomputation and optimizer
included, and keeps the bytes of the tensor storages they created that are still alive. Added to
it are the storages that existed before the step: the weights, AdamW's two moments and the batch.
The step is sampled at hooks: after every module's forward (again when checkpointing recomputes a
block during backward), when each parameter's gradient has been accumulated (an autograd hook),
after the optimizer step, and once the step is over. The values are byte counts, not times: the
same on every run and on any machine with the pinned torch, so the test compares the figure byte
for byte with the committed SVG.

    python -m snippets.figures.memory_timeline           # the summary
    python -m snippets.figures.memory_timeline --write   # and regenerate the committed SVG
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from snippets.bench.pipeline_memory import LiveTensorMemory
from snippets.figures import svg
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.flags import Parser
from snippets.machine import set_threads

NAME = "memory-timeline"
CONFIG, BATCH_SIZE = "tiny", 8  # sequences of the config's full context
VARIANTS = {"plain": False, "checkpointed": True}  # gradient_checkpointing


@dataclass(frozen=True)
class Sample:
    phase: str  # "forward", "backward" or "optimizer"
    where: str  # the hook that took it: a module, a parameter's gradient, a step boundary
    live: int  # bytes of live tensor storage


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under these tensors (views share one)."""
    sizes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


# --8<-- [start:timeline]
@lru_cache(maxsize=None)
def timeline(gradient_checkpointing: bool) -> tuple[Sample, ...]:
    """Live tensor bytes at every hook of one AdamW training step (after a warm-up step)."""
    torch.manual_seed(0)
    model = GPT(get_config(CONFIG, gradient_checkpointing=gradient_checkpointing))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    context = model.config.max_position_embeddings
    tokens = torch.randint(0, model.config.vocab_size, (BATCH_SIZE, context + 1))
    phase = "forward"

    def train_step():
        nonlocal phase
        phase = "forward"
        _, loss = model(*shift_for_next_token(tokens))
        phase = "backward"
        loss.backward()
        phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # creates AdamW's moments: the step measured below is like every later one
    moments = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    before = storage_bytes([*model.parameters(), *model.buffers(), *moments, tokens])
    memory, samples, phase = LiveTensorMemory(), [], "forward"

    def sample(where: str) -> None:
        if phase == "backward" and not where.startswith("grad"):
            where = f"recompute {where}"  # a forward hook, run again by checkpoint()
        samples.append(Sample(phase, where, before + memory.live))

    handles = [module.register_forward_hook(lambda *_, name=name or "GPT": sample(name))
               for name, module in model.named_modules()]
    handles += [p.register_post_accumulate_grad_hook(lambda _, name=name: sample(f"grad {name}"))
                for name, p in model.named_parameters()]
    handles.append(optimizer.register_step_post_hook(lambda *_: sample("optimizer.step()")))
    try:
        with memory:
            sample("step starts")
            train_step()  # its locals (logits, loss) are gone when it returns
            sample("step ends")
    finally:
        for handle in handles:
            handle.remove()
    return tuple(samples)
# --8<-- [end:timeline]


def summary() -> str:
    runs = {name: timeline(flag) for name, flag in VARIANTS.items()}
    width = max(len(n) for n in runs) + 2
    lines = [f"One training step of the {CONFIG} GPT, {BATCH_SIZE} sequences of "
             f"{get_config(CONFIG).max_position_embeddings} tokens: live tensor memory, bytes",
             f"{'':<{width}}{'start':>12}{'peak':>12}{'end':>12}  samples  peak at"]
    for name, samples in runs.items():
        peak = max(samples, key=lambda s: s.live)
        lines.append(f"{name:<{width}}{samples[0].live:>12,}{peak.live:>12,}"
                     f"{samples[-1].live:>12,}  {len(samples):>7}  {peak.where}")
    plain, ckpt = (max(s.live for s in runs[n]) for n in VARIANTS)
    lines.append(f"checkpointing saves {plain - ckpt:,} bytes of peak "
                 f"({(plain - ckpt) / 2**20:.2f} MiB of {plain / 2**20:.2f} MiB)")
    return "\n".join(lines)


# Drawing: one panel per variant, on the same scales, so the two curves compare directly.
LEFT, RIGHT, TOP, PANEL_H, GAP, UNIT = 78, 24, 30, 150, 62, 9
PHASE_FILL = {"forward": "#dbe9f6", "backward": "#fde4cf", "optimizer": "#e6e6e6"}
LINE = "#1f4e79"
TITLES = {"plain": "plain: every activation kept from forward to backward",
          "checkpointed": "activation checkpointing: each block's insides recomputed in backward"}


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _panel(y0: float, name: str, samples, top_bytes: float) -> list[str]:
    def x(i):
        return LEFT + i * UNIT

    def y(v):
        return y0 + PANEL_H - v / top_bytes * PANEL_H

    body = [svg.text(LEFT, y0 - 14, TITLES[name], size=14, anchor="start", weight="bold")]
    start = 0  # phase bands: a run of samples of one phase, from its first sample to its last
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].phase != samples[start].phase:
            x0, x1 = x(start) - UNIT / 2, x(i - 1) + UNIT / 2
            body.append(svg.rect(x0, y0, x1 - x0, PANEL_H, fill=PHASE_FILL[samples[start].phase],
                                 stroke="none", stroke_width=0))
            label = "opt." if samples[start].phase == "optimizer" else samples[start].phase
            body.append(svg.text((x0 + x1) / 2, y0 + PANEL_H - 10, label, size=11,
                                 fill="#444444"))
            start = i
    step = 2**20 if top_bytes > 2 * 2**20 else 2**18
    for k in range(int(top_bytes // step) + 1):  # the y axis, in MiB
        v = k * step
        body.append(svg.line(LEFT - 4, y(v), LEFT + (len(samples) - 1) * UNIT, y(v),
                             stroke="#cccccc", width=0.5))
        body.append(svg.text(LEFT - 7, y(v), f"{v / 2**20:g}", size=11, anchor="end"))
    points = " ".join(f"{svg.num(x(i))},{svg.num(y(s.live))}" for i, s in enumerate(samples))
    body.append(f'<polyline points="{points}" fill="none" stroke="{LINE}" stroke-width="2"/>')
    for i, s in enumerate(samples):  # recomputation: forward hooks that ran during backward
        if s.where.startswith("recompute"):
            body.append(f'<circle cx="{svg.num(x(i))}" cy="{svg.num(y(s.live))}" r="2.5" '
                        f'fill="#c0392b"/>')
    i_peak = max(range(len(samples)), key=lambda i: samples[i].live)
    peak = samples[i_peak].live
    body.append(svg.line(LEFT, y(peak), LEFT + (len(samples) - 1) * UNIT, y(peak),
                         stroke="#c0392b", width=1, extra=' stroke-dasharray="4 3"'))
    label = f"peak {peak:,} bytes ({mib(peak)})"
    right = x(i_peak) + 8 + 7 * len(label) < x(len(samples) - 1)  # room on the right?
    body.append(svg.text(x(i_peak) + (8 if right else -8), y(peak) - 9, label, size=12,
                         anchor="start" if right else "end", fill="#c0392b", weight="bold"))
    body.append(svg.line(LEFT, y0 + PANEL_H, LEFT + (len(samples) - 1) * UNIT, y0 + PANEL_H))
    return body


def render() -> str:
    runs = {name: timeline(flag) for name, flag in VARIANTS.items()}
    most = max(len(s) for s in runs.values())
    top = max(s.live for samples in runs.values() for s in samples) * 1.12
    width = LEFT + (most - 1) * UNIT + RIGHT
    body, y0 = [], TOP
    for name, samples in runs.items():
        body += _panel(y0, name, samples, top)
        mid = svg.num(y0 + PANEL_H / 2)  # the y axis's label, turned to run along it
        body.append(f'<text x="{LEFT - 36}" y="{mid}" font-size="12" text-anchor="middle" '
                    f'dominant-baseline="middle" fill="#111111" '
                    f'transform="rotate(-90 {LEFT - 36} {mid})">MiB live</text>')
        y0 += PANEL_H + GAP
    y_axis = y0 - GAP + 18
    body.append(svg.text(LEFT, y_axis, "sample points in order, not time: module forwards, "
                         "gradients, the optimizer step (opt.)", size=12,
                         anchor="start"))
    body.append(f'<circle cx="{LEFT + 5}" cy="{svg.num(y_axis + 20)}" r="3" fill="#c0392b"/>')
    body.append(svg.text(LEFT + 14, y_axis + 20, "a forward hook run again in backward: the "
                         "block's activations recomputed", size=12, anchor="start"))
    height = y_axis + 36
    plain, ckpt = runs["plain"], runs["checkpointed"]
    p_plain, p_ckpt = max(s.live for s in plain), max(s.live for s in ckpt)
    desc = (f"Two line charts of the live tensor memory during one AdamW training step of the "
            f"course's {CONFIG} GPT on {BATCH_SIZE} sequences, sampled at every module forward "
            f"hook and every gradient hook. Plain: memory rises through the forward pass as each "
            f"layer keeps its activations, from {mib(plain[0].live)} to a peak of "
            f"{mib(p_plain)} ({p_plain:,} bytes) when the loss is computed, then falls through "
            f"backward as activations are freed, while gradients appear; the optimizer step "
            f"and zero_grad bring it back to {mib(plain[-1].live)}. Activation checkpointing: "
            f"forward keeps only each block's input, so memory rises much less; in backward "
            f"each block's forward runs again (marked points) and its activations come back "
            f"briefly, one block at a time. Its peak is {mib(p_ckpt)} ({p_ckpt:,} bytes), "
            f"{len(ckpt) - len(plain)} more sample points for the recomputed modules.")
    return svg.document(width, height, "Live tensor memory over one training step, plain and "
                        "with activation checkpointing", desc, body)


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"also write docs/assets/figures/{NAME}.svg")
    args = parser.parse_args(argv)
    set_threads(1, "byte counts do not depend on threads; start-up time does")
    print(summary())
    if args.write:
        print(f"wrote {svg.write(NAME, render())}")


if __name__ == "__main__":
    main()
