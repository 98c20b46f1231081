"""The exercises from the command line.

    python -m snippets.exercises list               the exercises, and which are available
    python -m snippets.exercises stubs [--out DIR]  your copies of the files, exercises blanked
    python -m snippets.exercises stubs --empty N [--out DIR]
                                                    exercise N's interface only, in DIR/empty/
    python -m snippets.exercises hints N [--all | --reset] [--workspace DIR]
                                                    what exercise N asks, and its next hint
    python -m snippets.exercises check N|N-M|all [--workspace DIR | --solutions]
                                                    run exercise N's (or N to M's) checks

`check` exits with status 0 when every check passes and 1 otherwise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from snippets.exercises import catalog
from snippets.exercises.hints import all_hints, next_hint
from snippets.exercises.stubs import write_stubs
from snippets.flags import Parser

DEFAULT_WORKSPACE = "workspace"


def cmd_list(args) -> int:
    phase = None
    for ex in catalog.EXERCISES:
        if ex.phase != phase:
            phase = ex.phase
            files = {e.file for e in catalog.EXERCISES if e.phase == phase}
            where = ex.file if len(files) == 1 else os.path.commonpath(sorted(files)) + "/"
            print(f"{'' if ex.number == 1 else chr(10)}Phase {phase}: {where}")
        status = "available" if ex.available else f"not yet: comes with {ex.arrives_with}"
        print(f"  {ex.number:>2}  {ex.title:<56} {status}")
    return 0


def cmd_hints(args) -> int:
    ex = catalog.get(args.number)
    if args.all:
        print("\n".join(all_hints(ex)))
        return 0
    command = f"python -m snippets.exercises hints {ex.number}" + _workspace_flag(args.workspace)
    print("\n".join(next_hint(ex, Path(args.workspace), command, reset=args.reset)))
    return 0


def _workspace_flag(workspace: str) -> str:
    return "" if workspace == DEFAULT_WORKSPACE else f" --workspace {workspace}"


def cmd_stubs(args) -> int:
    out = Path(args.out)
    if args.empty is not None:
        return stubs_empty(catalog.get(args.empty), out, args.force)
    for w in write_stubs(out, force=args.force):
        _say_written(w)
    print("next: edit the TODOs, then python -m snippets.exercises check 1"
          + _workspace_flag(args.out))
    return 0


def stubs_empty(ex, out: Path, force: bool) -> int:
    from snippets.exercises.empty import write_empty

    if not ex.empty:
        offered = ", ".join(str(e.number) for e in catalog.EXERCISES if e.empty)
        raise SystemExit(f"exercise {ex.number} has no empty-file variant; these have one: "
                         f"{offered}")
    if not ex.available:
        raise SystemExit(f"exercise {ex.number} is not available yet: it comes with "
                         f"{ex.arrives_with}")
    w = write_empty(ex, out, force=force)
    _say_written(w)
    print(f"next: write {', '.join(ex.empty)} from the docstrings in {w.path}, then "
          f"python -m snippets.exercises check {ex.number} --workspace {out / 'empty'}")
    return 0


def _say_written(w) -> None:
    numbers = (f"exercise {w.exercises[0]}" if len(w.exercises) == 1
               else f"exercises {w.exercises[0]}-{w.exercises[-1]}")
    if w.action == "skipped":
        print(f"skipped {w.path} ({numbers}): it differs from a fresh stub, so it holds your "
              "work; --force replaces it and keeps the old file as "
              f"{w.path.name}.bak")
    elif w.action == "replaced":
        print(f"replaced {w.path} ({numbers}); your previous version is {w.backup}")
    elif w.action == "unchanged":
        print(f"unchanged {w.path} ({numbers}): already a fresh stub")
    else:
        print(f"wrote {w.path} ({numbers})")


def cmd_check(args) -> int:
    from snippets.exercises.runner import run_check, solutions_workspace  # imports torch

    workspace = solutions_workspace() if args.solutions else Path(args.workspace)
    if args.exercise == "all":
        results = [run_check(ex, workspace) for ex in catalog.EXERCISES]
        print(f"{'#':>3}  {'exercise':<56} result")
        for r in results:
            detail = {"PASS": "PASS", "FAIL": "FAIL", "not yet": f"not yet ({r.message})"}.get(
                r.status, r.message)
            print(f"{r.exercise.number:>3}  {r.exercise.title:<56} {detail}")
        failed = [r for r in results if r.status == "FAIL"]
        for r in failed:
            print(f"\nExercise {r.exercise.number}, {r.exercise.title}: FAIL\n  {r.message}")
        available = [r for r in results if r.status != "not yet"]
        passing = sum(r.ok for r in available)
        print(f"\n{passing} of {len(available)} available exercises pass")
        return 0 if passing == len(available) else 1

    try:
        first, _, last = args.exercise.partition("-")
        numbers = range(int(first), int(last or first) + 1)
        if not numbers:  # 15-12: nothing to check would read as a pass
            raise ValueError
    except ValueError:
        raise SystemExit(f"check takes an exercise number, a range like 12-15, or 'all', "
                         f"not {args.exercise!r}") from None
    results = [run_check(catalog.get(n), workspace) for n in numbers]
    print("\n".join(_report(r) for r in results))
    return 0 if all(r.ok for r in results) else 1


def _report(r) -> str:
    head = f"Exercise {r.exercise.number}, {r.exercise.title}:"
    if r.ok:
        return "\n".join([f"{head} PASS"] + [f"  ok  {p}" for p in r.passed])
    if r.status in ("not started", "blocked", "not yet"):
        return f"{head} {r.message}"
    return f"{head} FAIL\n  {r.message}"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m snippets.exercises",
                                     description="The learning guide's exercises: stubs, hints "
                                                 "and checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises and whether they are available yet")
    p = sub.add_parser("stubs", help="write your copies of the exercise files")
    p.add_argument("--out", default=DEFAULT_WORKSPACE,
                   help="the workspace directory (default: workspace/, ignored by git)")
    p.add_argument("--force", action="store_true",
                   help="replace files that hold your edits (the old file is kept as .bak)")
    p.add_argument("--empty", type=int, metavar="N",
                   help="exercise N's empty-file variant instead, in OUT/empty/: its interface "
                        "only, for you to write whole")
    p = sub.add_parser("hints", help="what an exercise asks, and its next hint")
    p.add_argument("number", type=int)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every hint at once")
    which.add_argument("--reset", action="store_true", help="start the hints over")
    p.add_argument("--workspace", default=DEFAULT_WORKSPACE,
                   help="where the hints you have seen are counted (default: workspace/)")
    p = sub.add_parser("check", help="check your solution to an exercise (or all)")
    p.add_argument("exercise", help="an exercise number, a range like 12-15, or all")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workspace", default=DEFAULT_WORKSPACE,
                       help="where your copies are (default: workspace/)")
    where.add_argument("--solutions", action="store_true",
                       help="check the repository's own solutions (every check passes)")
    args = parser.parse_args(argv)
    return {"list": cmd_list, "stubs": cmd_stubs, "hints": cmd_hints,
            "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
