"""Every measured number in a page's prose has a source.

A measured number is bound to its run in one of four ways, and this test accepts exactly those:

1. it is a placeholder, `{{ bench:key.path:.2f }}`, filled in at build time from the run's record
   by docs/_hooks/measured_numbers.py (this test resolves every placeholder, so a missing key fails
   here as well as in `mkdocs build --strict`);
2. it sits inside a code block: the suite runs it, and checks it when it is an expected-output
   block (README, "markers"), or the prose quotes a number that appears in such a checked block on
   the same page;
3. its paragraph (or list item) cites a source: a link to a published page, for figures such as
   a GPU's datasheet peak or a paper's measured MFU;
4. it is listed in tests/measured_numbers_allowlist.txt, with what it is: a `constant` (a formula's
   value, a setting, a specification, not a measurement), `checked` (a value another test asserts
   against its source, named there) or `todo` (measured, not yet bound: the list of what is left,
   which only shrinks).

What counts as a measured number is a cheap, explicit list of phrasings (MEASURED): a number with
a unit of time, a rate (tokens/s, FLOP/s, GB/s), a ratio or a size written with a decimal point
(`1.74×`, `3.15 MB`), a percentage; inline code, math and HTML comments are not prose. Words
carry the rest ("44 distinct bytes", "526 steps"): those were removed by hand, page by page.

`MEASURED_NUMBERS_REGEN=1 pytest tests/test_measured_numbers.py` appends the phrases it finds
unsourced to the allow-list as `todo: unreviewed`, for review in the diff.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel_independent("where each number in the prose comes from: text")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ALLOWLIST = ROOT / "tests" / "measured_numbers_allowlist.txt"

_spec = importlib.util.spec_from_file_location("measured_numbers_hook",
                                               DOCS / "_hooks" / "measured_numbers.py")
hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook)

NUM = r"(?<![\w.,/-])\d[\d,]*(?:\.\d+)?"
DEC = r"(?<![\w.,/-])\d[\d,]*\.\d+"
MEASURED = re.compile(
    rf"(?:{NUM})\s*(?:ms|µs|us|s|sec|seconds?|minutes?|min|h|hours?)(?![\w/])"  # times
    rf"|(?:{NUM})\s*(?:tokens?/s|tok/s|samples/s|steps/s|it/s|[kMGTP]?FLOP/?s|[GT]FLOPS"
    rf"|[KMGT]i?B/s|[MG]bit/s|Gb/s)(?!\w)"  # rates
    rf"|(?:{DEC})\s*(?:×|x|[KMGT]i?B|kB|nats?|bits?)(?![\w/])"  # ratios, sizes, losses
    rf"|(?:{NUM})\s*%"  # percentages
)
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
EXPECTED = re.compile(r"<!--[-\s]*pytest-codeblocks:expected-output")
NOT_PROSE = re.compile(r"`[^`\n]*`|\\\(.*?\\\)|\\\[.*?\\\]|\$[^$\n]+\$|<!--.*?-->", re.S)
CITATION = re.compile(r"\]\(https?://|<https?://")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s|^\s*\|")  # a list item or a table row starts a chunk
FLOAT = re.compile(r"\d[\d,]*\.\d+|\d[\d,]*")


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts and p.is_file())


def lesson_prose(path: Path) -> str:
    """The markdown cells of a jupytext percent-format lesson, `# ` stripped."""
    out, markdown = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            markdown = "[markdown]" in line
            out.append("")
        elif markdown:
            out.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
        else:
            out.append("")  # code: kept as a blank line, so line numbers are the file's
    return "\n".join(out)


def split(text: str) -> tuple[list[tuple[int, str]], set[str]]:
    """(line number, prose chunk) pairs, and the numbers written in the page's checked
    expected-output blocks."""
    chunks, current, checked = [], [], set()
    fence, expecting, in_expected = None, False, False
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence, in_expected = opened.group(1)[0], expecting
            if current:
                chunks.append((start, "\n".join(current)))
                current = []
            continue
        if fence is not None:
            if opened and opened.group(1)[0] == fence:
                fence = None
            elif in_expected:
                checked.update(FLOAT.findall(line))
            continue
        if EXPECTED.search(line):
            expecting = True
            continue
        if line.strip():
            expecting = False
        if not line.strip() or ITEM.match(line):
            if current:
                chunks.append((start, "\n".join(current)))
            current, start = ([line], number) if line.strip() else ([], number)
        else:
            if not current:
                start = number
            current.append(line)
    if current:
        chunks.append((start, "\n".join(current)))
    return chunks, checked


def unsourced(text: str) -> list[tuple[int, str]]:
    """(line, phrase) for every measured number in the prose with none of sources 1-3."""
    found = []
    chunks, checked = split(text)
    for line, chunk in chunks:
        prose = hook.PLACEHOLDER.sub("", NOT_PROSE.sub(" ", chunk))
        if CITATION.search(chunk):
            continue
        for m in MEASURED.finditer(prose):
            value = FLOAT.match(m.group(0)).group(0)
            if value in checked:
                continue
            found.append((line, " ".join(m.group(0).split())))
    return found


def sources() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in pages()}
    for lesson in sorted((ROOT / "lessons_src").glob("*.py")):
        texts[str(lesson.relative_to(ROOT))] = lesson_prose(lesson)
    return texts


def read_allowlist() -> dict[tuple[str, str], str]:
    allowed = {}
    for raw in ALLOWLIST.read_text(encoding="utf-8").splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        page, phrase, why = (part.strip() for part in raw.split("\t"))
        assert why.split(":")[0] in {"constant", "checked", "todo"}, f"allow-list line needs a kind: {raw!r}"
        allowed[(page, phrase)] = why
    return allowed


def test_every_placeholder_resolves_and_sits_in_prose():
    errors = []
    for page, text in sources().items():
        errors += hook.substitute(text, page)[1]
    assert not errors, "\n".join(errors)


def test_every_measured_number_has_a_source():
    allowed = read_allowlist()
    missing, seen = defaultdict(list), set()
    for page, text in sources().items():
        for line, phrase in unsourced(text):
            seen.add((page, phrase))
            if (page, phrase) not in allowed:
                missing[page].append(f"{page}:{line}: {phrase}")
    if missing and os.environ.get("MEASURED_NUMBERS_REGEN"):
        with ALLOWLIST.open("a", encoding="utf-8") as f:
            for page, hits in missing.items():
                for phrase in dict.fromkeys(h.split(": ", 1)[1] for h in hits):
                    f.write(f"{page}\t{phrase}\ttodo: unreviewed\n")
    stale = sorted(f"{p}\t{phrase}" for (p, phrase) in allowed if (p, phrase) not in seen)
    lines = [h for hits in missing.values() for h in hits]
    assert not lines, (
        "measured numbers in prose with no source; render them from bench.json "
        "({{ bench:key.path:.2f }}, docs/_hooks/measured_numbers.py), quote a checked "
        "expected-output block, cite the published figure, or, for a constant that is not a "
        "measurement, list it in tests/measured_numbers_allowlist.txt with what it is:\n"
        + "\n".join(lines))
    assert not stale, ("allow-list entries no page states any more; delete them from "
                       "tests/measured_numbers_allowlist.txt:\n" + "\n".join(stale))


@pytest.mark.parametrize("text, flagged", [
    ("Naive DDP takes 1.74× as long.", ["1.74×"]),
    ("A step takes 23.5 ms here, 12,149 tokens/s.", ["23.5 ms", "12,149 tokens/s"]),
    ("The loss reaches 1.95 nats after 4 s, 23% of the budget.", ["1.95 nats", "4 s", "23%"]),
    ("Naive DDP takes {{ bench:ddp_step_time.ratio_to_torch_ddp.naive:.2f }}× as long.", []),
    ("Peak 989 TFLOP/s ([datasheet](https://www.nvidia.com/en-us/data-center/h100/)).", []),
    ("`--timeout 1.5 s` and \\(2.5\\,\\text{ms}\\) are not prose.", []),
    ("```text\n3.5 ms\n```\n", []),
    ("<!--pytest-codeblocks:expected-output-->\n```text\nstep 4.25 ms\n```\n\nIt took 4.25 ms.", []),
    ("```text\nstep 4.25 ms\n```\n\nIt took 4.25 ms.", ["4.25 ms"]),  # shown, not checked
])
def test_the_scanner(text, flagged):
    assert [phrase for _, phrase in unsourced(text)] == flagged
