"""One data-parallel step three ways: naive, bucketed, overlapped (the three DDPs of Week 1).

What is real here: the order in which backward produces the gradients of the course's `small`
GPT (recorded with the same post-accumulate-grad hooks that `OverlappedDDP` uses) and the buckets
`snippets.scratch.ddp.make_buckets` forms from them at a 1 MB cap. What is a model: time. A
tensor's gradient takes time in proportion to its size, and an all-reduce costs a fixed start-up
plus a time in proportion to its bytes; the network carries one all-reduce at a time. The
constants below are chosen to make the shapes readable, not measured: the measured step times
are in the table further down the DDP page.
"""

from __future__ import annotations

import torch

from snippets.figures import svg
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.ddp import make_buckets

NAME = "ddp-overlap"
CONFIG, BUCKET_CAP_MB = "small", 1
BACKWARD_UNITS = 60.0      # the whole backward pass
BYTES_UNITS = 24.0         # sending every gradient once, start-ups aside
STARTUP_UNITS = 1.0        # fixed cost of one all-reduce
STEP_UNITS = 4.0           # the optimizer step


def gradient_order():
    """Parameters in the order backward finishes their gradients, with their sizes, and buckets."""
    torch.manual_seed(0)
    model = GPT(get_config(CONFIG))
    names = {id(p): n for n, p in model.named_parameters()}
    order = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: order.append(id(p)))
               for p in model.parameters()]
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    inputs, targets = shift_for_next_token(tokens)
    model(inputs, targets)[1].backward()
    for h in handles:
        h.remove()
    sizes = {id(p): p.numel() for p in model.parameters()}
    bucket_of = {}
    for b, bucket in enumerate(make_buckets(model, BUCKET_CAP_MB)):
        for p in bucket.params:
            bucket_of[id(p)] = b
    return [(names[i], sizes[i], bucket_of[i]) for i in order]


def timelines():
    """For each variant: backward end, the all-reduces [(start, end, label)], and step end."""
    grads = gradient_order()
    total = sum(n for _, n, _ in grads)
    ready, t = [], 0.0
    for name, n, b in grads:  # when each gradient is done
        t += BACKWARD_UNITS * n / total
        ready.append((t, name, n, b))
    bw_end = t

    def send(queue):  # queue of (earliest start, numel, label): one at a time on the link
        out, free = [], 0.0
        for earliest, n, label in queue:
            start = max(free, earliest)
            free = start + STARTUP_UNITS + BYTES_UNITS * n / total
            out.append((start, free, label))
        return out

    buckets = {}
    for t, _, n, b in ready:
        last, size = buckets.get(b, (0.0, 0))
        buckets[b] = (max(last, t), size + n)
    result = {
        "naive": send([(bw_end, n, "") for _, _, n, _ in ready]),
        "bucketed": send([(bw_end, size, f"b{b}") for b, (_, size) in sorted(buckets.items())]),
        "overlapped": send(sorted((t, size, f"b{b}") for b, (t, size) in buckets.items())),
    }
    return bw_end, result, len(grads), len(buckets)


UNIT, LEFT, LANE, GAP = 7, 90, 26, 30
COMPUTE, NET = "#dbe9f6", "#1f4e79"


def render() -> str:
    bw_end, result, n_params, n_buckets = timelines()
    ends = {k: max(bw_end, v[-1][1]) + STEP_UNITS for k, v in result.items()}
    span = max(ends.values())
    width = LEFT + span * UNIT + 130
    body, y = [], 14
    titles = {"naive": f"naive: {n_params} all-reduces, one per tensor, after backward",
              "bucketed": (f"bucketed: {n_buckets} all-reduces of about {BUCKET_CAP_MB} MB, "
                           "after backward"),
              "overlapped": f"overlapped: each bucket sent as soon as its last gradient is ready"}
    for kind in ("naive", "bucketed", "overlapped"):
        sends = result[kind]
        comm_end = sends[-1][1]
        body.append(svg.text(LEFT, y, titles[kind], size=15, anchor="start", weight="bold"))
        yc, yn = y + 14, y + 14 + LANE + 4
        body.append(svg.text(LEFT - 10, yc + LANE / 2, "compute", size=13, anchor="end"))
        body.append(svg.text(LEFT - 10, yn + LANE / 2, "network", size=13, anchor="end"))
        body.append(svg.rect(LEFT, yc, bw_end * UNIT, LANE, fill=COMPUTE))
        body.append(svg.text(LEFT + bw_end * UNIT / 2, yc + LANE / 2 + 1,
                             "backward (last layer first)", size=13))
        if comm_end > bw_end:  # the compute lane waits for the network
            body.append(svg.rect(LEFT + bw_end * UNIT, yc, (comm_end - bw_end) * UNIT, LANE,
                                 fill="url(#wait)", stroke="#999999"))
            if (comm_end - bw_end) * UNIT > 60:
                body.append(svg.text(LEFT + (bw_end + comm_end) / 2 * UNIT, yc + LANE / 2 + 1,
                                     "waits", size=12, weight="bold"))
        step_x = LEFT + max(bw_end, comm_end) * UNIT
        body.append(svg.rect(step_x, yc, STEP_UNITS * UNIT, LANE, fill="#ffffff"))
        body.append(svg.text(step_x + STEP_UNITS * UNIT / 2, yc + LANE / 2 + 1, "opt", size=12))
        for start, end, label in sends:
            body.append(svg.rect(LEFT + start * UNIT, yn, (end - start) * UNIT, LANE, fill=NET,
                                 stroke="#ffffff", stroke_width=1))
            if label:
                body.append(svg.text(LEFT + (start + end) / 2 * UNIT, yn + LANE / 2 + 1, label,
                                     size=12, weight="bold", fill="#ffffff"))
        end_x = LEFT + ends[kind] * UNIT
        body.append(svg.line(end_x, yc - 4, end_x, yn + LANE + 4, stroke="#c0392b", width=2,
                             extra=' stroke-dasharray="4 3"'))
        body.append(svg.text(end_x + 4, yn + LANE + 12, f"step ends: {ends[kind]:.0f}",
                             size=12, anchor="start", fill="#c0392b"))
        y = yn + LANE + GAP + 10
    body.append(svg.rect(LEFT, y - 6, 30, 18, fill="url(#wait)", stroke="#999999"))
    body.append(svg.text(LEFT + 38, y + 3, "compute idle, waiting for the all-reduces.  "
                         "Time in model units, not measured.", size=12, anchor="start"))
    height = y + 20
    desc = (f"Three timelines of one data-parallel step of the course's {CONFIG} GPT, with a "
            f"compute lane and a network lane each. Naive: backward runs, then {n_params} small "
            f"all-reduces follow one another while compute waits, each paying a start-up cost. "
            f"Bucketed: after backward, {n_buckets} larger all-reduces, fewer start-ups, a shorter "
            f"wait. Overlapped: each bucket's all-reduce starts during backward, as soon as its "
            f"last gradient is ready, so only the last bucket is left after backward ends. Step "
            f"lengths in model units: naive {ends['naive']:.0f}, bucketed {ends['bucketed']:.0f}, "
            f"overlapped {ends['overlapped']:.0f}.")
    return svg.document(width, height, "Naive, bucketed and overlapped gradient all-reduce",
                        desc, body, defs=[svg.hatch_pattern("wait")])


if __name__ == "__main__":
    print(f"wrote {svg.write(NAME, render())}")
