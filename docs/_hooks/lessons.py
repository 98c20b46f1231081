"""MkDocs hook: key each executed lesson's cache on the code it runs, and never throw it away.

The lessons live in `lessons_src/` beside `snippets/` (each a plain runnable script); `docs/lessons`
is a symlink to that folder, so mkdocs-jupyter finds them as `lessons/<name>.py`.

mkdocs-jupyter's cache keys only on the lesson file, but a lesson's output also depends on the code
it runs from `snippets/`. The hook adds to each lesson's key a digest of its inputs: the snippets
modules it imports, followed import by import, the scripts it names in strings (`torchrun
snippets/x.py`, `python -m snippets.x`), and the data files beside those modules (a model's
`config.json`). So editing one snippet re-executes only the lessons that use it.

The cache is never deleted: mkdocs-jupyter evicts every entry the current build did not use, so
undoing an edit would execute the lessons again; the hook turns that off. `LESSON_CACHE_DIR`
moves the cache (the tests point it at a fresh directory, so `mkdocs serve` reuses the lessons
that the test build has just executed).

Under `make serve` (`LESSON_BACKGROUND=true`) a lesson without a cache entry does not hold up the
server: its page shows a note while the lesson executes on a background thread, one at a time.
mkdocs-jupyter writes the cache entry when it finishes; the server watches the cache folder, so that
write rebuilds the site and the page reloads with its output.
"""

import ast
import hashlib
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from html import escape
from pathlib import Path

import mkdocs_jupyter.plugin as jupyter_plugin
from mkdocs.structure.toc import get_toc
from mkdocs.utils import get_relative_url


ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = ROOT / "snippets"
NAMED = re.compile(r"\bsnippets(?:[./][A-Za-z_][A-Za-z0-9_]*)+")


def module_file(name: str) -> Path | None:
    """`snippets.a.b` or `snippets/a/b.py` -> the file, or None if it is not one."""
    parts = name.removesuffix(".py").replace("/", ".").split(".")
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def snippets_used(path: Path) -> set[Path]:
    """The snippets files a script imports or names, followed through their own imports."""
    seen, todo = set(), [path]
    while todo:
        source = todo.pop().read_text(encoding="utf-8")
        names = set(NAMED.findall(source))  # imports, and scripts named in strings
        try:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
                    names.add(node.module)
        except SyntaxError:
            pass
        for name in names:
            parts = name.replace("/", ".").removesuffix(".py").split(".")
            for i in range(1, len(parts) + 1):  # snippets, snippets.a, snippets.a.b: each runs
                found = module_file(".".join(parts[:i]))
                if found and found not in seen:
                    seen.add(found)
                    todo.append(found)
    return seen


def inputs_digest(lesson: Path) -> str:
    modules = snippets_used(lesson)
    data = {p for m in modules for p in m.parent.iterdir()
            if p.is_file() and p.suffix not in {".py", ".pyc"}}
    h = hashlib.sha256()
    for path in sorted(modules | data):
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_stock_cache_key = getattr(jupyter_plugin._compute_cache_key, "stock", jupyter_plugin._compute_cache_key)


def cache_key_with_inputs(nb_path, config, exec_nb):
    stock = _stock_cache_key(nb_path, config, exec_nb)
    return hashlib.sha256(f"{stock}{inputs_digest(Path(nb_path))}".encode()).hexdigest()


cache_key_with_inputs.stock = _stock_cache_key  # a second load of this hook wraps the stock key once
jupyter_plugin._compute_cache_key = cache_key_with_inputs

BACKGROUND = os.environ.get("LESSON_BACKGROUND", "false").lower() in {"1", "true"}
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lesson")
_jobs: dict[Path, Future] = {}  # cache entry -> the execution that writes it


def jupyter_cache_dir(config) -> Path | None:
    jupyter = config.plugins.get("mkdocs-jupyter")
    return Path(jupyter.config["cache_dir"]) if jupyter is not None and jupyter.config["cache"] else None


def on_config(config):
    jupyter = config.plugins.get("mkdocs-jupyter")
    if jupyter is not None and jupyter.config["cache"]:
        jupyter.config["cache_dir"] = os.environ.get(
            "LESSON_CACHE_DIR", str(ROOT / ".cache" / "mkdocs-jupyter"))
        # mkdocs-jupyter's on_post_build deletes the entries this build did not use.
        events = config.plugins.events["post_build"]
        events[:] = [e for e in events if getattr(e, "__self__", None) is not jupyter]
    return config


