"""GPipe against 1F1B for p = 4 stages and m = 8 micro-batches, drawn from the course's schedules.

The order of forwards (F) and backwards (B) on each stage is not re-derived here: it is
`snippets.scratch.pipeline.SCHEDULES`, the lists the from-scratch pipeline runs. This script only
adds time: a forward takes one unit, a backward two, sending is free, and an action starts as soon
as its stage is free and its input has arrived (a forward needs the previous stage's forward of
the same micro-batch; a backward the next stage's backward, or on the last stage its own forward).
Idle time, the bubble, is hatched.
"""

from __future__ import annotations

from snippets.figures import svg
from snippets.scratch.pipeline import SCHEDULES
from snippets.scratch.pipeline_trace import theoretical_bubble

NAME = "pipeline-schedules"
STAGES, MICRO_BATCHES = 4, 8
DURATION = {"F": 1, "B": 2}  # time units: a backward costs about twice a forward


def simulate(schedule_name: str, num_stages: int = STAGES, num_micro_batches: int = MICRO_BATCHES):
    """Start and end of every action: {stage: [(kind, micro_batch, start, end), ...]}."""
    orders = {s: SCHEDULES[schedule_name](num_micro_batches, s, num_stages)
              for s in range(num_stages)}
    done: dict[tuple, int] = {}  # (kind, stage, micro_batch) -> end time
    timeline = {s: [] for s in range(num_stages)}
    position = {s: 0 for s in range(num_stages)}
    free_at = {s: 0 for s in range(num_stages)}
    while any(position[s] < len(orders[s]) for s in orders):
        progressed = False
        for s in range(num_stages):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            if kind == "F":
                needs = ("F", s - 1, i) if s > 0 else None
            else:
                needs = ("B", s + 1, i) if s < num_stages - 1 else ("F", s, i)
            if needs is not None and needs not in done:
                continue  # its input has not been computed yet
            start = max(free_at[s], done[needs] if needs else 0)
            end = start + DURATION[kind]
            timeline[s].append((kind, i, start, end))
            done[(kind, s, i)] = end
            free_at[s] = end
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule_name!r} deadlocks")
    return timeline


def peak_in_flight(actions) -> int:
    """Most micro-batches whose activations a stage holds at once (forwarded, not backwarded)."""
    held = peak = 0
    for kind, *_ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


UNIT, ROW, LEFT, RIGHT = 26, 38, 96, 200
F_FILL, B_FILL = "#dbe9f6", "#1f4e79"


def _panel(y0: float, label: str, timeline, total: int) -> tuple[list[str], float]:
    busy = sum(end - start for acts in timeline.values() for *_, start, end in acts)
    idle = 1 - busy / (total * len(timeline))
    parts = [svg.text(LEFT, y0 + 12, f"{label}: step of {total} units, "
                      f"{idle:.0%} of each stage's time idle (hatched)",
                      size=16, anchor="start", weight="bold")]
    top = y0 + 30
    for s, acts in timeline.items():
        y = top + s * ROW
        parts.append(svg.text(LEFT - 10, y + ROW / 2 - 2, f"stage {s}", size=14, anchor="end"))
        parts.append(svg.rect(LEFT, y, total * UNIT, ROW - 6, fill="url(#idle)", stroke="#999999"))
        for kind, i, start, end in acts:
            x, w = LEFT + start * UNIT, (end - start) * UNIT
            dark = kind == "B"
            parts.append(svg.rect(x, y, w, ROW - 6, fill=B_FILL if dark else F_FILL,
                                  stroke="#222222"))
            parts.append(svg.text(x + w / 2, y + (ROW - 6) / 2 + 1, f"{kind}{i}", size=13,
                                  weight="bold" if dark else "normal",
                                  fill="#ffffff" if dark else "#111111"))
        parts.append(svg.text(LEFT + total * UNIT + 12, y + ROW / 2 - 2,
                              f"holds ≤ {peak_in_flight(acts)} micro-batches", size=13,
                              anchor="start"))
    axis_y = top + len(timeline) * ROW + 4
    for t in range(0, total + 1, 3):
        x = LEFT + t * UNIT
        parts.append(svg.line(x, axis_y - 4, x, axis_y + 2, stroke="#444444"))
        parts.append(svg.text(x, axis_y + 12, str(t), size=12, fill="#444444"))
    return parts, axis_y + 24


