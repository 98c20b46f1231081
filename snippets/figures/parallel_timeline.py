"""One step of the parallel trainer, rank by rank: who computed which forward and backward, when.

snippets/training/parallel_trainer.py appends one line per step to OUT/logs/rank-N.jsonl: the
rank's coordinates, when its step started ("start", time.perf_counter() seconds) and what its
pipeline stage did, [kind "F"/"B", micro-batch, start, end] in seconds from that start (under
interleaving the micro-batch is [chunk, micro-batch]). perf_counter is one clock for every
process on a machine, so start + t puts every rank's events on one timeline. This script takes
one step (by default the last step that every rank of the run logged), draws one lane per rank
and checks, on the record, what holds on any machine:

- every rank ran its stage's schedule: its F and B, in order, are exactly
  `one_f_one_b_schedule(m, stage, pp)` (`interleaved_schedule(m, rank, pp, v)` when interleaved),
  the lists the trainer ran;
- the ranks of a TP group (same dp, pp and cp) ran the same actions;
- every forward began after the previous stage's forward of the same micro-batch had ended, and
  every backward after the next stage's backward of it: what the pipeline's receives enforce.

How long each box is, and so where the bubble falls, depends on the machine and the moment: the
figure is drawn from the record of one run, committed beside it (parallel-timeline.json).

    python -m snippets.figures.parallel_timeline runs/parallel-3d           # check, print
    python -m snippets.figures.parallel_timeline runs/parallel-3d --write   # and redraw the figure
"""

from __future__ import annotations

import json
import re
import sys
from itertools import product
from pathlib import Path

from snippets.figures import svg
from snippets.flags import Parser, int_at_least
from snippets.scratch.pipeline import one_f_one_b_schedule
from snippets.scratch.pipeline_interleaved import interleaved_schedule

NAME = "parallel-timeline"
RECORD = svg.OUT_DIR / f"{NAME}.json"
AXES = ("dp", "pp", "cp", "tp")
DEFAULT_RUN = "runs/parallel-3d"
TRAINER_COMMAND = ("torchrun --nproc_per_node=8 snippets/training/parallel_trainer.py --dp 2 "
                   "--tp 2 --pp 2 --model-size tiny --max-steps 6 --batch-size 2 "
                   "--grad-accum-steps 4 --seq-len 32 --log-every 2 --out runs/parallel-3d")


class LogError(Exception):
    """The run's logs cannot give the step asked for; the message names the fix."""


# --8<-- [start:read]
def read_logs(out: str | Path) -> dict[int, list[dict]]:
    """{rank: its records, in the order written} from OUT/logs/rank-N.jsonl."""
    logs = Path(out) / "logs"
    files = sorted(logs.glob("rank-*.jsonl")) if logs.is_dir() else []
    if not files:
        raise LogError(f"no per-rank logs in {logs}: run the trainer first, e.g. "
                       f"{TRAINER_COMMAND.replace('runs/parallel-3d', str(out))}")
    return {int(f.stem.split("-")[1]): [json.loads(line) for line in f.read_text().splitlines()
                                        if line.strip()] for f in files}


def overlaps(a: dict, b: dict) -> bool:
    """Whether two ranks' records of a step were written by the same run: their steps overlap
    in time (a folder may also hold an earlier run's logs, at another layout)."""
    return a["start"] < b["start"] + b["seconds"] and b["start"] < a["start"] + a["seconds"]


def select_step(logs: dict, step: int | None = None) -> dict:
    """One step of one run: {rank: its record}, every rank of the layout present. By default
    the last step that all the ranks of rank 0's latest run logged."""
    if 0 not in logs:
        raise LogError("no rank-0.jsonl among the logs: every run has a rank 0")
    steps = [r["step"] for r in logs[0]] if step is None else [step]
    for s in reversed(steps):
        mine = [r for r in logs[0] if r["step"] == s]
        if not mine:
            have = sorted({r["step"] for r in logs[0]})
            raise LogError(f"step {s} is not in rank 0's log (it has steps {have[0]}-{have[-1]})"
                           ": choose one of those with --step")
        first = mine[-1]  # a step run twice (a resume from an earlier checkpoint): the latest
        chosen = {}
        for rank, records in logs.items():
            same_run = [r for r in records if r["step"] == s and overlaps(r, first)]
            if same_run:
                chosen[rank] = same_run[-1]
        if complete(chosen):
            return chosen
        if step is not None:
            raise LogError(f"step {s}: the ranks' logs do not cover the whole layout (a rank "
                           "stopped early?): choose an earlier --step")
    raise LogError("no step was logged by every rank of the run")


