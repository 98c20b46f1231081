"""pytest plugin: run every fenced code block of every page in docs/.

Loaded with `-p tests.codeblocks` (pyproject.toml's addopts). For each `docs/**/*.md` it

1. reads the page's blocks and their markers with pytest-codeblocks' own parser, so the markers mean
   what they mean there: `<!--pytest-codeblocks:cont-->`, `<!--pytest-codeblocks:expected-output-->`,
   `<!--pytest-codeblocks:importorskip(module)-->`, `<!--pytest.mark.skip(reason="...")-->`,
   `<!--pytest.mark.skipif(condition, reason="...")-->`, `<!--pytest.mark.xfail(...)-->`;
2. expands the `--8<--` includes inside each block with pymdownx.snippets' own preprocessor,
   configured from mkdocs.yml, so the test runs exactly the code the site shows;
3. takes the first word of the fence's info string as the language, so
   ```` ```python title="snippets/x.py" ```` runs (pytest-codeblocks' stock plugin skips it);
4. runs python blocks with the project's interpreter and bash/sh blocks with `bash -e -o pipefail`,
   both from the repository root, as a reader would; parses json/yaml/toml blocks.

Two markers are this project's own:
`<!--pytest.mark.cuda(reason="...")-->` runs the block only where CUDA is present (`make test-gpu`),
and `<!--pytest.mark.excerpt-->` marks a block that only includes part of a module (a method, a
class): it is checked by importing (python) or syntax-checking (bash) the file it comes from, and by
the tests of that module.

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
IMPORTED: set = set()  # (module, mtime) pairs whose import already succeeded this session
INCLUDE = re.compile(r"""^\s*-{1,}8<-{1,}\s+["']([^"']+)["']\s*$""")
OUTPUT_TAIL = 6000  # characters of stdout/stderr shown for a failing block

# nodeid -> what kind of block it is, for the end-of-run count
_KIND: dict[str, str] = {}
_WHERE: dict[str, tuple] = {}
_OUTCOMES: dict[str, str] = {}
_SKIPS: dict[str, tuple] = {}
_SHOWN: set[str] = set()


class BlockError(Exception):
    """A block failed; the message is shown as the test's failure, without a traceback."""


@functools.cache
def snippet_preprocessor():
    """pymdownx.snippets' preprocessor with the options mkdocs.yml gives it."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    options = dict(config["mdx_configs"].get("pymdownx.snippets", {}))
    options["base_path"] = [str(ROOT / p) for p in options.get("base_path", ["."])]
    md = markdown.Markdown(
        extensions=["pymdownx.snippets"], extension_configs={"pymdownx.snippets": options}
    )
    return md.preprocessors["snippet"]


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
        try:
            blocks = extract_from_buffer(io.StringIO(text))
        except RuntimeError as e:
            raise BlockError(f"{where}: {e}") from None

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
            if "excerpt" in names:
                kind = "excerpt"
            elif lang in RUN_LANGS:
                kind = "run"
            elif lang in DATA_LANGS:
                kind = "data"
            elif lang in SHOWN_LANGS and not marks:
                shown.append(f"{where}:{block.lineno}")
                continue
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
        yield from items


class CodeBlock(pytest.Item):
    block = lang = kind = where = None

    def runtest(self):
        block = self.block
        if block.importorskip:
            pytest.importorskip(block.importorskip)
        if self.kind == "unrunnable":
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
            script = Path(tempfile.mkdtemp(prefix="codeblock-")) / (
                re.sub(r"\W", "_", self.where) + ".py"
            )
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
            if expected != got:
                diff = "".join(difflib.unified_diff(
                    expected.splitlines(True), out.splitlines(True), "expected", "got"))
                raise BlockError(f"{self.where}: output differs from the page\n{diff}")

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
                # A page often shows several parts of one module: import it once per session
                # (a fresh process costs a torch import), unless the file changed since.
                key = (module, path.stat().st_mtime_ns)
                if key not in IMPORTED:
                    run_process([sys.executable, "-c", f"import {module}"],
                                f"{self.where} (import {module})", f"import {module}")
                    IMPORTED.add(key)
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


def cuda_reason(mark) -> str:
    return mark.kwargs.get("reason") or (mark.args[0] if mark.args else "needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests and blocks run only where CUDA is; elsewhere they skip with the reason,
    or fail under REQUIRE_GPU=1 (`make test-gpu`), so a GPU run can never pass by skipping."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available() or os.environ.get("REQUIRE_GPU") == "1":
        return
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {cuda_reason(item.get_closest_marker('cuda'))}"))


def pytest_runtest_setup(item):
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
    line("unrunnable", "NEITHER RUN NOR MARKED")
    terminalreporter.write_line(f"shown as text or diagrams: {len(_SHOWN)}")
    terminalreporter.write_line(f"skipped: {len(_SKIPS)}")
    for (page, lineno), reason in sorted(_SKIPS.values()):
        terminalreporter.write_line(f"  {page}:{lineno}: {reason}")
