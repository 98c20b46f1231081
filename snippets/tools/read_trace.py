"""What a torch.profiler trace file holds, read with nothing but json.

    python snippets/tools/read_trace.py runs/session-b/profile/trace.json
    python snippets/tools/read_trace.py runs/session-b/profile/trace.json --table runs/session-b/profile/table.txt

`prof.export_chrome_trace(path)` writes the Chrome trace format: `{"traceEvents": [...]}`, one
event per operator call, label or kernel. A complete event (`"ph": "X"`) has a `name`, a category
`cat` (`cpu_op` for a PyTorch operator, `user_annotation` for a `record_function` label, `kernel`
for a CUDA kernel), a start `ts` and a duration `dur` in microseconds, and the process and thread
it ran on. This script prints the parts of a trace that are the same in every run: the profiled
steps, how many times each label and operator ran per step. With `--table` (the table the same
run printed) it checks that the table is this trace, summed by name: each row's `# of Calls` is
the number of the row's events in the trace, counted as the table counts them. That check is
written for CPU traces, the ones the course's tests make: on CUDA the table gives a label's
GPU-side events (category gpu_user_annotation) a row of their own, beside its CPU row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from snippets.flags import Parser, int_at_least

STEP = re.compile(r"ProfilerStep#\d+")  # the profiler wraps each step in one; the table sums them
TRUNCATED = "..."  # the table cuts names longer than its name column and ends them with this


class TraceError(ValueError):
    """A file that is not a profiler trace (or not the table of one)."""


def load_events(path: str | Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace file, in the order they started."""
    try:
        trace = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceError(f"{path}: JSON, but no traceEvents list: not a Chrome trace")
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    if not events:
        raise TraceError(f"{path}: a Chrome trace with no complete events: nothing was profiled")
    return sorted(events, key=lambda e: (e.get("ts", 0), -e.get("dur", 0)))


def table_key(name: str) -> str:
    """An event's name as the profiler's table groups it: ProfilerStep#2, #3... as ProfilerStep*."""
    return STEP.sub("ProfilerStep*", name)


def merged_into_parent(events: list[dict]) -> list[dict]:
    """The events the profiler's table folds into their parent: those whose parent (the event
    around them on their thread) has the same name and no other child, such as an aten::mul
    whose only work is another aten::mul (torch's EventList._remove_dup_nodes)."""
    children: dict[int, list[int]] = defaultdict(list)
    parent: dict[int, int] = {}
    open_events: dict[tuple, list[tuple[int, float]]] = defaultdict(list)  # per thread
    for i, e in enumerate(events):  # in start order
        stack = open_events[(e.get("pid"), e.get("tid"))]
        end = e.get("ts", 0) + e.get("dur", 0)
        while stack and end > stack[-1][1]:  # not inside the innermost open event: it ended
            stack.pop()
        if stack:
            parent[i] = stack[-1][0]
            children[stack[-1][0]].append(i)
        stack.append((i, end))
    return [events[i] for i, p in parent.items()
            if events[p]["name"] == events[i]["name"] and len(children[p]) == 1]


def summarize(events: list[dict]) -> dict:
    """The profiled steps, and how many times each label and operator ran per step, counted as
    the profiler's table counts them."""
    steps = [e["name"] for e in events if STEP.fullmatch(e["name"])]
    work = [e for e in events if e.get("cat") != "Trace"]  # "Trace": the profiler's own span
    merged = merged_into_parent(work)
    calls = Counter(table_key(e["name"]) for e in work)
    calls.subtract(table_key(e["name"]) for e in merged)
    annotated = {e["name"] for e in work if e.get("cat") == "user_annotation"}
    per_step = max(len(steps), 1)
    labels = {name: n / per_step for name, n in calls.items()
              if name in annotated and name != "ProfilerStep*"}
    operators = {name: n / per_step for name, n in calls.items()
                 if name not in annotated and name != "ProfilerStep*"}
    return {"steps": steps, "events": len(events),
            "by_category": dict(Counter(e.get("cat", "") for e in events)),
            "merged": len(merged), "calls": calls, "labels": labels, "operators": operators}


def table_rows(text: str) -> list[tuple[str, int]]:
    """(name, # of Calls) for every row of a key_averages().table() printed in `text`."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---") and not line.strip("- ")]
    if len(rules) < 3:
        raise TraceError("no profiler table found (it is framed by three lines of dashes)")
    header = re.split(r"\s{2,}", lines[rules[0] + 1].strip())
    if "# of Calls" not in header:
        raise TraceError("the table has no '# of Calls' column")
    column = header.index("# of Calls")
    rows = []
    for line in lines[rules[1] + 1:rules[2]]:
        cells = re.split(r"\s{2,}", line.strip())
        try:
            rows.append((cells[0], int(cells[column])))
        except (IndexError, ValueError):
            raise TraceError(f"a table row without a number of calls: {line.strip()!r}") from None
    return rows


def read_table(path: str | Path) -> list[tuple[str, int]]:
    """table_rows of a file, with the file named in any error."""
    try:
        return table_rows(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: {getattr(err, 'strerror', None) or err}") from None
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None


def check_table(rows: list[tuple[str, int]], calls: Counter) -> list[str]:
    """The rows whose operator is not in the trace, or is there a different number of times."""
    problems = []
    for name, count in rows:
        if name.endswith(TRUNCATED):
            found = [n for n in calls if n.startswith(name[:-len(TRUNCATED)])]
            in_trace = calls[found[0]] if len(found) == 1 else None
        else:
            in_trace = calls.get(name)
        if in_trace != count:
            problems.append(f"{name}: {count} calls in the table, "
                            f"{'none' if in_trace is None else in_trace} in the trace")
    return problems


def report(path: str, summary: dict, top: int) -> None:
    steps = summary["steps"]
    print(f"{path}: {summary['events']:,} complete events, by category: "
          + ", ".join(f"{cat} {n:,}" for cat, n in sorted(summary["by_category"].items())))
    print(f"{len(steps)} profiled steps: {', '.join(steps)}")
    print("labels per step: " + ", ".join(f"{name} {n:g}" for name, n in summary["labels"].items()))
    ops = sorted(summary["operators"].items(), key=lambda kv: (-kv[1], kv[0]))
    print(f"{len(ops)} distinct operators, {sum(n for _, n in ops):,g} calls per step; "
          f"the {min(top, len(ops))} most called:")
    for name, n in ops[:top]:
        print(f"  {n:6g}  {name}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace written by torch.profiler (export_chrome_trace)")
    p.add_argument("--table", metavar="PATH",
                   help="the table the same run printed: check each row against the trace")
    p.add_argument("--top", type=int_at_least(0), default=8,
                   help="how many of the most called operators to list")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = summarize(load_events(args.trace))
        report(args.trace, summary, args.top)
        if args.table:
            rows = read_table(args.table)
            problems = check_table(rows, summary["calls"])
            if problems:
                raise TraceError(f"{args.table} does not match the trace: " + "; ".join(problems))
            print(f"the table's {len(rows)} rows: each one is in the trace, with the same "
                  f"number of calls (the table folds {summary['merged']} events into a parent "
                  "of the same name)")
    except TraceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
