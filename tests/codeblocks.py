"""pytest plugin: run every fenced code block of every page in docs/.

Loaded with `-p tests.codeblocks` (pyproject.toml's addopts). For each `docs/**/*.md` it

1. reads the page's blocks and their markers with pytest-codeblocks' own parser, so the markers mean
   what they mean there: `<!--pytest-codeblocks:cont-->`, `<!--pytest-codeblocks:expected-output-->`,
   `<!--pytest.mark.skip(reason="...")-->`, `<!--pytest.mark.skipif(condition, reason="...")-->`.
   Markers that would let a block escape or pass without running are refused with the fix
   (`check_page`): `skipfile`, `expect-error`/`expect-exception` and `xfail` (a failing block would
   count as a pass), `importorskip` (every dependency is pinned: a missing one is a failure), the
   deprecated reason-less `pytest-codeblocks:skip`/`skipif`, and any unknown `pytest.mark.*`.
   Code this runner would not see is refused too: `~~~` fences, and indented code blocks (the page
   is rendered with the site's own Markdown settings, and every `<pre>` in it must come from a
   fence the runner read);
2. expands the `--8<--` includes inside each block with pymdownx.snippets' own preprocessor,
   configured from mkdocs.yml, so the test runs exactly the code the site shows;
3. takes the first word of the fence's info string as the language, so
   ```` ```python title="snippets/x.py" ```` runs (pytest-codeblocks' stock plugin skips it);
4. runs python blocks with the project's interpreter and bash/sh blocks with `bash -e -o pipefail`,
   both from the repository root, as a reader would; parses json/yaml/toml blocks.

Four markers are this project's own:
`<!--pytest.mark.cuda(reason="...")-->` runs the block only where CUDA is present (`make test-gpu`);
`<!--pytest.mark.torchtitan(reason="...")-->` runs the block only in `make test-torchtitan`
(REQUIRE_TORCHTITAN=1, with the extra in .venv-torchtitan; a missing extra fails there);
`<!--pytest.mark.excerpt-->` marks a block that only includes part of a module (a method, a
class): it is checked by importing (python) or syntax-checking (bash) the file it comes from, and by
the tests of that module; `<!--pytest-codeblocks:expected-output(rtol=R, atol=A)-->` compares the
output with the page's text where every number written with a decimal point or an exponent may
differ by at most `atol + rtol * |page's value|`, and everything else (words, integers) must match
exactly (`compare_output`). The page states the bound and why next to the block.

A block in any other language, or with none, fails unless it is `text` or `mermaid` (shown, not
code) or carries a skip marker with a reason. The run ends with a count of blocks executed, checked,
shown and skipped (with each reason).
"""

from __future__ import annotations

import difflib
import functools
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest
from pytest_codeblocks.main import extract_from_buffer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DATA_LANGS = {"json", "yaml", "yml", "toml"}
SHOWN_LANGS = {"text", "mermaid", "markdown", "md"}
TIMEOUT_S = int(os.environ.get("CODEBLOCK_TIMEOUT", "600"))
IMPORTED: dict = {}  # (module, mtime) -> None if its import succeeded, else the error
IMPORT_ONE = """
import importlib, json, sys, traceback
results = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
print("IMPORT-RESULTS " + json.dumps(results))
"""
INCLUDE = re.compile(r"""^\s*-{1,}8<-{1,}\s+["']([^"']+)["']\s*$""")
OUTPUT_TAIL = 6000  # characters of stdout/stderr shown for a failing block
MARKER = re.compile(r"^(\s*)<!--[-\s]*pytest-codeblocks:(.*?)[-\s]*-->\s*$")
MARK = re.compile(r"^\s*<!--[-\s]*pytest\.mark\.(\w+)")
ALLOWED_MARKS = {"skip", "skipif", "cuda", "torchtitan", "excerpt"}
TOLERANCE = re.compile(r"^expected-output\((.*)\)$")
# A number with a decimal point or an exponent (a measured value); integers are counts and ids.
FLOAT = re.compile(r"[-+]?(?:\d[\d,]*\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][-+]?\d+)?")
REFUSED = {
    "skipfile": "skips every block of the page; mark the blocks that cannot run, each with "
                '<!--pytest.mark.skip(reason="...")-->',
    "expect-error": "counts a failing block as a pass; let the block catch and print the error "
                    "and check that with <!--pytest-codeblocks:expected-output-->",
    "expect-exception": "counts a failing block as a pass; let the block catch and print the error "
                        "and check that with <!--pytest-codeblocks:expected-output-->",
    "importorskip": "turns a missing dependency into a skip; every dependency is pinned in "
                    "pyproject.toml, so import it and let a missing one fail",
    "skip": 'has no reason; write <!--pytest.mark.skip(reason="why it cannot run here")-->',
    "skipif": 'has no reason; write <!--pytest.mark.skipif(condition, reason="...")-->',
}

