"""Importing the course's code changes nothing process-wide: PyTorch keeps the kernels it picks for
the learner's CPU (snippets/__init__.py). An earlier version pinned them to AVX2 on import, which
made bf16 attention raise `pack_vnni2 is only supported when avx512 is supported` on a CPU with AMX;
`make test-portable` (tests/portable.py) now checks the pages' numbers under several kernel
families instead."""

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                    "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def run(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


def test_import_leaves_the_environment_and_bf16_attention_alone():
    # torch is imported first, as a learner's script does; then the course's package
    code = ("import os, torch; before = dict(os.environ); threads = torch.get_num_threads(); "
            "cap = torch.backends.cpu.get_cpu_capability(); import snippets; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "assert torch.get_num_threads() == threads; "
            "assert torch.backends.cpu.get_cpu_capability() == cap; "
            "import torch.nn.functional as F; "
            "q = torch.randn(2, 4, 64, 16, dtype=torch.bfloat16); "
            "out = F.scaled_dot_product_attention(q, q, q, is_causal=True); "
            "print('ok', cap, tuple(out.shape), out.dtype)")
    result = run(code)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and "(2, 4, 64, 16) torch.bfloat16" in result.stdout


def defines_only(node: ast.stmt) -> bool:
    if isinstance(node, ast.If):  # only `if __name__ == "__main__":`
        return "__main__" in ast.unparse(node.test)
    if isinstance(node, ast.Try):  # only an optional import
        return all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign)) for n in node.body)
    if isinstance(node, ast.Expr):  # only a docstring
        return isinstance(node.value, ast.Constant)
    return isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                             ast.AsyncFunctionDef, ast.Assign, ast.AnnAssign))


def library_modules() -> list[str]:
    """Every module under snippets/ whose top level only defines things (imports, functions,
    classes, constants, an `if __name__ == "__main__":` block): importing it runs nothing. The
    few scripts written top to bottom (a page runs them as commands) are left out."""
    names = []
    for info in pkgutil.walk_packages([str(ROOT / "snippets")], prefix="snippets."):
        path = Path(importlib.util.find_spec(info.name).origin)
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text())
        if all(defines_only(node) for node in tree.body):
            names.append(info.name)
    return names


def test_importing_every_module_changes_no_setting():
    """The environment, the thread counts, the kernel capability, determinism and the default
    dtype are the same after importing all of the course's library modules."""
    modules = library_modules()
    assert len(modules) > 100, modules  # the walk found the package, not an empty folder
    # torch.distributed.pipelining imports torch._inductor, which sets TORCHINDUCTOR_CACHE_DIR on
    # import: torch's own doing, imported before the snapshot so that only the course's counts.
    code = ("import os, sys, importlib, torch, torch.distributed.pipelining\n"
            "def settings():\n"
            "    return (dict(os.environ), torch.get_num_threads(), torch.get_num_interop_threads(),\n"
            "            torch.backends.cpu.get_cpu_capability(), torch.get_default_dtype(),\n"
            "            torch.are_deterministic_algorithms_enabled(),\n"
            "            torch.get_float32_matmul_precision())\n"
            "before = settings()\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    assert settings() == before, (name, settings(), before)\n"
            "print('imported', len(sys.argv) - 1)\n")
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES}
    result = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT,
                            env={**clean, "MPLBACKEND": "Agg"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"imported {len(modules)}" in result.stdout


@pytest.mark.parametrize("family", ["default", "avx2"])
def test_a_capped_family_runs_bf16_attention(family):
    """tests/portable.py's families cap ATen and oneDNN together, as a real CPU of that level
    would: ATen capped alone on an AMX machine asks oneDNN for AMX and raises pack_vnni2."""
    from tests.portable import FAMILIES

    code = ("import torch, torch.nn.functional as F; "
            "q = torch.randn(2, 4, 64, 16, dtype=torch.bfloat16); "
            "F.scaled_dot_product_attention(q, q, q, is_causal=True); "
            "print(torch.backends.cpu.get_cpu_capability())")
    result = run(code, **FAMILIES[family].env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == ("DEFAULT" if family == "default" else "AVX2")


def test_a_script_that_sets_the_threads_says_so(capsys, one_thread):
    from snippets.machine import set_threads

    assert set_threads(1, "already one") == 1  # no change: nothing to say
    assert capsys.readouterr() == ("", "")
    assert set_threads(2, "the reason") == 1
    import torch

    assert torch.get_num_threads() == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "note: 2 intra-op threads instead of 1: the reason\n"
