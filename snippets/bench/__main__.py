"""Run the benchmarks and write bench.json: `python -m snippets.bench [--only NAME] [--out PATH]`."""

import argparse
import datetime
import importlib
import json
import os
import time

from snippets.bench import BENCHMARKS
from snippets.machine import machine_info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench.json", help="where to write the results")
    parser.add_argument("--only", action="append", default=[],
                        help="run only benchmarks whose module name contains this (repeatable)")
    args = parser.parse_args(argv)

    names = [n for n in BENCHMARKS if not args.only or any(o in n for o in args.only)]
    if not names:
        raise SystemExit(f"--only {args.only} matches none of: {', '.join(BENCHMARKS)}")

    results = {}
    for name in names:
        start = time.perf_counter()
        print(f"[bench] {name} ...", flush=True)
        results[name.rsplit(".", 1)[-1]] = importlib.import_module(name).run()
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f} s", flush=True)

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "results": results,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)  # a crash mid-run never leaves a half-written bench.json
    print(json.dumps(results, indent=2))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
