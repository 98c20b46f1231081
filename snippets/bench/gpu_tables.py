"""bench.json's GPU section (`make bench-gpu`, snippets/bench/gpu.py) as Markdown tables.

The pages show them through docs/_hooks/measured_numbers.py (a line `{{ gpu-table:NAME }}`), the
benchmarks lesson prints them; both show the line NO_GPU_RUN while bench.json has no GPU
section, so a GPU number on the site only ever comes from a real run. No torch here: the site's
hook imports this module.
"""

from __future__ import annotations

NO_GPU_RUN = ("*No GPU run recorded yet: `make bench-gpu`, on a machine with an NVIDIA GPU, "
              "writes the GPU section of bench.json, and this table then shows it, with the "
              "device named.*")
MODEL_LABELS = {"readable": "course GPT, readable", "fused": "course GPT, fused (`fuse`)",
                "fused_compiled": "course GPT, fused + `torch.compile`",
                "nanogpt": "nanoGPT-shaped, eager", "nanogpt_compiled": "nanoGPT-shaped, compiled",
                "fused_layernorm_no_rope": "ablation: fused, LayerNorm for RMSNorm, no RoPE"}



def gib(n) -> str:
    return f"{n / 2**30:.2f} GiB"


def gpu_throughput(gpu: dict) -> list[str]:
    t = gpu["throughput"]
    rows = [f"GPT-2 small shapes, {t['batch_size']} sequences of {t['seq_len']} tokens a step, "
            f"vocabulary {t['vocab_size']}: {t['precision']}.", "",
            "| model | ms/step | tokens/s | MFU | × nanoGPT eager |", "| --- | --- | --- | --- | --- |"]
    for name, m in t["models"].items():
        mfu = "n/a" if m["mfu"] is None else f"{m['mfu']:.3f}"
        rows.append(f"| {MODEL_LABELS.get(name, name)} | {m['step_ms']:.2f} | "
                    f"{m['tokens_per_s']:,} | {mfu} | {t['ratio_to_nanogpt'][name]:.3f} |")
    if "mfu_note" in t:
        rows += ["", t["mfu_note"] + "."]
    return rows


def gpu_matmul(gpu: dict) -> list[str]:
    m = gpu["matmul"]
    rows = [f"A {m['size']} × {m['size']} by {m['size']} × {m['size']} matmul ({m['clock']}).", "",
            "| precision | TFLOP/s |", "| --- | --- |"]
    for key, label in (("fp32", "fp32"), ("tf32", "TF32 (fp32 inputs, TF32 tensor cores)"),
                       ("bf16", "bf16"), ("fp8", "fp8 e4m3, `torch._scaled_mm`")):
        if f"{key}_tflops" in m:
            rows.append(f"| {label} | {m[f'{key}_tflops']:.1f} |")
    if "fp8_skipped" in m:
        rows.append(f"| fp8 | not run: {m['fp8_skipped']} |")
    return rows


def gpu_memory(gpu: dict) -> list[str]:
    rows = ["| config | recipe | state | activations | planner's activations | ratio | peak |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, config in gpu["memory"].items():
        for run, r in config["runs"].items():
            measured, planner = r["measured_bytes"], r["planner_bytes"]
            rows.append(f"| {name}, {config['batch_size']} × {config['seq_len']} | "
                        f"{run.replace('_', ', ')} | {gib(measured['state'])} | "
                        f"{gib(measured['activations'])} | {gib(planner['activations'])} | "
                        f"{r['activations_over_planner']:.3f} | {gib(measured['peak'])} |")
    return rows


def gpu_fsdp(gpu: dict) -> list[str]:
    f = gpu["fsdp"]
    measured, formula = f["measured_bytes"], f["formula_bytes"]
    return [f"The scratch FSDP on one GPU ({f['backend']}, a world of {f['world_size']}): "
            f"{f['config']}, {f['batch_size']} × {f['seq_len']} tokens, bf16 compute.", "",
            "| | measured | lesson's formula |", "| --- | --- | --- |",
            f"| state (fp32 master, gradient, Adam moments) | {gib(measured['state'])} | "
            f"{gib(formula['state'])} |",
            f"| peak of a step | {gib(measured['peak'])} | {gib(sum(formula.values()))} |"]


GPU_TABLES = {"throughput": gpu_throughput, "matmul": gpu_matmul, "memory": gpu_memory,
              "fsdp": gpu_fsdp}


def gpu_table(gpu: dict | None, name: str) -> str:
    """The Markdown of one GPU table from bench.json's results["gpu"], headed by the device it
    ran on, or the line saying no GPU run is recorded yet (`gpu` None)."""
    if name not in GPU_TABLES:
        raise KeyError(f"unknown GPU table {name!r} (known: {', '.join(GPU_TABLES)})")
    if not gpu:
        return NO_GPU_RUN + "\n"
    if name not in gpu:
        return (f"*The recorded GPU run ({gpu['device']['name']}) did not measure {name}: "
                f"`make bench-gpu GPU_BENCH_FLAGS=\"--parts {name}\"` adds it.*\n")
    d = gpu["device"]
    head = (f"Measured on one **{d['name']}** (driver {d['driver']}, torch {d['torch']}, "
            f"CUDA {d['cuda']}) by `make bench-gpu`, {gpu.get('date', 'date not recorded')}:")
    return "\n".join([head, "", *GPU_TABLES[name](gpu)]) + "\n"
