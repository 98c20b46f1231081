"""Importing `snippets` pins PyTorch's CPU kernels to AVX2 (snippets/__init__.py), so a page's
printed numbers are the same on any x86-64 machine with AVX2; a reader's own setting and
`make bench`'s COURSE_NATIVE_KERNELS=1 are left alone."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = ("import os, torch, snippets; "
         "print(torch.backends.cpu.get_cpu_capability(), os.environ.get('MKL_CBWR'))")


def has_avx2() -> bool:
    import snippets

    return snippets._has_avx2()


def probe(**env) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in {"ATEN_CPU_CAPABILITY", "MKL_CBWR", "COURSE_NATIVE_KERNELS"}}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[-2] + " " + result.stdout.split()[-1]


@pytest.mark.skipif(not has_avx2(), reason="this CPU has no AVX2: the course leaves kernels alone")
def test_kernels_are_pinned_to_avx2_after_importing_torch_first():
    assert probe() == "AVX2 AVX2"  # torch imported before snippets: the pin still applies


@pytest.mark.skipif(not has_avx2(), reason="this CPU has no AVX2: the course leaves kernels alone")
def test_the_readers_setting_and_the_benchmarks_opt_out_win():
    assert probe(ATEN_CPU_CAPABILITY="default") == "DEFAULT AVX2"
    assert probe(COURSE_NATIVE_KERNELS="1").endswith(" None")  # MKL_CBWR not set: native
