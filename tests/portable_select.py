"""pytest's `--portable` option, for `make test-portable` (tests/portable.py): keep only what a
CPU's kernels can change, the pages with checked output and the tests not marked
`kernel_independent`.

A plugin of its own because pyproject.toml loads it into every pytest process, the sub-pytests
that test the code-block runner included: it must not import torch (several seconds each time);
the families, which read snippets.machine, stay in tests/portable.py.
"""

from __future__ import annotations

from pathlib import Path


def pytest_addoption(parser):
    parser.addoption("--portable", action="store_true",
                     help="only what a CPU's kernels can change: the pages with checked output "
                          "and the tests not marked kernel_independent (make test-portable)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("portable"):
        kept, dropped = [], []
        for item in items:
            (kept if portable(item) else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def page_checks_output(path: Path, _cache: dict = {}) -> bool:
    if path not in _cache:
        _cache[path] = "pytest-codeblocks:expected-output" in path.read_text()
    return _cache[path]


def portable(item) -> bool:
    """A page block runs under every family when its page checks an output (a later block may
    check what an earlier one wrote); a test, unless its file is marked kernel_independent: the
    marker says why nothing it asserts can depend on which kernels ran."""
    path = Path(str(item.path))
    if path.suffix == ".md":
        return page_checks_output(path)
    return item.get_closest_marker("kernel_independent") is None
