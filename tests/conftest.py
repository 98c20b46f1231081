"""Shared fixtures: the built site (built once per test session) and free loopback ports."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mkdocs(*args, cwd=ROOT, timeout=600, **env) -> subprocess.CompletedProcess:
    """Run mkdocs with this interpreter; never uses the lesson cache (a test must see fresh output)."""
    full_env = {**os.environ, "LESSON_CACHE": "false", "NO_MKDOCS_2_WARNING": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *args], cwd=cwd, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """`mkdocs build --strict` of the real site, executing every lesson."""
    site = tmp_path_factory.mktemp("site")
    result = mkdocs("build", "--strict", "--site-dir", str(site))
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return site


def pytest_collection_modifyitems(config, items):
    """For `pytest -n 2 --dist loadgroup` (pytest-xdist; `make test` uses it): each file's tests
    stay together and in order on one worker, since a page's blocks build on each other, and every
    test of the built site shares one worker, so the site is built once."""
    for item in items:
        uses_site = "built_site" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("built-site" if uses_site else str(item.path)))


@pytest.fixture
def one_thread():
    """One intra-op thread for the test's own process: with small tensors on 2 shared cores, a
    second OpenMP thread mostly spins waiting for a core (measured 100x slower under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
