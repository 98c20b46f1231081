"""Where all of the machine's CPU went during a suite run, from Linux process accounting.

SUITE_CPU_LOG counts a test's own CPU and that of the children it waited for; SUITE_PROC_LOG
counts the Python processes that exit normally. Both miss the processes nobody waits for:
multiprocessing's forkserver and the ranks it forks (they end in os._exit), SLURM's job steps,
Chromium's helpers. On this 2-core machine those were a fifth of the suite's CPU. The kernel's
process accounting records every process at exit, forked or not (needs root and `acct`):

    touch /tmp/pacct && accton /tmp/pacct
    SUITE_CPU_LOG=/tmp/cpu make test; accton off
    dump-acct /tmp/pacct > /tmp/pacct.txt
    .venv/bin/python tests/acct_report.py /tmp/pacct.txt /tmp/cpu

A process is charged to the test its pytest worker was running when the process started (the
worker's pid is the sixth column of the SUITE_CPU_LOG files). A process whose chain of parents
does not reach a worker (a forkserver's ranks: the forkserver outlives its worker, so at exit
its parent is pid 1) is listed apart, by the oldest ancestor accounting saw.
"""

import collections
import datetime
from pathlib import Path

from snippets.flags import Parser, int_at_least

TICKS = 100  # dump-acct prints times in AHZ ticks, 100 per second on Linux


def read_acct(path: str) -> dict[int, dict]:
    """dump-acct lines: comm|version|utime|stime|etime|uid|gid|mem|io|pid|ppid|flags|exit|tty|btime."""
    procs = {}
    for line in Path(path).read_text().splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 15:
            continue
        started = datetime.datetime.strptime(f[14], "%a %b %d %H:%M:%S %Y").timestamp()
        procs[int(f[9])] = {"comm": f[0], "cpu": (float(f[2]) + float(f[3])) / TICKS,
                            "ppid": int(f[10]), "start": started}
    return procs


def read_tests(folder: str) -> dict[int, list]:
    """Worker pid -> [(start, end, test id)] from the SUITE_CPU_LOG files."""
    tests = collections.defaultdict(list)
    for log in Path(folder).glob("*.tsv"):
        for line in log.read_text().splitlines():
            test, _cpu, wall, end, _busy, pid = line.split("\t")[:6]
            tests[int(pid)].append((float(end) - float(wall), float(end), test))
    return tests


def test_at(intervals: list, when: float) -> str | None:
    """The test that overlaps most of [when, when + 1 s): accounting keeps whole seconds."""
    overlap = {test: min(end, when + 1) - max(start, when) for start, end, test in intervals}
    best = max(overlap, key=overlap.get, default=None)
    return best if best is not None and overlap[best] > 0 else None


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("acct", help="dump-acct output")
    parser.add_argument("cpu_log", help="the SUITE_CPU_LOG folder of the same run")
    parser.add_argument("--top", type=int_at_least(1), default=30)
    args = parser.parse_args()
    procs, tests = read_acct(args.acct), read_tests(args.cpu_log)

    def ancestors(pid: int) -> list[int]:
        """The parents accounting saw, nearest first (a guard against reused pids)."""
        chain = []
        while procs[pid]["ppid"] in procs and procs[pid]["ppid"] not in chain:
            pid = procs[pid]["ppid"]
            chain.append(pid)
        return chain

    total = sum(p["cpu"] for p in procs.values())
    by_comm, by_file, apart = (collections.Counter() for _ in range(3))
    for pid, p in procs.items():
        by_comm[p["comm"]] += p["cpu"]
        if pid in tests:
            by_file["(the pytest workers themselves)"] += p["cpu"]
            continue
        chain = ancestors(pid)
        worker = next((a for a in chain if a in tests), None)
        test = test_at(tests[worker], p["start"]) if worker else None
        if test:
            by_file[test.split("::")[0]] += p["cpu"]
        else:
            root = chain[-1] if chain else pid
            apart[(root, procs[root]["comm"])] += p["cpu"]
    print(f"{len(procs)} processes, {total:.0f} CPU s; under a pytest worker "
          f"{sum(by_file.values()):.0f}, apart {sum(apart.values()):.0f}")
    print("\nCPU s by command")
    for comm, cpu in by_comm.most_common(args.top):
        print(f"{cpu:8.1f}  {comm}")
    print("\nCPU s by test file (processes under a worker)")
    for name, cpu in by_file.most_common(args.top):
        print(f"{cpu:8.1f}  {name}")
    print("\nCPU s apart from the workers, by oldest ancestor, with the tests running when it started")
    for (root, comm), cpu in apart.most_common(args.top):
        running = sorted({t for intervals in tests.values()
                          if (t := test_at(intervals, procs[root]["start"]))})
        print(f"{cpu:8.1f}  {comm} {root}: {'; '.join(running) or '-'}")


if __name__ == "__main__":
    main()
