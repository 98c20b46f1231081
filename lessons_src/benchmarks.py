# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Benchmarks
#
# Every speed and memory number the course quotes comes from one run of `make bench`. That run
# writes `bench.json` at the repository root, with the machine, the torch version and the date.
# This page is built from that file: the tables are printed by the benchmark modules' own
# formatters and the plots drawn from the same numbers. Nothing on the page is typed in by hand.
#
# **How to read it.** The machine is shared and has 2 CPU cores, so absolute times are noise.
# Compare the **ratios** taken in the same run instead (bf16 over fp32, a from-scratch version
# over the library one, measured over formula). To reproduce one section, run its module, for
# example `python -m snippets.bench --only zero_memory --out /tmp/bench.json`. The whole set is
# `make bench`.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt

ROOT = Path.cwd()
while not (ROOT / "bench.json").exists():  # the lesson runs from docs/lessons/ when built
    ROOT = ROOT.parent
report = json.loads((ROOT / "bench.json").read_text())
results = report["results"]
machine = report["machine"]
print(f"run on {report['date']}")
for key in ("cpu", "cpu_count", "torch", "python", "cpu_bf16_features", "device",
            "distributed_backends"):
    print(f"  {key:<22} {machine.get(key)}")
print("benchmarks:", ", ".join(results))

# %% [markdown]
# ## Matmul peak and training throughput, fp32 vs bf16
#
# The matmul peak is the denominator of model FLOPs utilisation (MFU): the most FLOP/s this CPU
# reaches on large square matmuls. Training throughput is the small GPT's tokens per second,
# measured in fp32 and under bf16 autocast. See
# [the calculator](../../reference/calculator/#flops-and-communication) for what MFU leaves out
# and [FP8 and low precision](../../course/week-3/low-precision/) for why bf16 training gains so
# much less than its matmuls on this CPU. Reproduce:
# `python -m snippets.bench --only matmul --only train_throughput --out /tmp/b.json`.

# %%
mm, tt = results["matmul"], results["train_throughput"]
sizes = list(mm["sizes"])
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
for dtype in ("fp32", "bf16"):
    left.plot(sizes, [mm["sizes"][s][f"{dtype}_gflops"] for s in sizes], "o-", label=dtype)
left.set(xlabel="matrix size n (n x n @ n x n)", ylabel="GFLOP/s", title="matmul")
left.legend()
bars = [tt["fp32"]["tokens_per_s"], tt["bf16"]["tokens_per_s"]]
right.bar(["fp32", "bf16 autocast"], bars, color=["C0", "C1"])
right.set(ylabel="tokens/s", title=f"{tt['config']} GPT training, batch {tt['batch_size']} x "
                                   f"{tt['seq_len']}")
plt.tight_layout()
plt.show()
print(f"matmul peak: fp32 {mm['peak_fp32_gflops']} GFLOP/s, bf16 {mm['peak_bf16_gflops']} "
      f"({mm['peak_bf16_gflops'] / mm['peak_fp32_gflops']:.2f}x)")
for dtype in ("fp32", "bf16"):
    r = tt[dtype]
    print(f"training {dtype}: {r['tokens_per_s']:,} tokens/s, {r['model_gflops']} GFLOP/s, "
          f"MFU {r['mfu']}")
print(f"bf16 / fp32 tokens/s: {tt['bf16_over_fp32_tokens_per_s']}")

# %% [markdown]
# ## On a GPU: GPT-2 small against nanoGPT, matmuls by precision, memory against the planner
#
# `make bench-gpu`, on a machine with an NVIDIA GPU, writes the GPU section of `bench.json`
# (`snippets/bench/gpu.py`): GPT-2 small's tokens/s and MFU for the course's GPT (readable,
# fused, compiled) beside the nanoGPT-shaped model, matmul TFLOP/s in fp32, TF32, bf16 and FP8,
# peak memory against the [planner](../../reference/calculator/)'s formulas with and without
# activation checkpointing, and the [scratch FSDP](../../course/week-2/fsdp-from-scratch/)'s
# mixed-precision memory. A CPU run keeps that section; the tables below come only from it.

# %%
from snippets.bench.gpu_tables import GPU_TABLES, NO_GPU_RUN, gpu_table

gpu = results.get("gpu")
if gpu is None:
    print(NO_GPU_RUN.strip("*"))
else:
    for name in GPU_TABLES:
        print(gpu_table(gpu, name))

# %% [markdown]
# ## All-reduce bandwidth: the ring from scratch vs `dist.all_reduce`
#
# [Ring all-reduce](../../course/week-1/ring-allreduce/) built from `isend`/`recv`, against
# gloo's own all-reduce, on 2 and 4 processes. Bus bandwidth (busbw) rescales by 2(N−1)/N so that
# different world sizes are comparable. Reproduce: `python -m snippets.bench.allreduce_bandwidth`.

