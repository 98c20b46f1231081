"""Run the benchmarks and write bench.json: `python -m snippets.bench [--only NAME] [--out PATH]`.

`--merge` keeps the results already in --out and replaces only those this run measured: a
benchmark added later runs alone without discarding the others. The file's top-level date and
machine stay those of the run that wrote it; each merged result is listed under "merged" with its
own date, and a benchmark whose results may come from another machine records machine_info()
inside them. A run without --merge writes a new file but keeps the GPU section that
`make bench-gpu` wrote on another machine (snippets/bench/record.py)."""

import importlib
import json
import time

from snippets.bench import BENCHMARKS
from snippets.bench.record import checked_target, write_results
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
    short = [name.rsplit(".", 1)[-1] for name in names]
    # With --merge, the file to merge into, checked before anything runs.
    previous = checked_target(args.out, short, args.merge, partial=bool(args.only))

    results = {}
    for name in names:
        start = time.perf_counter()
        print(f"[bench] {name} ...", flush=True)
        results[name.rsplit(".", 1)[-1]] = importlib.import_module(name).run()
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f} s", flush=True)

    write_results(args.out, results, previous)
    print(json.dumps(results, indent=2))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