# nodeid -> what kind of block it is, for the end-of-run count
_KIND: dict[str, str] = {}
_WHERE: dict[str, tuple] = {}
_OUTCOMES: dict[str, str] = {}
_SKIPS: dict[str, tuple] = {}
_SHOWN: set[str] = set()


# Code typed into a page (not included from snippets/) is usage: calls, prints, a loop. A definition
# belongs in a module, where the tests import it and a reader can run it; a longer block is a
# program that belongs there too. The longest typed Python block on the pages has 10 lines.
TYPED_PYTHON_MAX_LINES = 12
DEFINITION = re.compile(r"^\s*(?:async\s+def|def|class)\s+(\w+)")


def check_typed_python(raw_code: str, where) -> None:
    """Refuse a Python block whose typed lines define a function or class, or run long."""
    typed = [line for line in raw_code.splitlines() if line.strip() and not INCLUDE.match(line)]
    defined = [m.group(1) for line in typed if (m := DEFINITION.match(line))]
    if defined:
        raise BlockError(f"{where}: this block defines {', '.join(defined)} in the page; move it "
                         "into a module in snippets/ and include it with --8<--")
    if len(typed) > TYPED_PYTHON_MAX_LINES:
        raise BlockError(f"{where}: {len(typed)} lines of Python typed into the page (at most "
                         f"{TYPED_PYTHON_MAX_LINES}); move the code into a module in snippets/ "
                         "and include it, or call it, from the page")


class BlockError(Exception):
    """A block failed; the message is shown as the test's failure, without a traceback."""


def snippet_preprocessor():
    """pymdownx.snippets' preprocessor with the options mkdocs.yml gives it."""
    return site_markdown().preprocessors["snippet"]


def expand(code: str) -> str:
    lines = snippet_preprocessor().run(code.splitlines())
    return "\n".join(lines) + ("\n" if lines else "")


def language(syntax: str | None) -> str:
    if not syntax:
        return ""
    return syntax.split()[0].lstrip("{.").rstrip("}").lower()


def included_files(raw_code: str) -> list[Path]:
    files = []
    for line in raw_code.splitlines():
        m = INCLUDE.match(line)
        if m:
            files.append(ROOT / m.group(1).split(":", 1)[0])
    return files