def on_pre_page(page, config, files):
    """Runs after mkdocs-jupyter's (hooks come after plugins), which made `page.render` execute the
    lesson and write its cache entry. In the background mode, that render goes to the thread and the
    page gets a note instead."""
    cache_dir = jupyter_cache_dir(config)
    if not (BACKGROUND and cache_dir and page.file.src_uri.startswith("lessons/")):
        return page
    jupyter = config.plugins["mkdocs-jupyter"]
    key = jupyter_plugin._compute_cache_key(page.file.abs_src_path, jupyter.config, jupyter.config["execute"])
    entry = jupyter_plugin._get_cache_path(str(cache_dir), key)
    if entry.exists():
        return page
    if entry not in _jobs or (_jobs[entry].done() and _jobs[entry].exception() is None):
        _jobs[entry] = _executor.submit(page.render, config, files)
    job = _jobs[entry]

    def note(self, config, files):
        self.content = lesson_note(job)
        self.toc = get_toc([])
        self.lesson_note = True

    page.render = note.__get__(page, type(page))
    return page


def lesson_note(job: Future) -> str:
    if job.done() and job.exception() is not None:
        detail = escape(str(job.exception()))[-4000:]
        return (f'<div class="admonition failure"><p class="admonition-title">This lesson failed'
                f'</p><pre>{detail}</pre><p>Fix it and save: the page reloads.</p></div>')
    return ('<div class="admonition note"><p class="admonition-title">Executing</p><p>This lesson '
            'is running in the background; the page reloads with its output when it finishes.'
            '</p></div>')


def on_serve(server, config, builder):
    """Rebuild when a background lesson writes its cache entry."""
    cache_dir = jupyter_cache_dir(config)
    if BACKGROUND and cache_dir:
        cache_dir.mkdir(parents=True, exist_ok=True)
        server.watch(str(cache_dir))
        if any(job.done() for job in _jobs.values()):  # finished before the watch began
            (cache_dir / "ready").write_text("")
    return server


# nbconvert's template puts two loaders into every executed lesson: MathJax 2 from cdnjs (a
# `<script src>` that mkdocs-jupyter leaves empty) and a Mermaid module imported from cdnjs when a
# notebook output holds a diagram. The site typesets math with its own KaTeX and draws diagrams with
# its own Mermaid, so both loaders are removed: the built site references no outside host.
NBCONVERT_LOADERS = [
    re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S),
    re.compile(r'<script type="module">(?:(?!</script>).)*?jp-Mermaid.*?</script>', re.S),
]


# nbconvert's template also inlines its stylesheets (JupyterLab's theme, about 590 KB) into every
# lesson page, before the notebook itself. They are the same for every lesson, so the hook writes
# them once, to a file named after their contents, and each page links it: a reader's browser
# fetches and caches it once, each page is that much lighter, and the search plugin, which parses
# every page, no longer parses them six times. A <style> inside a cell's output stays where it is.
STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S)
NOTEBOOK = '<div class="jupyter-wrapper'
_stylesheets: dict[str, str] = {}  # site path -> CSS, written by on_post_build


def on_page_content(html, page, config, files):
    if page.file.src_uri.startswith("lessons/") and not getattr(page, "lesson_note", False):
        for loader in NBCONVERT_LOADERS:
            html, count = loader.subn("", html)
            if count != 1:
                raise RuntimeError(
                    f"{page.file.src_uri}: expected one nbconvert loader matching {loader.pattern!r}, "
                    f"found {count}; mkdocs-jupyter's template changed, update docs/_hooks/lessons.py"
                )
        template, found, notebook = html.partition(NOTEBOOK)
        first = STYLE.search(template)
        if not found or first is None:
            raise RuntimeError(f"{page.file.src_uri}: expected nbconvert's stylesheets before "
                               f"{NOTEBOOK!r}; mkdocs-jupyter's template changed, update "
                               "docs/_hooks/lessons.py")
        css = "\n".join(STYLE.findall(template))
        path = f"assets/stylesheets/jupyter-{hashlib.sha256(css.encode()).hexdigest()[:12]}.css"
        _stylesheets[path] = css
        link = f'<link rel="stylesheet" href="{get_relative_url(path, page.url)}">'
        template = template[:first.start()] + link + STYLE.sub("", template[first.start():])
        html = template + found + notebook
    return html


def on_post_build(config):
    for path, css in _stylesheets.items():
        target = Path(config["site_dir"]) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(css, encoding="utf-8")
