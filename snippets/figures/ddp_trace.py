"""A measured trace of one data-parallel step on 2 gloo ranks: naive against overlapped.

Each rank runs one forward and backward of the course's small GPT under torch.profiler, once
with `NaiveDDP` (one all-reduce per gradient, after backward) and once with `OverlappedDDP` (one
per bucket of about 1 MB, launched from inside backward). Every all-reduce those classes call
runs under a `record_function` label, "all-reduce 0", "all-reduce 1", ...: the scratch module
holds no measurement code, so the labels are put on here, by handing it a `torch.distributed`
whose all_reduce is labelled. From the profiler's events the script takes, per rank:

- backward: from the start of `loss.backward()` to the end of the last autograd node the engine
  ran (with OverlappedDDP the call itself lasts longer: at its end it waits for the all-reduces);
- each all-reduce: gloo's own event for it, `gloo:all_reduce`, which runs on gloo's worker
  thread from when the thread starts the collective until it has finished; for one launched with
  async_op=True, the rank's own thread goes on with backward meanwhile. The labels say which call
  launched it (gloo's events come in the same order, each after its call began).

Times depend on the machine and the moment, so the SVG is drawn from the record of one run,
committed beside it (ddp-trace.json). What holds on any machine is when each all-reduce is
launched (the labels, on the rank's own thread): in the naive step every one after backward has
ended, in the overlapped step at least one before. When gloo's thread then starts it depends on
when that thread gets a core: on a machine busy with other work it can start after backward
ends, so the script prints, and its test checks, the launches.

    python -m snippets.figures.ddp_trace           # measure, and print what held
    python -m snippets.figures.ddp_trace --write   # and redraw the committed figure from this run
"""

from __future__ import annotations

import json
import re
from unittest import mock

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

import snippets.scratch.ddp as scratch_ddp
from snippets.dist import spawn
from snippets.figures import svg
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.flags import Parser

NAME = "ddp-trace"
RECORD = svg.OUT_DIR / f"{NAME}.json"
WORLD_SIZE, CONFIG, BATCH_SIZE, BUCKET_CAP_MB = 2, "small", 8, 1
VARIANTS = ("naive", "overlapped")
LABEL = "all-reduce"


# --8<-- [start:labels]
class LabelledCollectives:
    """torch.distributed, with every all_reduce under a profiler label of its own."""

    def __init__(self):
        self.count = 0

    def __getattr__(self, name):  # everything else is torch.distributed's own
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        with record_function(f"{LABEL} {self.count}"):
            self.count += 1
            return dist.all_reduce(tensor, *args, **kwargs)
# --8<-- [end:labels]


# --8<-- [start:measure]
def one_step(ddp, inputs, targets) -> None:
    """Forward, backward and (for the naive version) the gradient averaging after it."""
    with mock.patch.object(scratch_ddp, "dist", LabelledCollectives()):
        _, loss = ddp(inputs, targets)
        with record_function("backward"):
            loss.backward()  # OverlappedDDP all-reduces from inside, and waits at the end
        if isinstance(ddp, scratch_ddp.NaiveDDP):
            ddp.sync_gradients()
    ddp.module.zero_grad(set_to_none=True)