def reader_env() -> dict:
    env = dict(os.environ)
    # `python`, `torchrun`, `mkdocs` in a block resolve to the project's environment, as they do
    # for a reader who activated .venv.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_process(cmd: list[str], where: str, code: str) -> str:
    """Run a block's process in its own process group; return stdout, raise BlockError on failure."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=reader_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        status = f"exited with status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"did not finish in {TIMEOUT_S} s (CODEBLOCK_TIMEOUT) and was killed"
    finally:
        try:  # whatever the block started in the background (torchrun workers, servers) ends too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode != 0 or "killed" in status:
        raise BlockError(
            f"{where} {status}\n"
            f"----- code -----\n{code.rstrip()}\n"
            f"----- stdout -----\n{out[-OUTPUT_TAIL:].rstrip()}\n"
            f"----- stderr -----\n{err[-OUTPUT_TAIL:].rstrip()}"
        )
    return out


def outside_fence_includes(text: str) -> list[tuple[int, str]]:
    """Include lines outside code fences: the code they bring in would escape this runner."""
    found, fence = [], None
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith("```"):
            fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is None and INCLUDE.match(line):
            found.append((lineno, line.strip()))
    return found


def parse_tolerance(args: str, where: str) -> tuple[float, float]:
    """`rtol=0.01, atol=1e-3` -> (0.01, 0.001); anything else is the marker's error."""
    found = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, _, value = part.partition("=")
        try:
            if key.strip() not in {"rtol", "atol"} or key.strip() in found:
                raise ValueError
            found[key.strip()] = float(value)
            if not 0 <= found[key.strip()] < 1:
                raise ValueError
        except ValueError:
            raise BlockError(
                f"{where}: expected-output({args}): write expected-output(rtol=R) and/or atol=A, "
                "each a number in [0, 1)") from None
    if not found:
        raise BlockError(f"{where}: expected-output(): give rtol=R and/or atol=A")
    return found.get("rtol", 0.0), found.get("atol", 0.0)


def check_page(text: str, where) -> tuple[str, list]:
    """Refuse what would let code escape the runner; return the text for pytest-codeblocks' parser
    (tolerance markers turned into plain expected-output markers, same line numbers) and, for each
    expected-output marker in page order, its (rtol, atol) or None."""
    lines, tolerances, fence = text.splitlines(keepends=True), [], None
    for i, line in enumerate(lines):
        lineno, stripped = i + 1, line.strip()
        ticks = len(stripped) - len(stripped.lstrip("`"))
        if fence is not None:
            if ticks >= fence and not stripped.strip("`"):
                fence = None
            continue
        if ticks >= 3:
            fence = ticks
            continue
        if stripped.startswith("~~~"):
            raise BlockError(f"{where}:{lineno}: a ~~~ fence: this runner reads only ``` fences, "
                             "so its code would never run; write the fence with backticks")
        marker = MARKER.match(line)
        if marker:
            indent, keyword = marker.groups()
            name = re.split(r"[\s(]", keyword, maxsplit=1)[0]
            if name in REFUSED:
                raise BlockError(f"{where}:{lineno}: <!--pytest-codeblocks:{keyword}--> "
                                 f"{REFUSED[name]}")
            tolerance = TOLERANCE.match(keyword)
            if tolerance:
                tolerances.append(parse_tolerance(tolerance.group(1), f"{where}:{lineno}"))
                lines[i] = f"{indent}<!--pytest-codeblocks:expected-output-->\n"
            elif name.startswith("expected-output"):
                tolerances.append(None)
        mark = MARK.match(line)
        if mark and mark.group(1) not in ALLOWED_MARKS:
            why = ("counts a failing block as a pass" if mark.group(1) == "xfail"
                   else "is not a marker this runner knows")
            raise BlockError(f"{where}:{lineno}: <!--pytest.mark.{mark.group(1)}...--> {why}; "
                             f"use one of {', '.join(sorted(ALLOWED_MARKS))}")
    return "".join(lines), tolerances


def fences(text: str) -> int:
    """How many ``` fences the page holds (a fence inside a longer fence is its content)."""
    count, fence = 0, None
    for line in text.splitlines():
        stripped = line.strip()
        ticks = len(stripped) - len(stripped.lstrip("`"))
        if fence is None and ticks >= 3:
            fence, count = ticks, count + 1
        elif fence is not None and ticks >= fence and not stripped.strip("`"):
            fence = None
    return count


