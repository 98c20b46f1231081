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
# # Measured: memory and traffic per rank
#
# **What you will learn:** how many bytes of model state one rank really holds under data
# parallelism and under ZeRO 1, 2 and 3, counted from the tensors themselves rather than from a
# formula; how close those counts come to the ZeRO paper's formulas; what the peak memory of a
# step adds on top; and how many bytes each rank sends per step, counted collective by
# collective.
#
# This page was executed when the site was built: every number and the plot come from that
# run, on the machine that built it (CPU processes talking through PyTorch's `gloo` backend).
#
# ## What is measured
#
# The model is the course's `small` GPT in fp32, trained with AdamW, one sequence of 128 tokens
# per rank. Five variants, each built from the same initial weights in the same processes:
#
# | variant | what each rank keeps | code |
# | --- | --- | --- |
# | DDP | everything: weights, gradients (as views into DDP's buckets), AdamW's two moments | `torch.nn.parallel.DistributedDataParallel` |
# | ZeRO-1 | full weights and gradients, moments for 1/N of the parameters | `ZeRO1Optimizer` |
# | ZeRO-2 | full weights, gradients and moments for 1/N | `ZeRO2Optimizer` |
# | ZeRO-3 | weights, gradients and moments for 1/N; full weights only while a block runs | `ZeRO3` |
# | FSDP2 | the same as ZeRO-3, done by PyTorch (one unit per block, then the root) | `torch.distributed.fsdp.fully_shard` |
#
# The classes are those of [ZeRO 1, 2 and 3 from scratch](../../course/week-2/zero-from-scratch/).
# After two warm-up steps (AdamW creates its moments at the first), one more step is run and
# then, on every rank:
#
# - **model state** is counted by `model_state_bytes`, which walks the parameters, their
#   gradients and the optimizer's state, and adds up the size of each distinct storage it
#   reaches. A storage that ZeRO-3 has released has size 0; a shard that is a view into the
#   flat weights is counted once.
# - **peak** is that model state plus the most bytes allocated at once during the step (from the
#   CPU allocator's events, recorded by `torch.profiler`): activations, gathered weights, full
#   gradients in flight, AdamW's temporaries.
# - **bytes sent** are counted by `CommStats` as each collective is called, as a ring algorithm
#   would send them (DDP's through a communication hook that counts the same way).

# %%
import torch

from snippets.bench.zero_memory import measure_variants, summarise
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config

torch.set_num_threads(1)
psi = GPT(get_config("small")).num_parameters()
results = {}
for world_size in (2, 4):
    rows = spawn(measure_variants, world_size, "small", 128, 0, timeout_s=120)[0]  # rank 0
    results[world_size] = summarise(rows, psi, world_size)
print(f"small GPT: {psi:,} parameters, {4 * psi:,} bytes of fp32 weights (Psi = {psi:,})")

# %% [markdown]
# ## Model state per rank, measured beside the formula
#
# The formulas, for fp32 weights (4 bytes each), fp32 gradients (4) and AdamW's two fp32 moments
# (8), on N ranks: DDP $16\Psi$; ZeRO-1 $4\Psi + 4\Psi + 8\Psi/N$; ZeRO-2
# $4\Psi + (4 + 8)\Psi/N$; ZeRO-3 $16\Psi/N$.

# %%
MiB = 2**20
for world_size, rows in results.items():
    print(f"{world_size} ranks: MiB per rank, measured (formula)")
    print(f"  {'variant':<8}{'weights':>16}{'gradients':>16}{'optimizer':>16}{'total':>16}"
          f"{'ratio':>8}")
    for name, row in rows.items():
        cells = "".join(
            f"{row['state_bytes'][k] / MiB:>7.2f} ({row['state_formula_bytes'][k] / MiB:>5.2f})"
            for k in ("params", "grads", "optimizer", "total"))
        print(f"  {name:<8}{cells}{row['state_ratio_to_formula']:>8.4f}")

# %% [markdown]
# The measured bytes match the formula to within a few bytes: the padding that makes each flat
# buffer divisible by N (fewer than N elements per buffer) and AdamW's step counter, a 4-byte
# tensor per shard. The plot shows the same numbers: for each variant, the measured bytes
# stacked by kind, the formula's total as the hatched bar beside them, and the peak during a
# step as a black dash above.

# %%
import matplotlib.pyplot as plt

kinds = [("params", "weights", "#4c72b0"), ("grads", "gradients", "#dd8452"),
         ("optimizer", "AdamW moments", "#55a868")]