def render() -> str:
    timelines = {name: simulate(name) for name in ("gpipe", "1f1b")}
    total = max(end for tl in timelines.values() for acts in tl.values() for *_, end in acts)
    width = LEFT + total * UNIT + RIGHT
    body, y = [], 10
    for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        parts, y = _panel(y, label, timelines[name], total)
        body += parts
        y += 16
    # Legend: shapes and labels carry the meaning, colour only repeats it.
    lx = LEFT
    body.append(svg.rect(lx, y, UNIT, 22, fill=F_FILL))
    body.append(svg.text(lx + UNIT / 2, y + 12, "F3", size=13))
    body.append(svg.text(lx + UNIT + 8, y + 11, "forward of micro-batch 3 (1 unit)",
                         size=13, anchor="start"))
    lx += 300
    body.append(svg.rect(lx, y, 2 * UNIT, 22, fill=B_FILL))
    body.append(svg.text(lx + UNIT, y + 12, "B3", size=13, weight="bold", fill="#ffffff"))
    body.append(svg.text(lx + 2 * UNIT + 8, y + 11, "backward (2 units)", size=13,
                         anchor="start"))
    lx += 220
    body.append(svg.rect(lx, y, 2 * UNIT, 22, fill="url(#idle)", stroke="#999999"))
    body.append(svg.text(lx + 2 * UNIT + 8, y + 11, "idle: the bubble", size=13,
                         anchor="start"))
    height = y + 34
    bubble = theoretical_bubble(STAGES, MICRO_BATCHES)
    desc = (f"Two timelines of one training step with {STAGES} pipeline stages and "
            f"{MICRO_BATCHES} micro-batches; a forward takes 1 time unit and a backward 2. "
            f"GPipe runs all forwards, then all backwards; 1F1B runs a few warm-up forwards, then "
            f"alternates one forward and one backward. Both steps take {total} units and leave "
            f"each stage idle for the same fraction, (p-1)/(m+p-1) = {bubble:.0%}; GPipe's stages "
            f"hold up to {MICRO_BATCHES} micro-batches' activations, 1F1B's at most {STAGES}.")
    return svg.document(width, height, f"GPipe and 1F1B schedules, p = {STAGES}, "
                        f"m = {MICRO_BATCHES}", desc, body, defs=[svg.hatch_pattern("idle")])


# Interleaved 1F1B and its zero-bubble variant, drawn from snippets/scratch/pipeline_interleaved.py.
INTERLEAVED_NAME = "pipeline-interleaved"
INTERLEAVED_V = 2
I_UNIT = 14  # a chunk's forward; a whole stage's forward is v units
CHUNK_FILL = {"F": ("#dbe9f6", "#fde2c4"), "B": ("#1f4e79", "#a0522d"), "W": ("#7fa7cc", "#d9a27a")}


def interleaved_timelines(num_stages: int = STAGES, num_micro_batches: int = MICRO_BATCHES,
                          v: int = INTERLEAVED_V) -> dict:
    """{label: (timeline, ranks' busy units)} for plain 1F1B (a stage: forward v units, backward
    2v), interleaved 1F1B (v chunks: forward 1, backward 2) and zero bubble (B and W 1 each)."""
    from snippets.scratch.pipeline_interleaved import interleaved_schedule, simulate

    p, m = num_stages, num_micro_batches
    plain = {s: [(k, s, i) for k, i in SCHEDULES["1f1b"](m, s, p)] for s in range(p)}
    runs = {"1F1B": simulate(plain, p, m, {"F": v, "B": 2 * v})}
    for label, zb in (("Interleaved 1F1B", False), ("Interleaved, zero bubble", True)):
        orders = {r: interleaved_schedule(m, r, p, v, zb) for r in range(p)}
        duration = {"F": 1, "B": 1, "W": 1} if zb else {"F": 1, "B": 2}
        runs[label] = simulate(orders, p * v, m, duration)
    return runs