@functools.cache
def site_markdown():
    """Python-Markdown with the site's own extensions and settings (mkdocs.yml's
    markdown_extensions, after the three MkDocs always adds). Read from the YAML alone:
    mkdocs' load_config would also import every plugin and hook (Jupyter, the planner), 2-5 s
    in each pytest process, for nothing the Markdown needs."""
    import markdown
    from mkdocs.utils.yaml import yaml_load

    with open(ROOT / "mkdocs.yml", encoding="utf-8") as f:
        listed = yaml_load(f)["markdown_extensions"]
    names, configs = ["toc", "tables", "fenced_code"], {}
    for item in listed:
        name, config = next(iter(item.items())) if isinstance(item, dict) else (item, None)
        if name not in names:
            names.append(name)
        configs[name] = dict(config or {})
    snippets = configs.setdefault("pymdownx.snippets", {})
    snippets["base_path"] = [str(ROOT / p) for p in snippets.get("base_path", ["."])]
    return markdown.Markdown(extensions=names, extension_configs=configs)


def check_rendered_code(text: str, where):
    """Every code box the site shows must come from a ``` fence: an indented code block (four
    spaces after a blank line, outside a list, admonition or tab) is shown as code on the site but
    never seen by the parser above."""
    try:
        html = site_markdown().reset().convert(text)
    except Exception:  # noqa: BLE001 - e.g. a missing --8<-- section: the block that includes it
        return  # fails when it runs, with the include named; the site build fails on it too
    shown, fenced = html.count("<pre"), fences(text)
    if shown != fenced:
        raise BlockError(
            f"{where}: the site renders {shown} code blocks but the page has {fenced} ``` fences: "
            "an indented code block (4 spaces after a blank line) is shown as code and never run. "
            "Put it in a ``` fence with its language, or indent it under the list item, "
            "admonition or tab it belongs to.")


def compare_output(expected: str, got: str, rtol: float, atol: float) -> list[str]:
    """The differences between a block's output and the page's text, [] when they agree: numbers
    with a decimal point or exponent within atol + rtol * |expected|, all other text exactly."""
    exp_numbers, got_numbers = FLOAT.findall(expected), FLOAT.findall(got)
    if FLOAT.sub("#", expected) != FLOAT.sub("#", got) or len(exp_numbers) != len(got_numbers):
        return ["the text around the numbers differs"]
    problems = []
    for e, g in zip(exp_numbers, got_numbers):
        ev, gv = float(e.replace(",", "")), float(g.replace(",", ""))
        bound = atol + rtol * abs(ev)
        if abs(gv - ev) > bound:
            problems.append(f"page {e}, got {g}: differs by {abs(gv - ev):.3g} > bound {bound:.3g}")
    return problems


EXCERPT_MODULES: set = set()  # the modules the collected pages' excerpt blocks include from


