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
# # Demo: four workers with torchrun
#
# **What you will learn:** what `torchrun --nproc_per_node=4` actually starts; how each of the
# four processes learns who it is (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`); why each writes its own
# log; how the data is cut so that no two workers train on the same example; and how you can
# *see*, from the logs alone, that gradient synchronisation keeps four copies of a model
# identical, and that without it they drift apart at once.
#
# The page was executed when the site was built. Every log line, number and plot below comes
# from that run: four CPU processes on one machine, talking through PyTorch's `gloo` backend.
# On a machine with four GPUs the same command starts one process per GPU and they talk
# through NCCL instead; nothing else in the script changes.
#
# ## The idea
#
# Data parallelism is one script started N times. Each process (a "GPU worker") holds a full
# copy of the model, trains on its own slice of every batch, and after each backward pass the
# workers average their gradients, so every copy takes the same optimizer step and the copies
# never differ. The launcher, `torchrun`, starts the processes and gives each a few
# environment variables:
#
# | variable | meaning | here |
# | --- | --- | --- |
# | `WORLD_SIZE` | how many processes take part in the job | 4 |
# | `RANK` | this process's number in the whole job, 0 to `WORLD_SIZE - 1` | 0, 1, 2, 3 |
# | `LOCAL_RANK` | its number on this machine: which GPU it should use | equal to `RANK` on one machine |
# | `MASTER_ADDR`, `MASTER_PORT` | where rank 0 listens, so the others can find it | `localhost`, a free port |
#
# The script is `snippets/scripts/ddp_simulation_train.py`. It reads those variables
# (`snippets.dist.init_from_env`), wraps the tiny GPT of Session A in PyTorch's
# `DistributedDataParallel`, and logs from every rank.
#
# ## Start four workers
#
# The command a reader types is
# `torchrun --nproc_per_node=4 snippets/scripts/ddp_simulation_train.py --max-steps 10`.
# Here it runs through `python -m torch.distributed.run` (which is what the `torchrun` command
# is) with the logs and the checkpoint in a scratch folder, and one thread per process:
# four processes on a two-core machine gain nothing from more.

# %%
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import snippets

ROOT = Path(snippets.__file__).resolve().parents[1]  # the repository: torchrun runs from there
scratch = Path(tempfile.mkdtemp(prefix="session-b-demo-"))


def torchrun(nproc: int, run_name: str, *script_args: str) -> Path:
    """Run the demo script under torchrun; print what rank 0 printed; return the log folder."""
    log_dir = scratch / run_name / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "snippets/scripts/ddp_simulation_train.py", *script_args,
               "--log-dir", str(log_dir), "--ckpt", str(scratch / run_name / "ckpt.pt")]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"torchrun failed ({result.returncode}):\n{result.stderr[-3000:]}")
    print(f"$ torchrun --nproc_per_node={nproc} snippets/scripts/ddp_simulation_train.py "
          f"{' '.join(script_args)}")
    print(result.stdout.strip())
    print(f"[{time.perf_counter() - start:.1f} s, including starting {nproc} Python processes]")
    return log_dir


logs = torchrun(4, "sync", "--max-steps", "10")

# %% [markdown]
# Only rank 0 printed to the terminal: four processes printing the same progress would
# interleave into noise. Rank 0's `MASTER` line shows where the others connected to it. Every
# rank wrote its own log file, `logs/rank_N/train.log`; a file per rank is what you open when
# one worker misbehaves, because its lines are not drowned by the other three.

# %%
for path in sorted(logs.glob("rank_*/train.log")):
    lines = path.read_text().splitlines()
    print(f"--- {path.relative_to(scratch)} ({len(lines)} lines)")
    for line in lines[:3]:
        print(line)

# %% [markdown]
# Each process found out who it is from its environment, and nothing else differs between
# them: the same script, the same arguments, the same seed, hence the same initial weights
# (DDP also copies rank 0's weights to everyone when it wraps the model, to be sure).
#
# ## Sharding: a different slice for every worker
#
# The second and third lines of each log are the data. `DistributedSampler` shuffles the 4,616
# windows of the corpus with a seed that every rank shares (so all four agree on one
# permutation, without communicating), then rank *r* takes positions *r*, *r* + 4, *r* + 8, ...
# of it: 1,154 examples each, 144 batches of 8. One optimizer step therefore trains on
# 4 × 8 = 32 sequences, 2,048 tokens, but each process only ever runs a batch of 8. Rebuilding
# the samplers here shows the four shards are disjoint and cover the data:

# %%
from torch.utils.data import DistributedSampler

dataset_size, world = 4616, 4
shards = [list(DistributedSampler(range(dataset_size), num_replicas=world, rank=r, shuffle=True,
                                  seed=0, drop_last=True)) for r in range(world)]
for rank, shard in enumerate(shards):
    print(f"rank {rank}: {len(shard)} examples, first four {shard[:4]}")
