"""Merge per-rank logs into one timeline: what every rank did, in time order.

    torchrun --nproc_per_node=2 snippets/scripts/ddp_simulation_train.py --max-steps 3
    python -m snippets.cluster.merge_logs logs               # the merged timeline
    python -m snippets.cluster.merge_logs logs --last        # each rank's last line: who stopped?

Each rank of snippets/scripts/ddp_simulation_train.py writes logs/rank_N/train.log with lines
like `12:00:03 rank 1 | step   2 | local loss ...`. On a cluster these files sit on many nodes;
copied (or written) to one place, this tool interleaves them by timestamp. Lines without a
timestamp (a traceback's continuation lines) stay with the line above them and get the rank
prefix too, so every line of the output says which rank wrote it.

Timestamps are only as good as the nodes' clocks: keep them synchronised (NTP/chrony), or
ranks on a node whose clock runs ahead appear to act early.
"""

from __future__ import annotations

import argparse
import heapq
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(r"^(?P<time>\d{2}:\d{2}:\d{2}(?:[.,]\d+)?) rank (?P<rank>\d+) \| (?P<msg>.*)$")
RANK_DIR = re.compile(r"^rank_(\d+)$")


@dataclass(frozen=True, order=True)
class Entry:
    seconds: float  # since midnight of the file's first day (a run across midnight keeps going)
    rank: int
    order: int  # position in its file: lines of one rank never change order
    time: str
    text: str

    def __str__(self) -> str:
        return f"{self.time} rank {self.rank} | {self.text}"


def _seconds(stamp: str) -> float:
    h, m, s = stamp.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


# --8<-- [start:read]
def read_rank_log(path: str | Path, rank: int) -> list[Entry]:
    """One rank's entries, in file order. Continuation lines inherit the previous timestamp."""
    entries, day, last, time = [], 0.0, None, "--:--:--"
    for i, line in enumerate(Path(path).read_text(errors="replace").splitlines()):
        m = LINE.match(line)
        if m:
            seconds = _seconds(m["time"]) + day
            if last is not None and seconds < last - 12 * 3600:  # clock went past midnight
                day += 86400
                seconds += 86400
            last, time, text = seconds, m["time"], m["msg"]
            if int(m["rank"]) != rank:
                raise ValueError(f"{path}:{i + 1} says rank {m['rank']}, but the file is rank "
                                 f"{rank}'s (rank_{rank}/): logs from two runs mixed?")
        else:  # e.g. a traceback printed into the log
            text = line
        entries.append(Entry(last if last is not None else 0.0, rank, i, time, text))
    return entries


def merge_rank_logs(log_dir: str | Path, filename: str = "train.log") -> list[Entry]:
    """All ranks' entries from LOG_DIR/rank_N/FILENAME, merged by time (ties: by rank)."""
    log_dir = Path(log_dir)
    files = sorted((int(m.group(1)), d / filename) for d in log_dir.iterdir()
                   if (m := RANK_DIR.match(d.name)) and (d / filename).is_file()) \
        if log_dir.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no {log_dir}/rank_N/{filename} files: run a job that writes "
                                "per-rank logs first (snippets/scripts/ddp_simulation_train.py)")
    # Each file is already in time order, so a k-way merge is enough (no global sort).
    return list(heapq.merge(*(read_rank_log(path, rank) for rank, path in files)))
# --8<-- [end:read]


# --8<-- [start:last]
def last_line_per_rank(entries: list[Entry]) -> dict[int, Entry]:
    """The last thing each rank logged: in a hang, the rank that stopped early stands out."""
    last = {}
    for entry in entries:
        last[entry.rank] = entry
    return dict(sorted(last.items()))
# --8<-- [end:last]


def main(argv=None) -> None:
    from snippets.flags import Parser

    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log_dir", help="the directory holding rank_0/, rank_1/, ...")
    p.add_argument("--file", default="train.log", help="log file name inside each rank_N/")
    p.add_argument("--out", type=Path, help="also write the merged timeline to this file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--last", action="store_true", help="print only each rank's last line")
    args = p.parse_args(argv)
    out = args.out
    if out and RANK_DIR.match(out.resolve().parent.name) and out.name == args.file \
            and out.resolve().parent.parent == Path(args.log_dir).resolve():
        p.error(f"--out {out} is one of the logs it reads: choose a file outside {args.log_dir}")
    if out and out.exists() and not args.overwrite:
        p.error(f"--out {out} exists: pass another --out, or --overwrite to replace it")
    try:
        entries = merge_rank_logs(args.log_dir, args.file)
    except FileNotFoundError as err:
        p.error(str(err))
    lines = [str(e) for e in (last_line_per_rank(entries).values() if args.last else entries)]
    print("\n".join(lines))
    if out:  # written whole, then renamed: never half a timeline
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
