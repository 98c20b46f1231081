"""MkDocs hook: key the executed lessons' cache on the code they import.

The lessons live in `lessons_src/` beside `snippets/` (each a plain runnable script); `docs/lessons`
is a symlink to that folder, so mkdocs-jupyter finds them as `lessons/<name>.py`.

mkdocs-jupyter's cache keys only on the lesson file. A lesson's output also depends on the code it
imports from `snippets/`, so the hook points the cache at a directory named after a digest of
`snippets/`: change any snippet and every lesson executes again.
"""

import hashlib
import re
import shutil
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SNIPPETS = ROOT / "snippets"


def snippets_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(SNIPPETS.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def on_config(config):
    jupyter = config.plugins.get("mkdocs-jupyter")
    if jupyter is not None and jupyter.config["cache"]:
        base = ROOT / ".cache" / "mkdocs-jupyter"
        current = base / snippets_digest()
        if base.is_dir():  # outputs made with older snippets can never be hit again
            for old in base.iterdir():
                if old != current:
                    shutil.rmtree(old, ignore_errors=True)
        jupyter.config["cache_dir"] = str(current)
    return config


# nbconvert's template puts two loaders into every executed lesson: MathJax 2 from cdnjs (a
# `<script src>` that mkdocs-jupyter leaves empty) and a Mermaid module imported from cdnjs when a
# notebook output holds a diagram. The site typesets math with its own KaTeX and draws diagrams with
# its own Mermaid, so both loaders are removed: the built site references no outside host.
NBCONVERT_LOADERS = [
    re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->", re.S),
    re.compile(r'<script type="module">(?:(?!</script>).)*?jp-Mermaid.*?</script>', re.S),
]


def on_page_content(html, page, config, files):
    if page.file.src_uri.startswith("lessons/"):
        for loader in NBCONVERT_LOADERS:
            html, count = loader.subn("", html)
            if count != 1:
                raise RuntimeError(
                    f"{page.file.src_uri}: expected one nbconvert loader matching {loader.pattern!r}, "
                    f"found {count}; mkdocs-jupyter's template changed, update docs/_hooks/lessons.py"
                )
    return html