everything = set().union(*map(set, shards))
print(f"overlap between shards: {sum(map(len, shards)) - len(everything)} examples; "
      f"covered: {len(everything)} of {dataset_size}")

# %% [markdown]
# The first four indices match what each rank logged. With 4,616 = 4 × 1,154 nothing had to
# be dropped or repeated; [Lab 2](../../workshop/session-b/lab-2/) shows what happens when the
# dataset does not divide by the world size.
#
# ## Local loss, global loss
#
# Every step, each rank logs the loss on *its own* batch of 8 sequences (the local loss), and
# the mean of the four local losses (the global loss, gathered with one extra all-reduce,
# for logging only). Reading all four logs back:

# %%
STEP = re.compile(r"step\s+(\d+) \| local loss (\S+) \| global loss (\S+) \| ([\d,]+) tokens/s"
                  r" \| replicas in sync: (\w+) \| checksum (\S+)")


def read_steps(log_dir: Path) -> dict:
    """{rank: [{step, local, global, tokens_per_s, in_sync, checksum}, ...]} from the logs."""
    runs = {}
    for path in sorted(log_dir.glob("rank_*/train.log")):
        rank = int(path.parent.name.removeprefix("rank_"))
        runs[rank] = [
            {"step": int(m[1]), "local": float(m[2]), "global": float(m[3]),
             "tokens_per_s": int(m[4].replace(",", "")), "in_sync": m[5] == "True",
             "checksum": float(m[6])}
            for m in STEP.finditer(path.read_text())
        ]
    return runs


runs = read_steps(logs)
print("step " + "".join(f"  rank {r} local" for r in runs) + "   global   mean of locals")
for i in range(len(runs[0])):
    locals_ = [runs[r][i]["local"] for r in runs]
    print(f"{runs[0][i]['step']:>4} " + "".join(f"{x:>14.4f}" for x in locals_)
          + f"{runs[0][i]['global']:>9.4f}{sum(locals_) / len(locals_):>15.4f}")

# %%
import matplotlib.pyplot as plt

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
steps = [s["step"] for s in runs[0]]
for rank, records in runs.items():
    local = [s["local"] for s in records]
    left.plot(steps, local, "o-", ms=3, lw=1, alpha=0.7, label=f"rank {rank}: its own 8 sequences")
    right.plot(steps, [x - s["global"] for x, s in zip(local, records)], "o-", ms=4, lw=1,
               label=f"rank {rank}")
left.plot(steps, [s["global"] for s in runs[0]], "k-", lw=2.5, label="global loss (mean of the four)")
left.set(xlabel="optimizer step", ylabel="cross-entropy (nats per byte)",
         title="Local losses and the global loss")
left.legend(fontsize=8)
right.axhline(0, c="k", lw=2.5)
right.set(xlabel="optimizer step", ylabel="local loss - global loss (nats)",
          title="The same curves, minus the global loss")
right.legend(fontsize=8)
fig.tight_layout()
plt.show()
spread = max(abs(s["local"] - s["global"]) for records in runs.values() for s in records)
print(f"largest gap between a local loss and the global one: {spread:.3f} nats")

# %% [markdown]
# On the left the five curves are hard to tell apart; the right panel subtracts the global loss.
# In this run every local loss stays within a few hundredths of a nat of the global one (the
# largest gap is printed under the plot), and no rank is consistently above or below it: the
# scatter comes from the batches, not from the workers.
#
# This is the question of Lab 2: **why are the loss values slightly different per step, but
# similar?**
#
# - **Different:** at every step the four ranks evaluate the *same* weights on *different*
#   data. Each batch is 8 sequences drawn from a different shard, and a loss measured on 8
#   sequences is a noisy estimate: some batches are easier than others.
# - **Similar:** the weights really are the same (see the checksums below), and the four
#   batches come from the same text, so the four estimates scatter around one value, the loss
#   of the model on the whole global batch. That value is the global loss, and because the
#   batches are of equal size, the mean of the four local losses *is* the loss of the 32
#   sequences together: the last two columns agree, up to the rounding of the four-decimal
#   values in the logs.
# - **Moving together:** every rank takes the same optimizer step, computed from the average
#   of the four gradients (the gradient of that global loss). So the local curves cannot
#   wander apart; each step they all go down by about as much as the global curve does.
#
# ## Gradient synchronisation, seen in the checksums
#
# After every step each rank adds up all of its weights into one number and the script
# gathers the four sums. Equal sums are not a proof that two models are equal, but after
# millions of floating-point updates, two different models with equal sums to six decimals
# would be a remarkable accident; the test suite compares the full weights.

# %%
print("step  checksum on each rank                                   replicas in sync")
for i in range(len(runs[0])):
    sums = [runs[r][i]["checksum"] for r in runs]
    print(f"{runs[0][i]['step']:>4}  " + "  ".join(f"{c:.6f}" for c in sums)
          + f"   {all(runs[r][i]['in_sync'] for r in runs)}")
