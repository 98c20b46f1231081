"""The order in which pytest-xdist hands out test files: longest first.

`make test` runs the suite on four workers with `--dist loadfile`, one file at a time per worker.
xdist's default hands out the files with the most tests first, which is not the same as the
longest: the site build (test_site.py, 7 tests, about 3 minutes) came near the end and ran alone
while the other workers had finished. Handing out the longest files first (the classic
longest-processing-time rule) leaves only short files for the end.

The seconds per file come from a previous run, kept in file_seconds.json; a file that is not there
(a new one) counts as 0 and goes last, in the order pytest collected it. Refresh the table after a
large change with:

    python -m pytest -n 4 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/suite.xml
    python tests/schedule.py /tmp/suite.xml

Only the order changes: each file still runs on one worker, its tests in their own order.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list) -> None:
    """Sort pytest items in place by their file's seconds, longest first; stable within a file."""
    seconds = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    items.sort(key=lambda item: -seconds.get(file_of(item.nodeid), 0.0))


def seconds_per_file(junit_xml: str) -> dict[str, float]:
    """Seconds per test file from a JUnit XML report, keyed like pytest's node ids."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        classname = case.get("classname", "")
        # tests.test_site -> tests/test_site.py; docs.workshop.session-b.slides.md -> docs/workshop/session-b/slides.md
        path = (classname[:-3].replace(".", "/") + ".md" if classname.endswith(".md")
                else classname.replace(".", "/") + ".py")
        totals[path] += float(case.get("time", 0))
    return {path: round(s, 1) for path, s in sorted(totals.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(seconds_per_file(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {TABLE}")
