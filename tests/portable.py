"""`make test-portable`: the pages' checked outputs and the numeric tests under other CPU kernel
families, so a number that holds only on the machine that wrote it fails here, not on a learner's.

PyTorch picks its CPU kernels when the first op runs: ATen's vectorised kernels (elementwise ops,
softmax, reductions) by instruction set (`default`, AVX2, AVX-512), MKL's matmuls and oneDNN's
(convolutions, bf16 attention and matmuls, AMX where present) each by their own. A wider vector
sums in a different order, so the last bits differ, and a long training run carries the difference
on. One machine can run the families below its own by capping all three libraries together, as a
real CPU of that level would. Capping ATen alone is not such a CPU: on an AMX machine, bf16
attention with ATen capped at AVX2 still asks oneDNN for AMX and raises `pack_vnni2 is only
supported when avx512 is supported`.

    python -m tests.portable                 default, avx2 and threads2 (make test is native, 1 thread)
    python -m tests.portable default         one family (CI runs this one after make test)
    python -m tests.portable --list          the families and their settings

Each family runs `pytest --portable` with the family's variables, and the run ends with each
family's kernels, time and outcome. Extra pytest arguments follow `--`. `--portable` is the
option of tests/portable_select.py (a pytest plugin, loaded by pyproject.toml): it keeps the pages
with checked output and every test not marked `kernel_independent`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from snippets.machine import KERNEL_FAMILIES

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Family:
    what: str
    env: dict = field(default_factory=dict)
    x86_only: bool = False


ONE = {"OMP_NUM_THREADS": "1"}
FAMILIES = {
    "native": Family("the kernels PyTorch picks for this CPU, one intra-op thread (make test)",
                     {**KERNEL_FAMILIES["native"], **ONE}),
    "avx2": Family("an AVX2 CPU (Intel since 2013, AMD Zen 1-3): ATen, oneDNN and MKL capped at "
                   "AVX2", {**KERNEL_FAMILIES["avx2"], **ONE}, x86_only=True),
    "default": Family("no vector kernels in ATen, oneDNN at SSE4.1, MKL at SSE4.2",
                      {**KERNEL_FAMILIES["default"], **ONE}, x86_only=True),
    "threads2": Family("the kernels PyTorch picks for this CPU, two intra-op threads",
                       {**KERNEL_FAMILIES["native"], "OMP_NUM_THREADS": "2"}),
}
DEFAULT_RUN = ("default", "avx2", "threads2")
PROBE = ("import torch; print(torch.backends.cpu.get_cpu_capability(), "
         "torch.get_num_threads())")


def family_env(name: str) -> dict:
    capped = {key for family in KERNEL_FAMILIES.values() for key in family}
    env = {k: v for k, v in os.environ.items()
           if k not in capped | {"MKL_CBWR", "PYTHONDONTWRITEBYTECODE"}}
    return {**env, **FAMILIES[name].env}


def kernels(name: str) -> str:
    """What the family's settings give on this machine: ATen's capability and the thread count."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=family_env(name), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().replace(" ", ", threads ") if out.returncode == 0 else "probe failed"


def run(names: list[str], pytest_args: list[str]) -> int:
    rows, failed = [], []
    for name in names:
        family = FAMILIES[name]
        if family.x86_only and platform.machine() not in ("x86_64", "AMD64"):
            # an Arm CPU has NEON kernels only: there is no lower x86 family to emulate
            rows.append((name, "not x86-64: no such kernels here", "-", "not run"))
            continue
        got = kernels(name)
        print(f"\n===== family {name}: {family.what}\n      "
              f"{' '.join(f'{k}={v}' for k, v in family.env.items())} -> ATen {got}", flush=True)
        start = time.monotonic()
        workers = os.environ.get("TEST_WORKERS", "4")
        cmd = [sys.executable, "-m", "pytest", "--portable", "-p", "no:cacheprovider",
               *(["-n", workers, "--dist", "loadfile", "--no-loadscope-reorder"]
                 if workers != "0" else []), *pytest_args]
        code = subprocess.run(cmd, env=family_env(name), cwd=ROOT).returncode
        seconds = time.monotonic() - start
        rows.append((name, got, f"{seconds:.0f} s", "green" if code == 0 else f"RED (exit {code})"))
        if code != 0:
            failed.append(name)
    print("\nfamily     ATen kernels                 time    outcome")
    for row in rows:
        print(f"{row[0]:<10} {row[1]:<28} {row[2]:>6}  {row[3]}")
    if failed:
        print(f"test-portable: red under {', '.join(failed)}: a checked number depends on the "
              "kernels; see each family's failures above", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    args, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    if args == ["--list"]:
        for name, family in FAMILIES.items():
            print(f"{name:<9} {family.what}\n          {family.env}")
        return 0
    unknown = [a for a in args if a not in FAMILIES]
    if unknown:
        print(f"test-portable: unknown family {unknown[0]!r}; choose from "
              f"{', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    return run(args or list(DEFAULT_RUN), pytest_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