def import_modules(modules) -> None:
    """Import the modules in one fresh process; record each one's success or error."""
    names = sorted(modules)
    proc = subprocess.run([sys.executable, "-c", IMPORT_ONE, *names], cwd=ROOT, env=reader_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    found = [line for line in proc.stdout.splitlines() if line.startswith("IMPORT-RESULTS ")]
    results = json.loads(found[-1].removeprefix("IMPORT-RESULTS ")) if found else {}
    for name in names:
        path = module_file(name)
        if path is not None:
            # Not in the results (the process died): marked failed, so it is imported alone.
            IMPORTED[(name, path.stat().st_mtime_ns)] = results.get(name, "not imported")


def module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
    return path if path.is_file() else None


def pytest_addoption(parser):
    parser.addoption(
        "--codeblocks-docs", default=str(DOCS), metavar="DIR",
        help="run the code blocks of the Markdown pages under DIR (default: docs/)",
    )


def pytest_collect_file(file_path: Path, parent):
    docs = Path(parent.config.getoption("codeblocks_docs")).resolve()
    if file_path.suffix == ".md" and docs in file_path.parents:
        return MarkdownPage.from_parent(parent, path=file_path)
    return None


class MarkdownPage(pytest.File):
    def collect(self):
        text = self.path.read_text(encoding="utf-8")
        where = self.path.relative_to(ROOT) if ROOT in self.path.parents else self.path
        for lineno, line in outside_fence_includes(text):
            if "```" in expand(line):
                raise BlockError(
                    f"{where}:{lineno}: `{line}` includes code fences from outside a fence; the "
                    "runner cannot see them. Put the include inside the page's own fence."
                )
        parsed, tolerances = check_page(text, where)
        try:
            blocks = extract_from_buffer(io.StringIO(parsed))
        except RuntimeError as e:
            raise BlockError(f"{where}: {e}") from None
        checked = [block for block in blocks if block.expected_output is not None]
        assert len(checked) == len(tolerances), (where, len(checked), len(tolerances))
        for block, tolerance in zip(checked, tolerances):
            block.tolerance = tolerance

        shown, items = [], []
        for block in blocks:
            lang = language(block.syntax)
            marks = [eval(m, {"sys": sys, "os": os, "pytest": pytest}) for m in block.marks]
            names = {m.name for m in marks}
            for m in marks:
                if m.name in {"skip", "skipif"} and not m.kwargs.get("reason"):
                    raise BlockError(
                        f"{where}:{block.lineno}: <!--pytest.mark.{m.name}(...)--> needs a reason: "
                        f'write <!--pytest.mark.{m.name}(reason="why it cannot run here")-->'
                    )
            if block.expected_output is not None and names & {"skip", "skipif", "excerpt"}:
                # pytest-codeblocks attaches an output to the block before it: after a block
                # that never runs, the output is shown and compared with nothing.
                raise BlockError(
                    f"{where}:{block.lineno}: this block is {', '.join(sorted(names))}, so the "
                    "expected-output block after it is never compared; move the output (and its "
                    "marker) right after the block that prints it"
                )
            if "excerpt" in names:
                kind = "excerpt"
                EXCERPT_MODULES.update(
                    ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    for path in included_files(block.code)
                    if path.suffix == ".py" and path.is_file() and ROOT in path.parents)
            elif lang in RUN_LANGS:
                kind = "run"
                if RUN_LANGS[lang] == "python":
                    check_typed_python(block.code, f"{where}:{block.lineno}")
            elif lang in DATA_LANGS:
                kind = "data"
            elif lang in SHOWN_LANGS and not marks:
                shown.append(f"{where}:{block.lineno}")
                continue
            elif names & {"skip", "skipif"}:
                kind = "other"  # a language the runner cannot run, skipped with its reason
            else:
                kind = "unrunnable"
            item = CodeBlock.from_parent(self, name=f"line {block.lineno} [{lang or 'no language'}]")
            item.block, item.lang, item.kind = block, lang, kind
            item.where = f"{where}:{block.lineno}"
            for m in marks:
                item.add_marker(m)
            # Reports carry these back to the controller under pytest-xdist, which collects
            # nothing itself.
            item.user_properties.append(("codeblock", (kind, str(where), block.lineno)))
            items.append(item)
        for item in items:
            item.user_properties.append(("codeblock_shown", shown))
        _SHOWN.update(shown)
        # Rendering the page with the site's extensions takes 30-300 ms, about 4 s for all pages:
        # an item of its own runs it once, where a check during collection would run it on every
        # pytest-xdist worker (each collects every page).
        rendered = RenderedPage.from_parent(self, name="rendered code boxes")
        rendered.text, rendered.where = text, where
        yield rendered
        yield from items


class RenderedPage(pytest.Item):
    """The page as the site renders it shows no more code boxes than it has ``` fences."""
    text = where = None

    def runtest(self):
        check_rendered_code(self.text, self.where)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, BlockError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"rendered code boxes of {self.where}"


class CodeBlock(pytest.Item):
    block = lang = kind = where = None

    def runtest(self):
        block = self.block
        if self.kind in ("unrunnable", "other"):  # "other" reaches here only unskipped
            raise BlockError(
                f"{self.where}: a ```{self.lang or ''} block is neither run nor marked. Use a "
                f"language the runner executes ({', '.join(sorted(RUN_LANGS))}) or checks "
                f"({', '.join(sorted(DATA_LANGS))}), `text`/`mermaid` for output and diagrams, or "
                '<!--pytest.mark.skip(reason="...")--> before the fence.'
            )
        code = expand(block.code)
        if self.kind == "excerpt":
            return self.check_excerpt(block.code)
        if self.kind == "data":
            return self.parse_data(code)

        if RUN_LANGS[self.lang] == "python":
            # The script is named after the block (tracebacks then say where it came from) and
            # removed with its directory afterwards: thousands of runs must not litter /tmp.
            with tempfile.TemporaryDirectory(prefix="codeblock-") as tmp:
                script = Path(tmp) / (re.sub(r"\W", "_", self.where) + ".py")
                script.write_text(code)
                out = run_process([sys.executable, str(script)], f"{self.where} (python)", code)
        else:
            out = run_process(["bash", "-e", "-o", "pipefail", "-c", code], f"{self.where} (bash)",
                              code)

        if block.expected_output is not None:
            expected = expand(block.expected_output)
            got = out
            if block.expected_output_ignore_whitespace:
                expected, got = re.sub(r"\s+", "", expected), re.sub(r"\s+", "", got)
            tolerance = getattr(block, "tolerance", None)
            if tolerance is None:
                problems = []
            else:
                problems = compare_output(expected, got, *tolerance)
            if problems or (tolerance is None and expected != got):
                diff = "".join(difflib.unified_diff(
                    expected.splitlines(True), out.splitlines(True), "page", "got"))
                within = "" if tolerance is None else f" (rtol={tolerance[0]}, atol={tolerance[1]})"
                raise BlockError(f"{self.where}: output differs from the page{within}\n"
                                 + "\n".join(problems) + f"\n{diff}")

    def parse_data(self, code: str):
        try:
            if self.lang == "json":
                json.loads(code)
            elif self.lang == "toml":
                tomllib.loads(code)
            else:
                import yaml

                list(yaml.safe_load_all(code))
        except Exception as e:  # noqa: BLE001 - any parse error is the block's failure
            raise BlockError(f"{self.where}: this {self.lang} block does not parse: {e}") from None

    def check_excerpt(self, raw_code: str):
        lines = [line for line in raw_code.splitlines() if line.strip()]
        if not lines or not all(INCLUDE.match(line) for line in lines):
            raise BlockError(
                f"{self.where}: an excerpt block may only hold --8<-- includes; code typed into a "
                "page must run on its own (drop <!--pytest.mark.excerpt-->)."
            )
        for path in included_files(raw_code):
            if path.suffix == ".py":
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                # Pages show parts of 55 modules: import all those of the collected pages in one
                # fresh process, the first time any is needed, instead of paying a torch import for each (a
                # changed file is imported again). A module that fails there is imported once
                # more alone, so another module's import cannot have caused or hidden it.
                key = (module, path.stat().st_mtime_ns)
                if key not in IMPORTED:
                    import_modules(EXCERPT_MODULES | {module})
                if IMPORTED.get(key) is not None:
                    run_process([sys.executable, "-c", f"import {module}"],
                                f"{self.where} (import {module})", f"import {module}")
                    IMPORTED[key] = None
            elif path.suffix == ".sh" or self.lang in {"bash", "sh"}:
                run_process(["bash", "-n", str(path)], f"{self.where} (bash -n {path.name})", "")
            elif path.suffix in {".json", ".yaml", ".yml", ".toml"}:
                self.lang = path.suffix.lstrip(".")
                self.parse_data(path.read_text())

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, BlockError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, self.block.lineno - 1, f"code block {self.where}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "excerpt: a block that includes part of a module; checked by importing it"
    )


