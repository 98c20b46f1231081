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
# # Collectives from a notebook, with nbdistributed
#
# A notebook, not a module: open it in Jupyter (jupytext reads this file as a notebook), or
# convert it with `jupytext --to ipynb snippets/notebooks/nbdistributed_collectives.py`.
# Every `%%distributed` cell runs on each of two worker processes (gloo on the CPU, NCCL with
# one GPU each on a GPU machine), and each rank keeps its variables from cell to cell.
# The page docs/course/week-1/nbdistributed.md explains each cell; tests/test_nbdistributed.py
# executes this notebook.

# %%
# --8<-- [start:python-on-path]
import os
import sys

# nbdistributed 0.1.0 starts each worker as `python worker.py ...`, with whichever `python` comes
# first on PATH. Put this kernel's interpreter first, so the workers get the same packages.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
# --8<-- [end:python-on-path]

# %%
# %load_ext nbdistributed

# %%
# %dist_init -n 2
# --8<-- [start:wait]
from snippets.notebooks.nbdistributed_workers import wait_for_workers

wait_for_workers()  # %dist_init returns before the workers listen: see nbdistributed_workers.py
# --8<-- [end:wait]

# %%
# %%distributed
# --8<-- [start:hello]
print(f"rank {rank} of {world_size}, backend {dist.get_backend()}, device {device}")
# --8<-- [end:hello]

# %%
# %%distributed
# --8<-- [start:all-reduce]
x = (torch.arange(4) + 10 * rank).to(device)  # NCCL needs the tensor on this rank's GPU
before = x.tolist()
dist.all_reduce(x)  # sum, in place, on every rank
print(f"all_reduce: {before} -> {x.tolist()}")
# --8<-- [end:all-reduce]

# %%
# %%rank [0]
# --8<-- [start:one-rank]
print(f"only rank {rank} runs this cell, and its x is still here: {x.tolist()}")
# --8<-- [end:one-rank]

# %%
# %%distributed
# --8<-- [start:all-gather]
pieces = [torch.empty(2, dtype=torch.long, device=device) for _ in range(world_size)]
dist.all_gather(pieces, torch.tensor([rank, 100 + rank], device=device))
print(f"all_gather: {[p.tolist() for p in pieces]}")
# --8<-- [end:all-gather]
