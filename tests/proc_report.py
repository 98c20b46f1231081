"""Sum a SUITE_PROC_LOG file (tests/proclog/sitecustomize.py): processes started, how many
imported torch and torch._dynamo, their CPU seconds, and the tests that start the most.

    SUITE_PROC_LOG=/tmp/procs.tsv make test
    .venv/bin/python tests/proc_report.py /tmp/procs.tsv [--import-s 1.2 --dynamo-s 1.0]

Start-up is estimated as (processes that imported torch) x --import-s plus (those that imported
torch._dynamo) x --dynamo-s: measure both on the machine, e.g. with `python -X importtime`.
"""

import collections

from snippets.flags import Parser, float_at_least, int_at_least


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--import-s", type=float_at_least(0), default=1.2, help="CPU s to import torch")
    parser.add_argument("--dynamo-s", type=float_at_least(0), default=1.0, help="CPU s to import torch._dynamo")
    parser.add_argument("--top", type=int_at_least(1), default=25)
    args = parser.parse_args()
    rows = []
    with open(args.log) as log:
        for line in log:
            pid, cpu, wall, torch, dynamo, test, command = line.rstrip("\n").split("\t", 6)
            rows.append((float(cpu), int(torch), int(dynamo), test, command))
    cpu = sum(r[0] for r in rows)
    torch = sum(r[1] for r in rows)
    dynamo = sum(r[2] for r in rows)
    startup = torch * args.import_s + dynamo * args.dynamo_s
    print(f"{len(rows)} processes, {cpu:.0f} CPU s; {torch} imported torch, {dynamo} also "
          f"torch._dynamo: about {startup:.0f} CPU s of start-up ({startup / cpu:.0%})")
    per_test = collections.defaultdict(lambda: [0, 0, 0.0])
    for c, t, _, test, _ in rows:
        entry = per_test[test]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + t, entry[2] + c
    print(f"\n{'processes':>9} {'torch':>5} {'CPU s':>6}  test (- : not started by a test)")
    for test, (n, t, c) in sorted(per_test.items(), key=lambda kv: -kv[1][2])[:args.top]:
        print(f"{n:>9} {t:>5} {c:>6.1f}  {test}")


if __name__ == "__main__":
    main()
