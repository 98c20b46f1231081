"""Run the benchmarks and write bench.json: `python -m snippets.bench [--only NAME] [--out PATH]`.

`--merge` keeps the results already in --out and replaces only those this run measured: a
benchmark added later runs alone without discarding the others. The file's top-level date and
machine stay those of the run that wrote it; each merged result is listed under "merged" with its
own date, and a benchmark whose results may come from another machine records machine_info()
inside them."""

import datetime
import importlib
import json
import os
import time

from snippets.bench import BENCHMARKS
from snippets.machine import machine_info
from snippets.flags import Parser


def main(argv=None):
    parser = Parser(description=__doc__)
    parser.add_argument("--out", default="bench.json", help="where to write the results")
    parser.add_argument("--only", action="append", default=[],
                        help="run only benchmarks whose module name contains this (repeatable)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other results already in --out; replace only those run")
    args = parser.parse_args(argv)

    names = [n for n in BENCHMARKS if not args.only or any(o in n for o in args.only)]
    if not names:
        raise SystemExit(f"--only {args.only} matches none of: {', '.join(BENCHMARKS)}")
    if args.only and not args.merge and os.path.exists(args.out):
        # A partial run must not wipe the other benchmarks' results from the file.
        try:
            with open(args.out) as f:
                others = sorted(set(json.load(f).get("results", {}))
                                - {name.rsplit(".", 1)[-1] for name in names})
        except (OSError, ValueError, AttributeError):
            others = ["(a file that is not a bench.json)"]
        if others:
            raise SystemExit(f"--only without --merge would drop {', '.join(others)} from "
                             f"{args.out}: add --merge, or pass another --out")
    previous = None  # with --merge, the file to merge into, checked before anything runs
    if args.merge and os.path.exists(args.out):
        # Read before running: a file that cannot be merged into fails now, not after an hour.
        try:
            with open(args.out) as f:
                previous = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--merge: cannot read {args.out} ({e}); fix or move it") from None
        if not isinstance(previous, dict) or not isinstance(previous.get("results"), dict):
            raise SystemExit(f"--merge: {args.out} has no \"results\" object to merge into")

    results = {}
    for name in names:
        start = time.perf_counter()
        print(f"[bench] {name} ...", flush=True)
        results[name.rsplit(".", 1)[-1]] = importlib.import_module(name).run()
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f} s", flush=True)

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if previous is not None:
        with open(args.out) as f:  # again: the file may have changed while this run ran
            report = json.load(f)
        report["results"].update(results)
        merged = [m for m in report.get("merged", []) if m.get("result") not in results]
        report["merged"] = merged + [{"result": name, "date": now} for name in results]
    else:
        report = {"date": now, "machine": machine_info(), "results": results}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)  # a crash mid-run never leaves a half-written bench.json
    print(json.dumps(results, indent=2))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
