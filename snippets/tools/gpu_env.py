"""Before `make test-gpu` (and `make bench-gpu`): what this interpreter has, and what it lacks.

    PYTHONPATH=. python3 -m snippets.tools.gpu_env           # for make test-gpu
    PYTHONPATH=. python3 -m snippets.tools.gpu_env --bench   # for make bench-gpu: is torch there

A GPU machine brings its own Python with a CUDA build of PyTorch, and may have no network: the
GPU targets use that interpreter and install nothing. This prints the record that goes beside
the results (interpreter, torch, CUDA, driver, GPUs), then finds the packages the test run
imports and this interpreter lacks, by reading the code rather than a list kept by hand:

- the pytest plugins pyproject.toml's addopts loads (`-p tests.codeblocks` needs
  pytest_codeblocks, and Markdown, mkdocs and the Markdown extensions mkdocs.yml names, such as
  pymdownx, to expand the pages' includes);
- every test module's top-level imports (pytest imports them all to collect, `-m cuda` or not);
- all imports of the test modules that hold CUDA tests, and of the modules the pages' CUDA
  blocks run (`python snippets/x.py`, `-m snippets.x`);
- through the course's own modules (snippets.*, tests.*), their top-level imports in turn.

A missing one ends the run with one line naming them and how to bring them without a network
(pip download the wheels where there is one, carry them over, pip install --no-index).
It imports nothing but the standard library until it checks torch, so it runs anywhere.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"snippets", "tests", "docs"}
# Import names that differ from the distribution's name on PyPI.
DISTRIBUTIONS = {"yaml": "PyYAML", "pymdownx": "pymdown-extensions", "markdown": "Markdown",
                 "pytest_codeblocks": "pytest-codeblocks", "dockerfile_parse": "dockerfile-parse",
                 "kubernetes_validate": "kubernetes-validate", "xdist": "pytest-xdist"}
CUDA_BLOCK = re.compile(r"<!--\s*pytest\.mark\.cuda\b.*?-->\s*\n\s*```\w*[^\n]*\n(.*?)```", re.S)
RUNS = re.compile(r"(?:python3?|torchrun)\b[^\n]*?(?:-m\s+(snippets(?:\.\w+)+)|(snippets/[\w/]+)\.py)")


def imports_of(source: str, top_level_only: bool) -> set[str]:
    """The absolute module names the code imports (at its top level only, or anywhere)."""
    tree = ast.parse(source)
    nodes = (tree.body if top_level_only else ast.walk(tree))
    found = set()
    for node in nodes:
        if top_level_only and isinstance(node, (ast.If, ast.Try)):  # guarded top-level imports
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    found |= imports_of(ast.unparse(inner), True)
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # submodules
    return found


def module_file(name: str) -> Path | None:
    """The course's own source file of module `name`, or None (not ours, or not a module)."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def third_party(roots: dict[Path, bool]) -> set[str]:
    """Top-level names of the non-standard, non-course packages imported by the files in
    `roots` (path -> all imports, or top-level only), following the course's own modules'
    top-level imports."""
    seen, queue, found = set(), list(roots.items()), set()
    while queue:
        path, everywhere = queue.pop()
        if (path, everywhere) in seen:
            continue
        seen.add((path, everywhere))
        for name in imports_of(path.read_text(encoding="utf-8"), not everywhere):
            top = name.split(".")[0]
            if top in LOCAL:
                if (own := module_file(name)) is not None:
                    queue.append((own, False))
                    for parent in range(1, name.count(".") + 1):  # packages' __init__ run too
                        if (init := module_file(".".join(name.split(".")[:parent]))):
                            queue.append((init, False))
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
    return found


