"""The site builds strictly, references nothing outside itself, and `mkdocs serve` serves it."""

import os
import re
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, mkdocs

pytestmark = pytest.mark.kernel_independent("the site build, its links and files")

LOOPBACK = re.compile(r"^https?://(127\.0\.0\.1|localhost)(:\d+)?/")


class ResourceLinks(HTMLParser):
    """Collect the URLs a browser would load on its own: scripts, styles, images, frames."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in {"script", "img", "iframe", "source", "audio", "video"} and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href") and set((a.get("rel") or "").split()) & {
            "stylesheet", "preload", "modulepreload", "icon", "manifest", "prefetch"
        }:
            self.urls.append(a["href"])


def test_built_site_loads_nothing_from_other_hosts(built_site: Path):
    pages = list(built_site.rglob("*.html"))
    assert len(pages) >= 10, f"only {len(pages)} pages built"
    outside = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        parser = ResourceLinks()
        parser.feed(text)
        urls = parser.urls + re.findall(r"""import\(\s*["']([^"']+)""", text)
        outside += [f"{page.relative_to(built_site)}: {u}" for u in urls
                    if re.match(r"^(https?:)?//", u) and not LOOPBACK.match(u)]
    for css in built_site.rglob("*.css"):
        outside += [f"{css.relative_to(built_site)}: {u}" for u in
                    re.findall(r"""url\(\s*["']?((?:https?:)?//[^)"']+)""", css.read_text())]
    assert not outside, "resources loaded from outside the site:\n" + "\n".join(outside)


def test_executed_lesson_has_real_output(built_site: Path):
    html = (built_site / "lessons" / "memory_arithmetic" / "index.html").read_text()
    assert "total model state: 16.0 bytes/param" in html  # printed by the lesson's own run
    assert "data:image/png;base64," in html  # the matplotlib figure


def test_lessons_share_one_stylesheet(built_site: Path):
    """nbconvert's stylesheets (about 590 KB) are one file that every lesson links, not a copy
    inlined into each page (docs/_hooks/lessons.py)."""
    lessons = sorted((built_site / "lessons").glob("*/index.html"))
    assert len(lessons) == len(list((ROOT / "lessons_src").glob("*.py")))
    links = set()
    for page in lessons:
        html = page.read_text(encoding="utf-8")
        assert "<style" not in html.split('<div class="jupyter-wrapper', 1)[0], page
        found = re.findall(r'<link rel="stylesheet" href="\.\./\.\./(assets/stylesheets/'
                           r'jupyter-[0-9a-f]{12}\.css)">', html)
        assert len(found) == 1, page
        links.add(found[0])
    (link,) = links
    css = (built_site / link).read_text(encoding="utf-8")
    assert len(css) > 100_000 and ".jp-Cell" in css and ".highlight" in css


def test_session_a_demo_resumes_exactly(built_site: Path):
    html = (built_site / "lessons" / "session_a_demo" / "index.html").read_text()
    # The page's claim, printed by its own run: the resumed losses equal the unbroken run's.
    assert "steps 101-160 equal, bit for bit: True" in html
    assert "validation losses equal: True" in html
    assert "data:image/png;base64," in html  # the loss curve
    assert "widget-view" not in html  # a progress-bar widget would need JavaScript from a CDN


def test_session_b_demo_shows_sharding_and_sync(built_site: Path):
    html = (built_site / "lessons" / "session_b_demo" / "index.html").read_text()
    # The page's claims, printed by its own torchrun runs.
    assert "overlap between shards: 0 examples; covered: 4616 of 4616" in html
    assert "final checksums identical on all ranks: True" in html
    assert "replicas in sync: False" in html  # the --no-sync run
    assert html.count("data:image/png;base64,") >= 2  # the loss and checksum figures


def write_site(tmp: Path, page: str) -> Path:
    docs = tmp / "docs"
    docs.mkdir(parents=True)
    (docs / "index.md").write_text(page)
    config = tmp / "mkdocs.yml"
    # Inherit the real configuration (snippets options included); only the pages differ.
    config.write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nsite_dir: {tmp / 'site'}\n"
        "nav: [index.md]\nhooks: []\nwatch: []\nplugins: [search]\nextra_css: []\nextra_javascript: []\n"
    )
    return config


def test_missing_snippet_section_fails_the_build(tmp_path):
    good = write_site(tmp_path / "good", '```python\n--8<-- "snippets/machine.py:pick-device"\n```\n')
    assert mkdocs("build", "--strict", "-f", str(good)).returncode == 0
    bad = write_site(tmp_path / "bad", '```python\n--8<-- "snippets/machine.py:pick-the-device"\n```\n')
    result = mkdocs("build", "--strict", "-f", str(bad))
    assert result.returncode != 0
    assert "pick-the-device" in result.stdout + result.stderr


def test_make_serve_command_serves_home_page(built_site, lesson_cache):
    """`make serve`'s command, with the lesson cache the test build has just filled: every lesson
    is a cache hit (keyed on its own inputs), so the server answers without executing one."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "serve", "--dev-addr", f"127.0.0.1:{port}", "--no-livereload"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LESSON_CACHE": "true", "LESSON_CACHE_DIR": str(lesson_cache),
             "NO_MKDOCS_2_WARNING": "1"},
    )
    lessons = len(list((ROOT / "lessons_src").glob("*.py")))
    try:
        deadline, html = time.time() + 300, None
        while time.time() < deadline and server.poll() is None:
            try:
                html = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(1)
        assert html is not None, f"mkdocs serve did not answer:\n{server.stdout.read() if server.poll() is not None else ''}"
        assert "<title>From Scratch to Scale" in html
        assert "Who this is for" in html
    finally:
        server.terminate()
        server.wait(timeout=30)
    log = server.stdout.read()
    assert log.count("Cache hit") == lessons, log[-3000:]
    assert len(list(lesson_cache.glob("*.json"))) == lessons  # nothing evicted, nothing added


GATED_LESSON = '''# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %%
import os, time
from pathlib import Path

deadline = time.time() + 120
while not Path(os.environ["LESSON_GATE"]).exists():
    assert time.time() < deadline, "the test never opened the gate"
    time.sleep(0.1)
print("the lesson", "ran")
'''


def test_serve_answers_before_a_lesson_finishes(tmp_path):
    """`make serve` (LESSON_BACKGROUND=true) with an empty cache: the pages are served while a lesson
    still executes, the lesson's page says so, and when it finishes the server rebuilds by itself
    and the page shows the output. The lesson waits for a file the test writes, so the order is
    certain on any machine, not a race against a timer."""
    docs, gate, cache = tmp_path / "docs", tmp_path / "gate", tmp_path / "cache"
    (docs / "lessons").mkdir(parents=True)
    (docs / "index.md").write_text("# Home\n\nThe Markdown pages.\n")
    (docs / "lessons" / "gated.py").write_text(GATED_LESSON)
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\nhooks:\n  - {ROOT / 'docs/_hooks/lessons.py'}\nplugins:\n  - mkdocs-jupyter:\n"
        '      include: ["lessons/*.py"]\n      execute: true\n      cache: true\n')
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mkdocs", "serve", "--dev-addr", f"127.0.0.1:{port}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LESSON_CACHE": "true", "LESSON_BACKGROUND": "true",
             "LESSON_CACHE_DIR": str(cache), "LESSON_GATE": str(gate), "NO_MKDOCS_2_WARNING": "1"},
    )

    def get(path: str, until, what: str) -> str:
        deadline = time.time() + 120
        while time.time() < deadline and server.poll() is None:
            try:
                html = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).read().decode()
                if until(html):
                    return html
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{what} within 120 s; mkdocs serve said:\n"
                             f"{server.stdout.read() if server.poll() is not None else '(still running)'}")

    try:
        assert "The Markdown pages." in get("/", lambda h: True, "no answer")
        page = get("/lessons/gated/", lambda h: True, "no lesson page")
        assert "running in the background" in page and "the lesson ran" not in page
        gate.write_text("")
        get("/lessons/gated/", lambda h: "the lesson ran" in h, "the lesson's output never appeared")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert len(list(cache.glob("*.json"))) == 1