print(f"\nfinal checksums identical on all ranks: {len({runs[r][-1]['checksum'] for r in runs}) == 1}")

# %% [markdown]
# The sums change every step (the model is learning) and are identical on every rank at
# every step. Nothing but gradients was exchanged: no weight was ever sent after the start.
# Identical starting weights plus identical updates give identical weights, which is the
# whole of data parallelism. `DistributedDataParallel` did the exchange inside
# `loss.backward()`: it averaged each bucket of gradients across the four processes with an
# all-reduce as soon as backward had produced it (the [slides](../../workshop/session-b/slides/)
# build that all-reduce from messages between neighbours).
#
# The tokens/s each rank logs are per rank: four workers on two shared cores each run at a
# fraction of one process's speed; on four GPUs each would run at nearly full speed, and the
# job's throughput would be the sum.

# %%
speeds = {r: sorted(s["tokens_per_s"] for s in runs[r]) for r in runs}
for rank, s in speeds.items():
    print(f"rank {rank}: median {s[len(s) // 2]:,} tokens/s per step "
          f"(slowest {s[0]:,}, fastest {s[-1]:,})")
print(f"job total: about {sum(s[len(s) // 2] for s in speeds.values()):,} tokens/s")

# %% [markdown]
# ## Switch synchronisation off
#
# `--no-sync` leaves the model unwrapped: each rank still computes its loss, backward pass and
# optimizer step, but never averages gradients. Two ranks, five steps:

# %%
unsynced = read_steps(torchrun(2, "no-sync", "--max-steps", "5", "--no-sync"))

# %%
def spread(run: dict) -> list:
    """Largest minus smallest checksum across the ranks, per step: 0 when in sync."""
    return [max(run[r][i]["checksum"] for r in run) - min(run[r][i]["checksum"] for r in run)
            for i in range(len(run[0]))]


fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
for rank, records in unsynced.items():
    left.plot([s["step"] for s in records], [s["checksum"] for s in records], "o-",
              label=f"rank {rank}")
left.set(xlabel="optimizer step", ylabel="sum of all weights", title="--no-sync, 2 ranks",
         xticks=range(1, len(unsynced[0]) + 1))
left.legend(fontsize=8)
right.plot(range(1, len(unsynced[0]) + 1), spread(unsynced), "o-", c="tab:red",
           label="--no-sync, 2 ranks")
right.plot(range(1, len(runs[0]) + 1), spread(runs), "o-", c="k",
           label="synchronised, 4 ranks (run above)")
right.set(xlabel="optimizer step", ylabel="max - min checksum across ranks",
          title="Replicas drift apart without sync")
right.legend(fontsize=8)
fig.tight_layout()
plt.show()
for i, gap in enumerate(spread(unsynced), 1):
    sums = "  ".join(f"{unsynced[r][i - 1]['checksum']:.6f}" for r in unsynced)
    print(f"step {i}: checksums {sums}  differ by {gap:.6f}; "
          f"logged 'replicas in sync': {unsynced[0][i - 1]['in_sync']}")

# %% [markdown]
# From the first step on, the two unsynchronised ranks hold different models: each stepped
# along the gradient of its own 8 sequences only. (The first step already moves the sums
# apart by a lot: Adam's first update is about the learning rate times the *sign* of each
# gradient, so every weight whose gradient sign differs between the two batches moves the
# other way.) They started from the same weights, so their losses still look alike for a few
# steps, but nothing pulls them back together, and after five steps the gap is wider than
# after one. Their "global loss" is now the average of two different models' losses,
# which is not the loss of any model. Two copies trained apart are not one model trained on
# twice the data; that is why every data-parallel step must end with the gradients averaged
# (or, with gradient accumulation, every *optimizer* step: see the slides).
#
# ## Key takeaways
#
# - `torchrun --nproc_per_node=N` starts N copies of one script; each learns its role from
#   `RANK`, `LOCAL_RANK` and `WORLD_SIZE`, and rank 0 is where the others meet.
# - One log file per rank, with the rank in every line, and only rank 0 on the terminal.
# - `DistributedSampler` gives each rank a disjoint shard from one shared, seeded permutation:
#   no communication is needed to agree on who reads what.
# - Local losses differ because the data differs; they are similar because the model is the
#   same; the global loss is their mean. DDP averages gradients inside `backward()`, and equal
#   checksums on every rank show the replicas stayed identical. Without the averaging they
#   diverge from the first step.
#
# ## Further reading
#
# - [Lab 2. World size, failures, samplers](../../workshop/session-b/lab-2/): change the world
#   size, add a metric per rank, crash rank 2 on purpose, and test the sampler's padding.
# - PyTorch, *torchrun (Elastic Launch)*: the environment variables and the restart behaviour.
# - PyTorch, *Getting started with Distributed Data Parallel*, and Li et al., *PyTorch
#   Distributed: Experiences on Accelerating Data Parallel Training* (VLDB 2020), the paper
#   behind DDP's buckets and overlap.