# %%
from snippets.bench import allreduce_bandwidth

ar = results["allreduce_bandwidth"]
print(allreduce_bandwidth.format_table(ar))
fig, ax = plt.subplots(figsize=(6, 3.2))
for key in (k for k in ar if k.startswith("world_")):
    rows = ar[key]["sizes"]
    for impl, style in (("ring", "o-"), ("dist", "s--")):
        ax.plot([r["bytes"] for r in rows], [r[impl]["busbw_GBps"] for r in rows], style,
                label=f"{impl}, {key.removeprefix('world_')} ranks")
ax.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="bus bandwidth, GB/s")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## DDP from scratch vs `DistributedDataParallel`
#
# Step time of the three [from-scratch DDP](../../course/week-1/ddp-from-scratch/) wrappers and
# of torch's DDP, 2 ranks, the small GPT. A ratio below 1 is faster than torch. Reproduce:
# `python -m snippets.bench.ddp_step_time`.

# %%
from snippets.bench import ddp_step_time

print(ddp_step_time.format_table(results["ddp_step_time"]))

# %% [markdown]
# ## Memory per rank: DDP vs ZeRO 1, 2, 3 (and FSDP2)
#
# Bytes each rank really holds for weights, gradients and optimizer state, divided by the ZeRO
# paper's formula (fp32 here: 16Ψ for DDP, 4Ψ + 4Ψ + 8Ψ/N for ZeRO-1, and so on), and the bytes
# each rank sends per step against the ring-algorithm theory. See
# [ZeRO from scratch](../../course/week-2/zero-from-scratch/). Reproduce:
# `python -m snippets.bench.zero_memory`.

# %%
from snippets.bench import zero_memory

zm = results["zero_memory"]
print(zero_memory.format_tables(zm))
worlds = list(zm["by_world_size"])
fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 3.2), sharey=True)
for ax, n in zip(axes, worlds):
    rows = zm["by_world_size"][n]
    names = list(rows)
    measured = [rows[v]["state_bytes"]["total"] / 2**20 for v in names]
    formula = [rows[v]["state_formula_bytes"]["total"] / 2**20 for v in names]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], measured, width=0.4, label="measured")
    ax.bar([i + 0.2 for i in x], formula, width=0.4, label="formula")
    ax.set_xticks(list(x), names)
    ax.set(title=f"{n} ranks", ylabel="model state per rank, MiB")
axes[0].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Pipeline bubble: measured vs (p − 1)/(m + p − 1)
#
# Stages are fixed-time blocks of real matmuls, so the idle time between them is what the
# schedule creates. The benchmark then measures each stage's busy time against the step's span.
# See [pipeline parallelism from scratch](../../course/week-3/pipeline-from-scratch/) for the
# method and its limits on 2 shared cores. Reproduce: `python -m snippets.bench.pipeline_bubble`.

# %%
from snippets.bench import pipeline_bubble

pb = results["pipeline_bubble"]
print(pipeline_bubble.format_tables(pb))
fig, ax = plt.subplots(figsize=(6, 3.2))
for p in sorted({r["stages"] for r in pb["bubble"]}):
    rows = [r for r in pb["bubble"] if r["stages"] == p]
    m = [r["micro_batches"] for r in rows]
    ax.plot(m, [r["theory"] for r in rows], "k:", label="theory" if p == 2 else None)
    ax.plot(m, [r["1f1b"] for r in rows], "o-", label=f"1F1B, p={p}")
    ax.plot(m, [r["gpipe"] for r in rows], "s--", label=f"GPipe, p={p}")
ax.set(xlabel="micro-batches m", ylabel="bubble fraction", xscale="log", xticks=[2, 4, 8])
ax.set_xticklabels(["2", "4", "8"])
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Tensor parallelism: step time and bytes sent
#
# The [from-scratch tensor-parallel](../../course/week-4/tensor-parallel-from-scratch/) GPT and
# the DTensor version against one process, with every all-reduce counted against the theory of
# two per block each way. Reproduce: `python -m snippets.bench.tensor_parallel`.

# %%
from snippets.bench import tensor_parallel

print(tensor_parallel.format_table(results["tensor_parallel"]))

# %% [markdown]
# ## Scaling: 1 → 2 → 4 processes
#
# The same training job started by the
# [fake multi-node launcher](../../workshop/session-c/demo/) on 1, 2 and 4 processes. With 2
# cores, 4 processes cannot be faster than 2, and the numbers show it. Reproduce:
# `python -m snippets.cluster.scaling`.

# %%
sc = results["scaling"]
print(f"{sc['cpu_cores']} CPU cores")
print("processes  nodes  tokens/s  speed-up  efficiency")
for r in sc["rows"]:
    print(f"{r['processes']:9d}  {r['nodes']:5d}  {r['tokens_per_s']:8,d}  {r['speedup']:7.2f}x"
          f"  {r['efficiency']:10.2f}")
