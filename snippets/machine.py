"""Describe the machine a run happened on, and pick the device to train on.

Benchmarks store `machine_info()` beside every number they write, because a time means nothing
without the hardware it was measured on. `python -m snippets.machine` prints it as JSON.
"""

import json
import os
import platform
import sys

import torch


# --8<-- [start:pick-device]
class DeviceError(RuntimeError):
    """The requested device is not usable here; the message says why and what to pass instead."""


def pick_device(preference: str = "auto") -> torch.device:
    """'auto' -> CUDA, then Apple's MPS, then the CPU. Asking for a missing device is an error,
    not a silent fallback: a run you meant for the GPU should not crawl along on the CPU."""
    cuda_ok = torch.cuda.is_available()
    mps_ok = torch.backends.mps.is_available()
    if preference == "auto":
        return torch.device("cuda" if cuda_ok else "mps" if mps_ok else "cpu")
    if preference not in ("cuda", "mps", "cpu"):
        raise DeviceError(f"--device {preference!r} is not one of auto, cuda, mps, cpu")
    if preference == "cuda" and not cuda_ok:
        why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
               else "no NVIDIA GPU or driver is visible")
        raise DeviceError(f"--device cuda was requested, but CUDA is not available: {why} "
                          f"(torch {torch.__version__}). Use --device auto or --device cpu.")
    if preference == "mps" and not mps_ok:
        why = ("this PyTorch build has no MPS support (it needs macOS on Apple silicon)"
               if not torch.backends.mps.is_built() else "macOS reports no usable Metal device")
        raise DeviceError(f"--device mps was requested, but MPS is not available: {why}. "
                          "Use --device auto or --device cpu.")
    return torch.device(preference)
# --8<-- [end:pick-device]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_features() -> list[str]:
    """CPU instructions for bf16 math: with them, bf16 matmuls run faster than fp32 on the CPU.

    AMX (recent Intel Xeon) gives the largest gain; AVX512-BF16 (some AMD EPYC, Intel Cooper
    Lake and later) a smaller one. Without either, bf16 is emulated and slower than fp32.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return []
    return [name for name in ("amx_bf16", "avx512_bf16") if name in flags]


# --8<-- [start:kernel-families]
# PyTorch picks its CPU kernels at the first op, each library by its own probe of the CPU: ATen's
# vectorised kernels (elementwise ops, softmax, reductions), MKL's fp32 matmuls, oneDNN's bf16
# matmuls and attention (AMX where present). A wider vector adds in another order, so the last
# bits of a result depend on the family. These settings emulate a lower CPU on this one; cap all
# three together, as a real CPU of that level would be: ATen capped alone still finds AMX through
# oneDNN, and bf16 attention then raises "pack_vnni2 is only supported when avx512 is supported".
KERNEL_FAMILIES = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
# --8<-- [end:kernel-families]


def set_threads(threads: int, why: str) -> int:
    """Set this process's intra-op threads, and say so on stderr when that changes them: a
    script that changes a process-wide setting tells its reader (stdout keeps its results).
    Returns the count before, for a caller that restores it."""
    before = torch.get_num_threads()
    if threads != before:
        print(f"note: {threads} intra-op thread{'' if threads == 1 else 's'} instead of "
              f"{before}: {why}", file=sys.stderr)
    torch.set_num_threads(threads)
    return before


# --8<-- [start:machine-info]
def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_features": cpu_bf16_features(),
        "device": str(pick_device("auto")),
        "distributed_backends": [
            name
            for name, ok in [
                ("gloo", torch.distributed.is_gloo_available()),
                ("nccl", torch.distributed.is_nccl_available()),
                ("mpi", torch.distributed.is_mpi_available()),
            ]
            if ok
        ],
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
# --8<-- [end:machine-info]


if __name__ == "__main__":
    print(json.dumps(machine_info(), indent=2))