def test_imports(root: Path = ROOT) -> set[str]:
    """What `pytest -m cuda` imports, by the rules in the module docstring."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    plugins = re.findall(r"-p\s+([\w.]+)", config.get("addopts", ""))
    roots = {path: True for name in ["tests.conftest", *plugins]
             if (path := module_file(name)) is not None}
    for path in sorted((root / "tests").glob("test_*.py")):
        roots.setdefault(path, "pytest.mark.cuda" in path.read_text(encoding="utf-8"))
    for page in sorted((root / "docs").rglob("*.md")):
        for block in CUDA_BLOCK.findall(page.read_text(encoding="utf-8")):
            for module, script in RUNS.findall(block):
                path = module_file(module) if module else root / f"{script}.py"
                if path is not None and path.is_file():
                    roots[path] = True
    return {"pytest"} | markdown_extension_packages(root) | third_party(roots)


def markdown_extension_packages(root: Path = ROOT) -> set[str]:
    """The packages of mkdocs.yml's dotted markdown_extensions (pymdownx.snippets -> pymdownx),
    which tests/codeblocks.py loads by name; read without a YAML parser, which may be missing."""
    text = (root / "mkdocs.yml").read_text(encoding="utf-8")
    section = text.split("\nmarkdown_extensions:", 1)[-1]
    section = re.split(r"\n(?=\S)", section, maxsplit=1)[0]  # up to the next top-level key
    return set(re.findall(r"^\s*-\s*(\w+)\.[\w.]+:?\s*$", section, re.M))


def pins(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's pinned requirements, by normalised name: 'pytest_codeblocks' ->
    'pytest-codeblocks==0.18.0'."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"],
             *(r for extra in project["optional-dependencies"].values() for r in extra)]
    out = {}
    for line in lines:
        name = re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]
        out[name.lower().replace("-", "_")] = line.strip()
    return out


def requirement(import_name: str, pinned: dict[str, str]) -> str:
    """What to pip download for a missing import: the pinned requirement where there is one."""
    dist = DISTRIBUTIONS.get(import_name, import_name)
    return pinned.get(dist.lower().replace("-", "_"), dist)


def missing_line(missing: list[str], pinned: dict[str, str]) -> str:
    wanted = " ".join(requirement(m, pinned) for m in missing)
    tag = f"{sys.version_info.major}{sys.version_info.minor}"
    return (f"gpu_env: {sys.executable} lacks {', '.join(missing)} (the test run imports them); "
            f"bring them without a network: where pip works, `pip download --only-binary=:all: "
            f"--python-version {tag} --platform manylinux2014_{platform.machine()} -d wheels "
            f"{wanted}`, copy wheels/ here, then `{sys.executable} -m pip install --no-index "
            f"--find-links wheels {wanted}` (never torch: this machine's CUDA build stays)")


def describe() -> list[str]:
    """The record that goes beside the results: interpreter, torch, CUDA, driver, GPUs."""
    import torch

    lines = [f"python {platform.python_version()} at {sys.executable}",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"cuDNN {torch.backends.cudnn.version() if torch.version.cuda else None}"]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            lines.append(f"NVIDIA driver {out[0] if out else 'unknown'}")
        except (OSError, subprocess.SubprocessError):
            pass
    if torch.cuda.is_available():
        lines += [f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability "
                  f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))}"
                  for i in range(torch.cuda.device_count())]
    else:
        lines.append("no CUDA device visible to torch")
    return lines


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("torch") is None:
        print(f"gpu_env: {sys.executable} has no torch; the GPU targets never install it: run "
              "them with the interpreter that has the machine's CUDA build of PyTorch, "
              "GPU_PYTHON=/path/to/python", file=sys.stderr)
        return 1
    if "--bench" in args:  # the benchmark prints the device itself, or its one-line refusal
        return 0
    for line in describe():
        print(f"[gpu env] {line}", flush=True)
    missing = sorted(name for name in test_imports() if importlib.util.find_spec(name) is None)
    if missing:
        print(missing_line(missing, pins()), file=sys.stderr)
        return 1
    if shutil.which("python", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                    f"{os.environ.get('PATH', '')}") is None:
        print(f"gpu_env: the pages' blocks call `python`, and neither {Path(sys.executable).parent}"
              " nor PATH has one: link it to this interpreter, e.g. `ln -s "
              f"{sys.executable} /usr/local/bin/python`", file=sys.stderr)
        return 1
    print("[gpu env] every package the test run imports is present", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
