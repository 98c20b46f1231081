"""Tiny-GPT training throughput in fp32 and bf16 autocast on this machine, and model FLOPs
utilisation (MFU) against the matmul peak measured in the same run."""

import time

import torch

from snippets.bench.matmul import matmul_flops_per_second
from snippets.machine import pick_device
from snippets.models.gpt import GPT, get_config
from snippets.planner.flops import training_flops_per_token


def tokens_per_second(model, batch, device, dtype, min_seconds=3.0) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = batch

    def step():
        # autocast runs the matmuls in dtype and keeps weights, grads and optimizer in fp32
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up: allocator, kernel selection, Adam state
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        step()
        steps += 1
    sync()
    return steps * inputs.numel() / (time.perf_counter() - start)


def run(config_name: str = "small", batch_size: int = 8) -> dict:
    device = pick_device("auto")
    config = get_config(config_name)
    seq_len = config.max_position_embeddings
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    flops_per_token = training_flops_per_token(config, seq_len)
    out = {"device": str(device), "config": config_name, "batch_size": batch_size,
           "seq_len": seq_len, "training_flops_per_token": flops_per_token}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        torch.manual_seed(0)
        model = GPT(config).to(device)
        tps = tokens_per_second(model, batch, device, dtype)
        peak = matmul_flops_per_second(1024, dtype, device)
        out[name] = {
            "tokens_per_s": round(tps),
            "model_gflops": round(tps * flops_per_token / 1e9, 2),
            "matmul_peak_gflops": round(peak / 1e9, 1),
            "mfu": round(tps * flops_per_token / peak, 3),
        }
    out["bf16_over_fp32_tokens_per_s"] = round(out["bf16"]["tokens_per_s"] / out["fp32"]["tokens_per_s"], 2)
    return out


if __name__ == "__main__":
    print(run())
