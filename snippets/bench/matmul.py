"""Matrix-multiply throughput of this device in fp32 and bf16: the peak that model FLOPs
utilisation (MFU) is measured against, and the first evidence of what mixed precision buys."""

import time

import torch

from snippets.machine import pick_device


def matmul_flops_per_second(n: int, dtype: torch.dtype, device: torch.device,
                            min_seconds: float = 0.5) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):  # warm-up: first calls pick kernels and allocate workspace
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        a @ b
        iterations += 1
    sync()
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iterations / elapsed  # n^2 outputs, each n multiplies and n adds


def run() -> dict:
    device = pick_device("auto")
    out = {"device": str(device), "sizes": {}}
    for n in (512, 1024, 2048):
        fp32 = matmul_flops_per_second(n, torch.float32, device)
        bf16 = matmul_flops_per_second(n, torch.bfloat16, device)
        out["sizes"][str(n)] = {
            "fp32_gflops": round(fp32 / 1e9, 1),
            "bf16_gflops": round(bf16 / 1e9, 1),
            "bf16_over_fp32": round(bf16 / fp32, 2),
        }
    out["peak_fp32_gflops"] = max(v["fp32_gflops"] for v in out["sizes"].values())
    out["peak_bf16_gflops"] = max(v["bf16_gflops"] for v in out["sizes"].values())
    return out


if __name__ == "__main__":
    print(run())
