"""MkDocs hook: write measured numbers into a page's prose from the run that measured them.

A page writes `{{ bench:ddp_step_time.ratio_to_torch_ddp.naive:.2f }}` where it would have typed
`3.29`: `bench` names the record (`bench.json`, written by `make bench`), then comes the path of
keys inside its `results` (or from the top, for `date` and `machine.*`), dot-separated (a key may
hold spaces: `median_step_ms.bucketed 25MB`; a list takes an index), then, optionally, a Python
format spec after a colon (`.2f`, `,`, `.0%`), which may start with a unit the bytes are divided
by, `{{ bench:zero_memory.by_world_size.4.DDP.peak_bytes:MiB:.2f }}`, or a divisor,
`{{ bench:allreduce_bandwidth.world_2.sizes.0.ring.us:/1000:.2f }}` (microseconds as ms). So a new `make bench` rewrites the prose with the
tables, and a number on a page cannot drift from its run.

The scale planner is a second source, computed rather than recorded: `{{ planner:--model
llama-70b --dp 128 --tp 8 --sp|memory_bytes.total:GB:.1f }}` is what `python -m snippets.planner`
with those flags computes (its plan_training result, run in-process), then `|`, then the path of
a key in that result (`tokens_per_s`, `time_s.step`, `bubble_fraction`), or in `model`, `plan`
or `cluster`, the inputs the flags chose. Flags the planner refuses fail like a missing key.

The GPU section of bench.json (`make bench-gpu`, written on another machine) is shown as whole
tables: a line holding only `{{ gpu-table:throughput }}` (or `matmul`, `memory`, `fsdp`) becomes
the table, headed by the device, driver, torch and CUDA it ran on, or, while bench.json has no
GPU section, a line saying that no GPU run is recorded yet and the command that makes one. A
GPU number on a page therefore only ever comes from a real run.

A key that does not resolve is a warning naming the page and the key, which fails
`mkdocs build --strict`; the page shows the placeholder, marked. A placeholder inside a fenced
code block is refused the same way: the code-block runner (tests/codeblocks.py) reads the raw
Markdown, so it would run or compare the braces, not the number. tests/test_measured_numbers.py
resolves every placeholder of every page without a build.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import shlex
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"bench": ROOT / "bench.json"}  # record name -> JSON file, under the repository
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "kB": 1e3, "MB": 1e6, "GB": 1e9}
PLACEHOLDER = re.compile(r"\{\{\s*(\w+):([^{}:]+?)(?::([^{}]*?))?\s*\}\}")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
GPU_TABLE = re.compile(r"^\s*\{\{\s*gpu-table:\s*([\w-]+)\s*\}\}\s*$")

log = logging.getLogger("mkdocs.hooks.numbers")  # under "mkdocs", so --strict counts its warnings
_loaded: dict[Path, tuple[float, object]] = {}


def record(name: str):
    path = SOURCES[name]
    mtime = path.stat().st_mtime
    if path not in _loaded or _loaded[path][0] != mtime:
        _loaded[path] = (mtime, json.loads(path.read_text(encoding="utf-8")))
    return _loaded[path][1]


@lru_cache(maxsize=None)
def planned(flags: str) -> dict:
    """What the planner computes for these command-line flags, with its inputs."""
    from snippets.planner.__main__ import parse_args, plan_of
    from snippets.planner.cost_model import CLUSTERS, MODELS, PlannerError, plan_training

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_args(shlex.split(flags))
        model, plan, cluster = MODELS[args.model], plan_of(args), CLUSTERS[args.cluster]
        return {**plan_training(model, plan, cluster), "model": model, "plan": plan,
                "cluster": cluster}
    except SystemExit:
        raise KeyError(f"the planner refuses {flags!r}: {stderr.getvalue().strip()}") from None
    except PlannerError as e:
        raise KeyError(f"the planner refuses {flags!r}: {e}") from None


def resolve(source: str, key: str, spec: str | None = None) -> str:
    """The text a placeholder stands for; KeyError with the reason when it has none."""
    if source == "planner":
        flags, bar, key = key.partition("|")
        if not bar:
            raise KeyError("write {{ planner:<flags>|<key>[:format] }}")
        roots, name = [planned(flags.strip())], f"the planner's result for {flags.strip()!r}"
    elif source in SOURCES:
        data = record(source)
        roots = [data.get("results", {}), data] if isinstance(data, dict) else [data]
        name = SOURCES[source].name
    else:
        raise KeyError(f"unknown record {source!r} (known: {', '.join(SOURCES)}, planner)")
    for value in roots:
        try:
            for part in key.strip().split("."):
                value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            continue
        if isinstance(value, (dict, list)):
            raise KeyError(f"{source}:{key} is a {type(value).__name__}, not a number")
        spec = (spec or "").strip()
        unit, _, rest = spec.partition(":")
        divisor = UNITS.get(unit) or (float(unit[1:]) if re.fullmatch(r"/\d+(\.\d*)?", unit) else None)
        if divisor and isinstance(value, (int, float)):
            value, spec = value / divisor, rest
        try:
            return format(value, spec) if spec else str(value)
        except ValueError as e:
            raise KeyError(f"{source}:{key} cannot take the format {spec!r}: {e}") from None
    raise KeyError(f"{name} has no key {key.strip()!r}")


def gpu_table(name: str) -> str:
    """The Markdown of one GPU table, or the line saying no GPU run is recorded yet."""
    from snippets.bench.gpu_tables import gpu_table as render

    data = record("bench")
    return render(data.get("results", {}).get("gpu") if isinstance(data, dict) else None, name)


def substitute(markdown: str, where: str) -> tuple[str, list[str]]:
    """The page with its placeholders filled in, and one message per placeholder that failed."""
    out, errors, fence = [], [], None
    for number, line in enumerate(markdown.splitlines(keepends=True), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)[0]
        elif fence is not None and opened and opened.group(1)[0] == fence:
            fence = None
        elif fence is not None:
            if PLACEHOLDER.search(line) or GPU_TABLE.match(line):
                errors.append(f"{where}:{number}: a measured-number placeholder inside a code block "
                              f"(the code-block runner would see the braces); move it to the prose")
            out.append(line)
            continue

        def fill(m: re.Match) -> str:
            try:
                return resolve(m.group(1), m.group(2), m.group(3))
            except KeyError as e:
                errors.append(f"{where}:{number}: {m.group(0)}: {e.args[0]}")
                return f"**[missing: {m.group(0)[2:-2].strip()}]**"

        table = GPU_TABLE.match(line)
        if table:
            indent = line[:len(line) - len(line.lstrip())]  # inside an admonition or a tab
            try:
                out.append("".join(indent + row if row.strip() else row for row in
                                   gpu_table(table.group(1)).splitlines(keepends=True)))
            except (KeyError, TypeError) as e:  # TypeError: a gpu section of another shape
                errors.append(f"{where}:{number}: {line.strip()}: {e!r}")
                out.append(line)
            continue
        out.append(PLACEHOLDER.sub(fill, line))
    return "".join(out), errors


def on_page_markdown(markdown, page, config, files):
    text, errors = substitute(markdown, page.file.src_uri)
    for message in errors:
        log.warning(message)
    return text