fig, axes = plt.subplots(1, len(results), figsize=(10, 3.8), sharey=True)
for ax, (world_size, rows) in zip(axes, results.items()):
    names = list(rows)
    x = range(len(names))
    bottom = [0.0] * len(names)
    for key, label, color in kinds:
        heights = [rows[n]["state_bytes"][key] / MiB for n in names]
        ax.bar([i - 0.2 for i in x], heights, 0.4, bottom=bottom, color=color, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar([i + 0.2 for i in x], [rows[n]["state_formula_bytes"]["total"] / MiB for n in names],
           0.4, fill=False, edgecolor="black", hatch="//", label="formula (total)")
    ax.plot([i - 0.2 for i in x], [rows[n]["peak_bytes"] / MiB for n in names], "k_",
            markersize=18, label="peak during a step")
    ax.set_xticks(list(x), names)
    ax.set_title(f"{world_size} ranks")
axes[0].set_ylabel("MiB per rank")
axes[-1].legend(fontsize=8, loc="upper right")
fig.suptitle("small GPT, fp32 AdamW: model state per rank, measured (stacked) and formula")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Peak memory of a step
#
# Model state is what stays between steps. During a step a rank also holds activations and
# temporaries, and each stage adds its own: ZeRO-2 a bucket of full gradients while it waits to
# be reduce-scattered, ZeRO-3 one block's gathered weights (plus the root unit: the tied
# embedding and the final norm) and that block's full gradients.

# %%
for world_size, rows in results.items():
    print(f"{world_size} ranks: {'variant':<8}{'model state MiB':>16}{'peak MiB':>10}"
          f"{'step adds MiB':>14}")
    for name, row in rows.items():
        state, peak = row["state_bytes"]["total"] / MiB, row["peak_bytes"] / MiB
        print(f"{'':9}{name:<8}{state:>16.2f}{peak:>10.2f}{peak - state:>14.2f}")

# %% [markdown]
# For a model this small, one 128-token sequence's activations and temporaries (the DDP row's
# "step adds") come to almost half the whole model state, and no stage shards them, so the peak
# falls by less than the model state does. For a 7B-parameter model in
# mixed precision the model state is 112 GB against a few GB of activations per sequence, and
# the model state is what decides whether training fits.
#
# ## Bytes sent per rank per step
#
# Counted as each collective was called, against the ring volumes: an all-reduce of $B$ bytes
# sends $2(N-1)/N \cdot B$ per rank, an all-gather or a reduce-scatter $(N-1)/N \cdot B$.

# %%
for world_size, rows in results.items():
    print(f"{world_size} ranks: MiB sent per rank per step")
    print(f"  {'variant':<8}{'all-reduce':>12}{'reduce-scatter':>16}{'all-gather':>12}"
          f"{'total':>9}{'theory':>9}{'vs DDP':>8}")
    for name, row in rows.items():
        sent = row["sent_by_collective"]
        if sent is None:  # FSDP2's collectives do not go through CommStats
            continue
        cells = "".join(f"{sent.get(k, 0) / MiB:>{w}.2f}" for k, w in
                        (("all_reduce", 12), ("reduce_scatter", 16), ("all_gather", 12)))
        print(f"  {name:<8}{cells}{row['sent_bytes_per_step'] / MiB:>9.2f}"
              f"{row['sent_theory_bytes'] / MiB:>9.2f}{row['sent_theory_vs_ddp']:>7.1f}x")

# %% [markdown]
# ## What to observe
#
# - **Each stage removes one term.** ZeRO-1 shrinks only the optimizer column, ZeRO-2 the
#   gradients too, ZeRO-3 everything. At 4 ranks ZeRO-3 holds a quarter of DDP's bytes: the
#   saving grows with N, without limit, while ZeRO-1 and ZeRO-2 can never go below the full
#   weights (and gradients) they keep.
# - **Measured equals formula** because the implementation keeps no hidden copies: the shards of
#   ZeRO-1 and 2 are views into the flat weights, the gradients of ZeRO-1 are views into one flat
#   buffer, and ZeRO-3 really releases the gathered weights (their storage is resized to 0).
#   A second copy anywhere would show up here as a ratio of 1.25 or more.
# - **Traffic.** ZeRO-2 sends exactly what DDP sends: a reduce-scatter plus an all-gather is the
#   two halves of an all-reduce. ZeRO-3 sends 1.5 times as much, because the weights are
#   gathered twice per step (forward and backward). ZeRO-1 as built here sends 1.5 times too: it
#   all-reduces the full gradient although each rank only needs its shard of it; replacing that
#   all-reduce by a reduce-scatter brings it down to DDP's volume, as in the paper.
#
# The step time of each variant against DDP's is measured by `python -m snippets.bench.zero_memory`
# (see [ZeRO from scratch](../../course/week-2/zero-from-scratch/#measured)).