def complete(chosen: dict) -> bool:
    """Whether the records' coordinates fill the mesh, each point once."""
    points = [tuple(r["coords"][a] for a in AXES) for r in chosen.values()]
    sizes = [max(p[i] for p in points) + 1 for i in range(len(AXES))]
    return sorted(points) == sorted(product(*(range(n) for n in sizes)))


def align(out: str | Path, chosen: dict) -> dict:
    """The record this script draws and checks: the step's events, every rank's on one clock,
    in seconds from the earliest rank's step start (rounded to the microsecond)."""
    t0 = min(r["start"] for r in chosen.values())
    some = next(iter(chosen.values()))

    def at(t, record):
        return round(record["start"] + t - t0, 6)

    return {"run": str(out), "step": some["step"],
            "layout": {a: 1 + max(r["coords"][a] for r in chosen.values()) for a in AXES},
            "ranks": [{"rank": rank, "coords": {a: r["coords"][a] for a in AXES},
                       "span": [at(0.0, r), at(r["seconds"], r)],
                       "events": [[kind, micro, at(s, r), at(e, r)]
                                  for kind, micro, s, e in r["events"]]}
                      for rank, r in sorted(chosen.items())]}
# --8<-- [end:read]


# --8<-- [start:checks]
def action(event) -> tuple:
    """("F", micro-batch), or ("F", chunk, micro-batch) when interleaved: the schedules' tuples."""
    kind, micro = event[0], event[1]
    return (kind, *micro) if isinstance(micro, list) else (kind, micro)


def micro_batches(record: dict) -> int:
    return len({action(e)[-1] for e in record["ranks"][0]["events"]})


def expected_actions(record: dict, rank: dict) -> list[tuple]:
    """What the trainer's schedule says this rank's stage runs, in order."""
    m, pp, p = micro_batches(record), record["layout"]["pp"], rank["coords"]["pp"]
    acts = [action(e) for e in rank["events"]]
    if acts and len(acts[0]) == 3:  # interleaved: v chunks per rank
        v = len({a[1] for a in acts}) or 1
        return interleaved_schedule(m, p, pp, v, zero_bubble=any(a[0] == "W" for a in acts))
    return one_f_one_b_schedule(m, p, pp)


def follows_schedule(record: dict) -> dict[int, bool]:
    """{rank: whether its actions are exactly its stage's schedule}."""
    return {r["rank"]: [action(e) for e in r["events"]] == [tuple(a) for a in
                                                           expected_actions(record, r)]
            for r in record["ranks"]}


def tp_groups(record: dict) -> list[tuple[list[int], bool]]:
    """[(ranks of one TP group, whether they ran the same actions)]."""
    groups = {}
    for r in record["ranks"]:
        key = tuple(r["coords"][a] for a in AXES if a != "tp")
        groups.setdefault(key, []).append(r)
    return [([r["rank"] for r in members],
             all([action(e) for e in r["events"]] == [action(e) for e in members[0]["events"]]
                 for r in members))
            for _, members in sorted(groups.items())]


def chunk_of(event, rank: dict) -> int:
    """The model chunk an event ran: its stage, or under interleaving the chunk it names."""
    return event[1][0] if isinstance(event[1], list) else rank["coords"]["pp"]


def waits_for_neighbours(record: dict) -> bool:
    """Every F of chunk c began after chunk c - 1's F of the same micro-batch ended (on the rank
    before it in the same PP group), every B after chunk c + 1's B of it: what the receives
    enforce. Only on one machine's clock; across machines the clocks differ."""
    def line(r):  # the ranks that pass activations to each other: same dp, cp and tp
        return tuple(r["coords"][a] for a in ("dp", "cp", "tp"))

    end = {(line(r), e[0], chunk_of(e, r), action(e)[-1]): e[3]
           for r in record["ranks"] for e in r["events"]}
    for r in record["ranks"]:
        for e in r["events"]:
            kind, c, i = e[0], chunk_of(e, r), action(e)[-1]
            feeder = (line(r), kind, c - 1 if kind == "F" else c + 1, i)
            if feeder in end and e[2] < end[feeder]:
                return False
    return True


