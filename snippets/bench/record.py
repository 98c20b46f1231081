"""bench.json: the one file every benchmark writes into, and the rules for adding to it.

`python -m snippets.bench` (the CPU benchmarks) and `python -m snippets.bench.gpu` (the GPU
section, from another machine) both write through these two functions:

- `checked_target` runs before anything is measured: a file that cannot be merged into, or a
  run that would drop results it did not make, fails now, not after an hour of measuring.
- `write_results` writes atomically. Merging keeps the other results and the file's top-level
  date and machine, and lists each merged result under "merged" with its own date; a new file
  gets this run's date and machine.

The GPU section comes from another machine than the CPU results: a CPU run that writes a new
file keeps it (KEPT_ACROSS_RUNS), with its "merged" entry, instead of dropping it.
"""

from __future__ import annotations

import datetime
import json
import os

from snippets.machine import machine_info

# Sections another machine writes (`make bench-gpu`): a CPU run could never measure them again.
KEPT_ACROSS_RUNS = ("gpu",)


def checked_target(out: str, names: list[str], merge: bool, partial: bool,
                   run: str = "--only") -> dict | None:
    """Check `out` before a run of the results `names`. Returns the report to merge into, or
    None to write a new file. `partial`: the run leaves out results a full run makes, so
    writing a new file would drop the others (refused unless `merge`; `run` names the run in
    the message)."""
    if partial and not merge and os.path.exists(out):
        # A partial run must not wipe the other benchmarks' results from the file.
        try:
            with open(out) as f:
                others = sorted(set(json.load(f).get("results", {})) - set(names)
                                - set(KEPT_ACROSS_RUNS))
        except (OSError, ValueError, AttributeError):
            others = ["(a file that is not a bench.json)"]
        if others:
            raise SystemExit(f"{run} without --merge would drop {', '.join(others)} from "
                             f"{out}: add --merge, or pass another --out")
    if not merge or not os.path.exists(out):
        return None
    # Read before running: a file that cannot be merged into fails now, not after an hour.
    try:
        with open(out) as f:
            previous = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--merge: cannot read {out} ({e}); fix or move it") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("results"), dict):
        raise SystemExit(f"--merge: {out} has no \"results\" object to merge into")
    return previous


def kept_sections(out: str) -> tuple[dict, list]:
    """The KEPT_ACROSS_RUNS results in `out` and their "merged" entries ({} and [] if none)."""
    try:
        with open(out) as f:
            report = json.load(f)
        results, merged = report.get("results", {}), report.get("merged", [])
    except (OSError, ValueError, AttributeError):
        return {}, []
    kept = {name: results[name] for name in KEPT_ACROSS_RUNS if name in results}
    return kept, [m for m in merged if isinstance(m, dict) and m.get("result") in kept]


def write_results(out: str, results: dict, merge_into: dict | None) -> dict:
    """Write `results` into `out`: merged into the file if `merge_into` (checked_target's
    answer) is not None, else as a new report that keeps the file's KEPT_ACROSS_RUNS sections."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if merge_into is not None:
        with open(out) as f:  # again: the file may have changed while this run ran
            report = json.load(f)
        report["results"].update(results)
        merged = [m for m in report.get("merged", []) if m.get("result") not in results]
        report["merged"] = merged + [{"result": name, "date": now} for name in results]
    else:
        kept, kept_merged = kept_sections(out)
        kept = {name: section for name, section in kept.items() if name not in results}
        report = {"date": now, "machine": machine_info(), "results": {**results, **kept}}
        kept_merged = [m for m in kept_merged if m["result"] in kept]
        if kept_merged:
            report["merged"] = kept_merged
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)  # a crash mid-run never leaves a half-written bench.json
    return report