def intervals(events) -> dict:
    """Backward and each all-reduce as (start, end) in microseconds since backward started."""
    def span(e):
        return e.time_range.start, e.time_range.end

    (backward,) = [span(e) for e in events if e.name == "backward"]
    nodes = [span(e) for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    calls = sorted(span(e) for e in events if e.name.startswith(LABEL + " "))
    gloo = sorted(span(e) for e in events if e.name == "gloo:all_reduce")
    assert len(gloo) == len(calls), (len(gloo), len(calls))
    assert all(c0 <= g0 for (c0, _), (g0, _) in zip(calls, gloo))  # launched, then run
    t0 = backward[0]
    return {"backward": [0.0, round(max(end for _, end in nodes) - t0, 1)],
            "backward_call_ends": round(backward[1] - t0, 1),
            "all_reduces": [[round(g0 - t0, 1), round(g1 - t0, 1)] for g0, g1 in gloo],
            "launches": [round(c0 - t0, 1) for c0, _ in calls]}


def trace_worker(rank: int, world_size: int) -> dict:
    """One profiled step per DDP version (after a warm-up step); this rank's intervals."""
    config = get_config(CONFIG)
    torch.manual_seed(1 + rank)  # each rank its own batch
    tokens = torch.randint(0, config.vocab_size, (BATCH_SIZE, config.max_position_embeddings + 1))
    inputs, targets = shift_for_next_token(tokens)
    result = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = GPT(config)
        ddp = (scratch_ddp.NaiveDDP(model) if variant == "naive"
               else scratch_ddp.OverlappedDDP(model, bucket_cap_mb=BUCKET_CAP_MB))
        one_step(ddp, inputs, targets)  # warm-up: first-call costs stay out of the trace
        dist.barrier()  # both ranks start the profiled step together
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_step(ddp, inputs, targets)
        result[variant] = intervals(prof.events())
    return result


def measure() -> dict:
    """{variant: [rank 0's intervals, rank 1's]}, from a fresh 2-process run."""
    per_rank = spawn(trace_worker, WORLD_SIZE, timeout_s=60)
    return {v: [r[v] for r in per_rank] for v in VARIANTS}
# --8<-- [end:measure]


def started_before_backward_ended(trace: dict) -> int:
    return sum(start < trace["backward"][1] for start, _ in trace["all_reduces"])


def launched_before_backward_ended(trace: dict) -> int:
    return sum(start < trace["backward"][1] for start in trace["launches"])


def summary(record: dict) -> str:
    """What must hold on any machine, in words: the first all-reduce of the naive step is
    launched after backward has ended, the first of the overlapped step before."""
    lines = []
    for variant in VARIANTS:
        for rank, trace in enumerate(record[variant]):
            when = "before" if launched_before_backward_ended(trace) else "after"
            lines.append(f"{variant:<10} rank {rank}: {len(trace['all_reduces']):>2} all-reduces, "
                         f"the first launched {when} backward ends")
    return "\n".join(lines)


# Drawing: time runs left to right from the start of backward, on one scale for both steps.
LEFT, RIGHT, WIDTH, BAR, SUB, GAP = 150, 30, 900, 24, 12, 14
COMPUTE, NETWORK = "#dbe9f6", ("#1f4e79", "#5b8fc7")
TITLES = {"naive": "naive: one all-reduce per gradient, after backward",
          "overlapped": f"overlapped: one all-reduce per bucket of up to {BUCKET_CAP_MB} MB, "
                        "launched during backward"}


def rows(bars):
    """Bars that overlap in time go on separate sub-rows: [(row, start, end)], and the count."""
    ends, placed = [], []
    for start, end in bars:
        row = next((r for r, e in enumerate(ends) if e <= start), len(ends))
        ends[row:row + 1] = [end]
        placed.append((row, start, end))
    return placed, max(len(ends), 1)


def render(record: dict | None = None) -> str:
    """The figure, from `record` or, by default, from the committed record of one run."""
    if record is None:
        record = json.loads(RECORD.read_text(encoding="utf-8"))
    span = max(max(t["backward"][1], t["backward_call_ends"], *(e for _, e in t["all_reduces"]))
               for traces in record.values() for t in traces)
    scale = (WIDTH - LEFT - RIGHT) / span

    def x(us):
        return LEFT + us * scale

    body, y = [], 16
    for variant in VARIANTS:
        body.append(svg.text(16, y, TITLES[variant], size=15, anchor="start", weight="bold"))
        y += 16
        for rank, trace in enumerate(record[variant]):
            b0, b1 = trace["backward"]
            comm_end = max(e for _, e in trace["all_reduces"])
            body.append(svg.text(LEFT - 10, y + BAR / 2, f"rank {rank} backward", size=13,
                                 anchor="end"))
            body.append(svg.rect(x(b0), y, (b1 - b0) * scale, BAR, fill=COMPUTE,
                                 extra=f' data-variant="{variant}" data-rank="{rank}" '
                                       f'data-kind="backward"'))
            if comm_end > b1:  # the rank has nothing to compute until its gradients arrive
                body.append(svg.rect(x(b1), y, (comm_end - b1) * scale, BAR, fill="url(#wait)",
                                     stroke="#999999"))
            top = y
            y += BAR + 4
            placed, n_rows = rows(trace["all_reduces"])
            lane = max(BAR, n_rows * SUB)
            body.append(svg.text(LEFT - 10, y + lane / 2, f"rank {rank} all-reduce", size=13,
                                 anchor="end"))
            for i, (row, start, end) in enumerate(placed):
                h = lane / n_rows
                body.append(svg.rect(x(start), y + row * h, max((end - start) * scale, 0.5), h,
                                     fill=NETWORK[i % 2], stroke="#ffffff", stroke_width=0.5,
                                     extra=f' data-variant="{variant}" data-rank="{rank}" '
                                           f'data-kind="all-reduce"'))
                if variant == "overlapped" and (end - start) * scale > 24:
                    body.append(svg.text(x((start + end) / 2), y + (row + 0.5) * h + 1, f"b{i}",
                                         size=min(11, h - 1), weight="bold", fill="#ffffff"))
            y += lane
            body.append(svg.line(x(b1), top - 3, x(b1), y + 3, stroke="#c0392b", width=2,
                                 extra=' stroke-dasharray="4 3"'))
            y += GAP
        step = svg.nice_step(span / 1e3)  # the time axis, in milliseconds
        body.append(svg.line(LEFT, y - 6, x(span), y - 6))
        for k in range(int(span / 1e3 // step) + 1):
            tx = x(k * step * 1e3)
            body.append(svg.line(tx, y - 6, tx, y - 2))
            body.append(svg.text(tx, y + 7, f"{k * step:g}", size=11))
        body.append(svg.text(LEFT - 10, y + 7, "ms since", size=11, anchor="end"))
        body.append(svg.text(LEFT - 10, y + 21, "backward began", size=11, anchor="end"))
        y += 44
    legend = [svg.rect(LEFT, y - 6, 26, 14, fill=COMPUTE),
              svg.text(LEFT + 32, y + 1, "backward", size=12, anchor="start"),
              svg.rect(LEFT + 110, y - 6, 26, 14, fill=NETWORK[0], stroke="#ffffff"),
              svg.text(LEFT + 142, y + 1, "an all-reduce, running on gloo's thread", size=12,
                       anchor="start"),
              svg.rect(LEFT + 430, y - 6, 26, 14, fill="url(#wait)", stroke="#999999"),
              svg.text(LEFT + 462, y + 1, "waiting for gradients", size=12, anchor="start"),
              svg.line(LEFT + 640, y - 6, LEFT + 640, y + 8, stroke="#c0392b", width=2,
                       extra=' stroke-dasharray="4 3"'),
              svg.text(LEFT + 648, y + 1, "backward ends", size=12, anchor="start")]
    body += legend
    height = y + 20
    naive, over = record["naive"], record["overlapped"]

    def ms_after_backward(trace):  # how long the rank waits for its last all-reduce
        return max(0.0, max(e for _, e in trace["all_reduces"]) - trace["backward"][1]) / 1e3

    desc = (f"Two measured timelines of one training step of the course's {CONFIG} GPT on "
            f"{WORLD_SIZE} CPU processes with gloo, from torch.profiler, one pair of lanes per "
            f"rank: backward above, all-reduces below, time from the start of backward, on one "
            f"scale for both. Naive: {len(naive[0]['all_reduces'])} small all-reduces, one per "
            f"gradient, all starting after backward has ended, one after another, while the "
            f"rank waits. Overlapped: {len(over[0]['all_reduces'])} bucket all-reduces, launched "
            f"from inside backward as each bucket's last gradient is ready; on rank 0, "
            f"{started_before_backward_ended(over[0])} of them start before backward ends. In "
            f"this recorded run, rank 0 waits {ms_after_backward(naive[0]):.0f} ms after "
            f"backward for the naive all-reduces and {ms_after_backward(over[0]):.0f} ms for the "
            f"overlapped ones, rank 1 {ms_after_backward(naive[1]):.0f} ms and "
            f"{ms_after_backward(over[1]):.0f} ms; times vary from run to run and machine to "
            f"machine.")
    return svg.document(WIDTH, height, "A measured trace of naive and overlapped gradient "
                        "all-reduce on 2 ranks", desc, body, defs=[svg.hatch_pattern("wait")])


def main(argv=None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"also write this run's record and docs/assets/figures/{NAME}.svg")
    args = parser.parse_args(argv)
    record = measure()
    print(summary(record))
    if args.write:
        text = json.dumps(record, indent=1, sort_keys=True)
        text = re.sub(r"\[\s+([-\d.]+),\s+([-\d.]+)\s+\]", r"[\1, \2]", text)  # one per line
        RECORD.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {RECORD} and {svg.write(NAME, render(record))}")


if __name__ == "__main__":
    main()