# --8<-- [end:checks]


def label(record: dict, rank: dict) -> str:
    """"rank 5  dp1 pp0 tp1": the axes the layout splits (all four when none is)."""
    axes = [a for a in AXES if record["layout"][a] > 1] or list(AXES)
    return f"rank {rank['rank']}  " + " ".join(f"{a}{rank['coords'][a]}" for a in axes)


def action_text(act: tuple, pp: int) -> str:
    """F3, or F3' for micro-batch 3 on a rank's second chunk (F3'' its third, ...)."""
    return f"{act[0]}{act[-1]}" + ("'" * (act[1] // pp) if len(act) == 3 else "")


def summary(record: dict) -> str:
    """What holds on any machine, in words and exact values."""
    lay, m = record["layout"], micro_batches(record)
    schedule = follows_schedule(record)
    name = "interleaved 1F1B" if len(action(record["ranks"][0]["events"][0])) == 3 else "1F1B"
    lines = [f"step {record['step']} of {record['run']}: {len(record['ranks'])} ranks, "
             + " x ".join(f"{a} {lay[a]}" for a in AXES) + f", {m} micro-batches"]
    width = max(len(label(record, r)) for r in record["ranks"])
    for r in record["ranks"]:
        acts = " ".join(action_text(action(e), lay["pp"]) for e in r["events"])
        lines.append(f"{label(record, r):<{width}}  {acts}  {name} of stage "
                     f"{r['coords']['pp']}: {schedule[r['rank']]}")
    groups = tp_groups(record)
    lines.append("TP groups ran the same actions: "
                 + " ".join(str(ranks) for ranks, _ in groups) + f": {all(s for _, s in groups)}")
    lines.append("every F began after the stage before ended it, every B after the stage after: "
                 f"{waits_for_neighbours(record)}")
    return "\n".join(lines)


def holds(record: dict) -> bool:
    return (all(follows_schedule(record).values()) and all(s for _, s in tp_groups(record))
            and waits_for_neighbours(record))


# Drawing: one lane per rank, time left to right on one clock; TP groups close together.
LEFT, RIGHT, WIDTH, LANE, GAP, TOP = 190, 24, 980, 26, 10, 40
F_FILL, B_FILL, AFTER_FILL = "#dbe9f6", "#1f4e79", "#e8e8e8"


def render(record: dict | None = None) -> str:
    """The figure, from `record` or, by default, from the committed record of one run."""
    if record is None:
        record = json.loads(RECORD.read_text(encoding="utf-8"))
    lay, ranks = record["layout"], record["ranks"]
    span = max(r["span"][1] for r in ranks)
    scale = (WIDTH - LEFT - RIGHT) / span

    def x(t):
        return LEFT + t * scale

    body = [svg.text(16, 16, "One step of the parallel trainer, "
                     + " x ".join(f"{a.upper()} {lay[a]}" for a in AXES if lay[a] > 1)
                     + f", {micro_batches(record)} micro-batches: what each rank computed, when",
                     size=15, anchor="start", weight="bold")]
    y, previous = TOP, None
    for r in ranks:
        group = tuple(r["coords"][a] for a in AXES if a != "tp")
        if previous is not None and group != previous:
            y += GAP  # a new TP group
        previous = group
        start, stop = r["span"]
        last_b = max((e[3] for e in r["events"]), default=start)
        body.append(svg.text(LEFT - 10, y + LANE / 2, label(record, r), size=13, anchor="end"))
        body.append(svg.rect(x(start), y, (last_b - start) * scale, LANE, fill="url(#idle)",
                             stroke="#999999", extra=f' data-rank="{r["rank"]}" data-lane="1"'))
        body.append(svg.rect(x(last_b), y, max((stop - last_b) * scale, 0.5), LANE,
                             fill=AFTER_FILL, stroke="#999999"))
        for e in r["events"]:
            act, dark = action(e), e[0] == "B"
            w = max((e[3] - e[2]) * scale, 0.5)
            body.append(svg.rect(x(e[2]), y, w, LANE, fill=B_FILL if dark else F_FILL,
                                 extra=f' data-rank="{r["rank"]}" data-kind="{e[0]}"'))
            text = action_text(act, lay["pp"]).replace("'", "′")
            if w >= 7 * len(text) + 2:
                body.append(svg.text(x(e[2]) + w / 2, y + LANE / 2 + 1, text, size=11,
                                     weight="bold" if dark else "normal",
                                     fill="#ffffff" if dark else "#111111"))
        y += LANE + 4
    y += 6  # the time axis, in milliseconds from the first rank's step start
    step = svg.nice_step(span * 1e3)
    body.append(svg.line(LEFT, y, x(span), y))
    for k in range(int(span * 1e3 // step) + 1):
        tx = x(k * step / 1e3)
        body.append(svg.line(tx, y, tx, y + 4))
        body.append(svg.text(tx, y + 13, f"{k * step:g}", size=11))
    body.append(svg.text(LEFT - 10, y + 13, "ms", size=11, anchor="end"))
    y += 36
    legend = [(F_FILL, "F3", "#111111", "forward of micro-batch 3"),
              (B_FILL, "B3", "#ffffff", "backward"),
              ("url(#idle)", "", "#111111", "waiting: the bubble, a receive, a TP peer"),
              (AFTER_FILL, "", "#111111", "after the last backward: gradients averaged, "
                                          "clipped, AdamW")]
    lx = LEFT
    for fill, text, ink, words in legend:
        if lx + 36 + 6.6 * len(words) > WIDTH - RIGHT:  # the next row
            lx, y = LEFT, y + 26
        body.append(svg.rect(lx, y - 8, 30, 18, fill=fill,
                             stroke="#999999" if not text else "#222222"))
        if text:
            body.append(svg.text(lx + 15, y + 1, text, size=11, fill=ink))
        body.append(svg.text(lx + 36, y + 1, words, size=12, anchor="start"))
        lx += 36 + 6.6 * len(words) + 18
    height = y + 20
    busiest = max(ranks, key=lambda r: sum(e[3] - e[2] for e in r["events"]))
    desc = (f"A measured timeline of step {record['step']} of the course's parallel trainer on "
            f"{len(ranks)} CPU processes with gloo, "
            + " x ".join(f"{a} {lay[a]}" for a in AXES) + ", one lane per rank, labelled with "
            f"its coordinates, time from the first rank's step start on the clock all processes "
            f"of a machine share. Each lane shows its stage's forwards (F) and backwards (B), "
            f"numbered by micro-batch, in the 1F1B order: a last stage alternates one forward and "
            f"one backward from the start, the stage before it runs more forwards first, and both "
            f"wait at the start and the end of the pipeline (the bubble, hatched). The "
            f"{lay['tp']} ranks of a TP group, adjacent lanes, run the same boxes side by side, "
            f"since every layer waits for all its shards. After its last backward a rank "
            f"averages gradients over DP, clips and steps. In this recorded run the step took "
            f"{max(r['span'][1] - r['span'][0] for r in ranks) * 1e3:.0f} ms on the slowest rank "
            f"and rank {busiest['rank']} computed for "
            f"{sum(e[3] - e[2] for e in busiest['events']) * 1e3:.0f} ms of it; times vary from "
            f"run to run and machine to machine.")
    return svg.document(WIDTH, height, f"One step of the parallel trainer, rank by rank "
                        f"(step {record['step']})", desc, body,
                        defs=[svg.hatch_pattern("idle")])


def record_text(record: dict) -> str:
    """The record as JSON, one event per line."""
    text = json.dumps(record, indent=1)
    for _ in range(2):  # innermost first: [chunk, micro], then the event around it
        text = re.sub(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}",
                      lambda m: json.dumps(json.loads(m.group())), text)
    return text + "\n"


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=DEFAULT_RUN,
                        help=f"the trainer's --out folder (default {DEFAULT_RUN})")
    parser.add_argument("--step", type=int_at_least(1), default=None,
                        help="the step to draw (default: the last one every rank logged)")
    parser.add_argument("--write", action="store_true",
                        help=f"also write the record and docs/assets/figures/{NAME}.svg")
    args = parser.parse_args(argv)
    try:
        record = align(args.out, select_step(read_logs(args.out), args.step))
    except LogError as err:
        parser.error(str(err))
    print(summary(record))
    if args.write:
        RECORD.write_text(record_text(record), encoding="utf-8")
        print(f"wrote {RECORD.relative_to(svg.ROOT)} and "
              f"{svg.write(NAME, render(record)).relative_to(svg.ROOT)}")
    return 0 if holds(record) else 1


if __name__ == "__main__":
    sys.exit(main())
