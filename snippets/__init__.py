"""The course's runnable code: every block on the site is included from this package.

Importing it pins the CPU kernels that PyTorch picks by instruction set, so a page's printed
numbers come out the same on any x86-64 machine with AVX2 (every Intel CPU since 2013 and every
AMD Zen), not only on the one that wrote the page:

- ATen's vectorised kernels (elementwise ops, softmax, reductions) are compiled for AVX2 and
  AVX-512 and chosen at the first op: 8 or 16 floats per instruction sum in different orders.
- MKL's matmuls pick a code path per CPU as well; MKL_CBWR ("conditional bitwise reproducibility")
  fixes it to the AVX2 one.

Both are read when the first op runs, not when torch is imported, so a script may import torch
before this package. A variable the reader set already is kept, and COURSE_NATIVE_KERNELS=1 (which
`make bench` sets) leaves both alone, to measure what the machine can do. The thread count matters
too: the course's scripts that print exact numbers run one thread.
"""

import os
import platform


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


if (os.environ.get("COURSE_NATIVE_KERNELS") != "1"
        and platform.machine() in ("x86_64", "AMD64") and _has_avx2()):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_CBWR", "AVX2")
