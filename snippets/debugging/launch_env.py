"""Print the environment a launcher gave each process, one column per rank.

    torchrun --nproc_per_node=2 snippets/debugging/launch_env.py
    srun torchrun --nproc_per_node=2 snippets/debugging/launch_env.py   (SLURM_* beside torchrun's)

Every rank joins a gloo process group and sends its variables to rank 0, which prints one table,
so the output does not interleave.
"""

import os
import re

import torch.distributed as dist

from snippets.dist import init_from_env, leave_process_group

# Variables a launcher (torchrun, SLURM) or the user sets for a distributed job.
LAUNCH_VARIABLE = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
    r"|MASTER_ADDR|MASTER_PORT|NODE_RANK|OMP_NUM_THREADS|TORCHELASTIC_\w+|TORCH_\w+|NCCL_\w+"
    r"|SLURM_(JOB_ID|NNODES|NODEID|PROCID|LOCALID|NTASKS|JOB_NODELIST|NTASKS_PER_NODE))$")
# Differs on every run: shown shortened.
RUN_SPECIFIC = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT"}


def launch_variables() -> dict:
    found = {k: v for k, v in os.environ.items() if LAUNCH_VARIABLE.match(k)}
    return {k: ("(per run)" if k in RUN_SPECIFIC else v) for k, v in found.items()}


def main() -> None:
    env = init_from_env("gloo")
    gathered = [None] * env["world_size"]
    dist.all_gather_object(gathered, launch_variables())
    if env["rank"] == 0:
        names = sorted(set().union(*gathered))
        columns = [["variable", *names]] + [[f"rank {r}", *(g.get(n, "-") for n in names)]
                                            for r, g in enumerate(gathered)]
        widths = [max(map(len, column)) for column in columns]
        for row in zip(*columns):
            print("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip())
    leave_process_group()  # rank 0, or the agent, hosts the store: it leaves last


if __name__ == "__main__":
    main()