def _interleaved_panel(y0: float, label: str, timeline, total: int, p: int):
    span = max(end for acts in timeline.values() for *_, end in acts)
    busy = sum(end - start for *_, start, end in timeline[0])
    parts = [svg.text(LEFT, y0 + 12, f"{label}: step of {span} units, idle / compute = "
                      f"{(span - busy) / busy:.3f}", size=16, anchor="start", weight="bold")]
    top = y0 + 30
    for r, acts in timeline.items():
        y = top + r * ROW
        parts.append(svg.text(LEFT - 10, y + ROW / 2 - 2, f"rank {r}", size=14, anchor="end"))
        parts.append(svg.rect(LEFT, y, total * I_UNIT, ROW - 6, fill="url(#idle)",
                              stroke="#999999"))
        for kind, chunk, i, start, end in acts:
            second = chunk >= p  # the rank's second chunk: primed label, warm fill
            x, w = LEFT + start * I_UNIT, (end - start) * I_UNIT
            parts.append(svg.rect(x, y, w, ROW - 6, fill=CHUNK_FILL[kind][second],
                                  stroke="#222222"))
            parts.append(svg.text(x + w / 2, y + (ROW - 6) / 2 + 1, f"{i}{'′' if second else ''}",
                                  size=11, fill="#ffffff" if kind == "B" else "#111111"))
    axis_y = top + len(timeline) * ROW + 4
    for t in range(0, total + 1, 6):
        x = LEFT + t * I_UNIT
        parts.append(svg.line(x, axis_y - 4, x, axis_y + 2, stroke="#444444"))
        parts.append(svg.text(x, axis_y + 12, str(t), size=12, fill="#444444"))
    return parts, axis_y + 24


def render_interleaved() -> str:
    runs = interleaved_timelines()
    total = max(end for tl in runs.values() for acts in tl.values() for *_, end in acts)
    body, y = [], 10
    for label, timeline in runs.items():
        parts, y = _interleaved_panel(y, label, timeline, total, STAGES)
        body += parts
        y += 16
    legend = [("F", 0, "3", "forward of micro-batch 3"),
              ("F", 1, "3′", "on the rank's 2nd chunk"), ("B", 0, "3", "backward"),
              ("B", 1, "3′", "2nd chunk"),
              ("W", 0, "3", "weight gradient"), (None, 0, "", "idle")]
    lx = LEFT
    for kind, second, text, words in legend:
        fill = CHUNK_FILL[kind][second] if kind else "url(#idle)"
        body.append(svg.rect(lx, y, 2 * I_UNIT, 22, fill=fill))
        body.append(svg.text(lx + I_UNIT, y + 12, text, size=11,
                             fill="#ffffff" if kind == "B" else "#111111"))
        body.append(svg.text(lx + 2 * I_UNIT + 6, y + 11, words, size=13, anchor="start"))
        lx += 2 * I_UNIT + 24 + 7.5 * len(words)
    width = max(LEFT + total * I_UNIT + 40, lx)
    p, m, v = STAGES, MICRO_BATCHES, INTERLEAVED_V
    desc = (f"Three timelines of one training step with {p} ranks and {m} micro-batches, in "
            f"units of one chunk's forward. Plain 1F1B: one stage per rank, forward {v} units, "
            f"backward {2 * v}; idle over compute (p-1)/m. Interleaved 1F1B: each rank holds "
            f"{v} chunks (rank r: chunks r and r+{p}, the second drawn with a primed label), "
            f"each a forward of 1 unit and a backward of 2; the warm-up and cool-down are "
            f"{v} times shorter, idle over compute (p-1)/(v m). Zero bubble: each backward is "
            f"split into the input gradient (1 unit) and the weight gradient (1 unit), which "
            f"fills idle time; idle over compute is a third of interleaved's.")
    return svg.document(width, y + 34, f"1F1B, interleaved 1F1B and zero bubble, p = {p}, "
                        f"m = {m}, v = {v}", desc, body, defs=[svg.hatch_pattern("idle")])


if __name__ == "__main__":
    print(f"wrote {svg.write(NAME, render())}")
    print(f"wrote {svg.write(INTERLEAVED_NAME, render_interleaved())}")
