"""Describe the machine a run happened on, and pick the device to train on.

Benchmarks store `machine_info()` beside every number they write, because a time means nothing
without the hardware it was measured on. `python -m snippets.machine` prints it as JSON.
"""

import json
import os
import platform

import torch


# --8<-- [start:pick-device]
def pick_device(preference: str = "auto") -> torch.device:
    """Return the device to train on: CUDA if present, else Apple's MPS, else the CPU."""
    available = {
        "cuda": torch.cuda.is_available(),
        "mps": torch.backends.mps.is_available(),
        "cpu": True,
    }
    if preference == "auto":
        return torch.device(next(name for name, ok in available.items() if ok))
    if preference not in available:
        raise ValueError(f"--device {preference!r} is not one of auto, cuda, mps, cpu")
    if not available[preference]:
        usable = ", ".join(name for name, ok in available.items() if ok)
        raise RuntimeError(
            f"--device {preference} was requested but this machine has no {preference} device; "
            f"use --device auto or one of: {usable}"
        )
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


# --8<-- [start:machine-info]
def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
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