def mark_reason(mark, default: str) -> str:
    return mark.kwargs.get("reason") or (mark.args[0] if mark.args else default)


def cuda_reason(mark) -> str:
    return mark_reason(mark, "needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests and blocks run only where CUDA is; elsewhere they skip with the reason,
    or fail under REQUIRE_GPU=1 (`make test-gpu`), so a GPU run can never pass by skipping."""
    skip_torchtitan_unless_required(items)
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available() or os.environ.get("REQUIRE_GPU") == "1":
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {cuda_reason(item.get_closest_marker('cuda'))}"))


TORCHTITAN_PYTHON = ROOT / ".venv-torchtitan" / "bin" / "python"  # `make torchtitan-env`


def skip_torchtitan_unless_required(items):
    """`torchtitan`-marked blocks and tests need the optional extra in .venv-torchtitan and take
    minutes: they run only under REQUIRE_TORCHTITAN=1 (`make test-torchtitan`), and skip with
    their reason everywhere else, whether or not the extra is installed."""
    if os.environ.get("REQUIRE_TORCHTITAN") == "1":
        return
    for item in items:
        mark = item.get_closest_marker("torchtitan")
        if mark is not None:
            reason = mark_reason(mark, "runs TorchTitan")
            item.add_marker(pytest.mark.skip(
                reason=f"needs the torchtitan extra, run by `make test-torchtitan`: {reason}"))


def pytest_runtest_setup(item):
    titan = item.get_closest_marker("torchtitan")
    if titan is not None and os.environ.get("REQUIRE_TORCHTITAN") == "1" \
            and not os.access(TORCHTITAN_PYTHON, os.X_OK):
        pytest.fail(f"REQUIRE_TORCHTITAN=1 but {TORCHTITAN_PYTHON} is missing: "
                    f"run `make torchtitan-env` ({mark_reason(titan, 'runs TorchTitan')})")
    cuda = item.get_closest_marker("cuda")
    if cuda is not None and os.environ.get("REQUIRE_GPU") == "1":
        import torch

        if not torch.cuda.is_available():
            pytest.fail(f"REQUIRE_GPU=1 but torch.cuda.is_available() is False ({cuda_reason(cuda)})")


def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    if "codeblock" not in props:
        return
    kind, page, lineno = props["codeblock"]
    _KIND[report.nodeid], _WHERE[report.nodeid] = kind, (page, lineno)
    _SHOWN.update(props.get("codeblock_shown", ()))
    if report.skipped:
        _OUTCOMES[report.nodeid] = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPS[report.nodeid] = (_WHERE.get(report.nodeid), reason.removeprefix("Skipped: "))
    elif report.failed:
        _OUTCOMES[report.nodeid] = "failed"
    elif report.when == "call" and report.nodeid not in _OUTCOMES:
        _OUTCOMES[report.nodeid] = "xfailed" if hasattr(report, "wasxfail") else "passed"


def pytest_terminal_summary(terminalreporter):
    if not _KIND:
        return
    counts = defaultdict(lambda: defaultdict(int))
    for nodeid, kind in _KIND.items():
        counts[kind][_OUTCOMES.get(nodeid, "not run")] += 1

    def line(kind, label):
        c = counts.get(kind)
        if c:
            detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(c.items()))
            terminalreporter.write_line(f"{label}: {sum(c.values())} ({detail})")

    terminalreporter.section("code blocks in docs/")
    line("run", "python and bash blocks")
    line("data", "parsed (json, yaml, toml)")
    line("excerpt", "excerpts checked by importing their module")
    line("other", "other languages (a Dockerfile, ...), skipped with a reason")
    line("unrunnable", "NEITHER RUN NOR MARKED")
    terminalreporter.write_line(f"shown as text or diagrams: {len(_SHOWN)}")
    terminalreporter.write_line(f"skipped: {len(_SKIPS)}")
    for (page, lineno), reason in sorted(_SKIPS.values()):
        terminalreporter.write_line(f"  {page}:{lineno}: {reason}")
