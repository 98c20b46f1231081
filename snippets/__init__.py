"""The course's runnable code: every block on the site is included from this package.

Where each kind of thing lives:

    models/      the tiny GPT (gpt.py), its fused path, nanoGPT's model as a yardstick
    data/        tokenizers (bytes, BPE), the corpus, token files and shards, batch samplers
    basics/      Session A's first steps: autograd graph, forward-backward-update, memory table
    scratch/     each parallelism built from torch.distributed primitives only, one concept a
                 file: collectives, sampler, ddp, zero and fsdp (on flat_shard), pipeline,
                 pipeline_interleaved, tensor_parallel, sequence_parallel, context_parallel,
                 moe, expert_data_parallel, three_d, precision. The algorithm only: the runs
                 against one process and the measurements sit beside it in X_check.py
                 (reference.py: the one-process reference loop). Imports point down: scratch,
                 models, data, dist and flags, never planner or bench
    library/     the library versions of the same ideas under the same names, applied to a
                 plain model (scratch/X <-> library/X): pipeline, tensor_parallel (and 2-D with
                 FSDP2), sequence_parallel, context_parallel, three_d; the trainer with
                 Accelerate (accelerate_train, accelerate_devices, accelerate_sharding); FSDP2
                 itself is in training/fsdp_trainer.py, DDP in training/ddp_trainer.py,
                 DeepSpeed in cluster/deepspeed/; TorchTitan's CPU launcher
    training/    the trainer core: one loop with a forward_backward seam (ddp_trainer), FSDP
                 (fsdp_trainer) and the parallel trainer (parallel_trainer) as thin layers on
                 it, one checkpoint layout and run protocol (checkpoint)
    scripts/     the lesson scripts a page or an executed lesson runs: train_tiny_transformer,
                 ddp_simulation_train, precision_and_accumulation, low_precision,
                 reproducibility, profile_step, profile_mps
    tools/       what a learner points at their own runs: read_logs, read_trace,
                 inspect_checkpoints
    labs/        the workshop's labs: lab1_sweep, lab2_samplers
    cluster/     more than one node: the fake multi-node launcher, SLURM scripts, DeepSpeed
                 (deepspeed/), Kubernetes (k8s/), ranked checkpoints, log merging
    planner/     the memory / FLOPs / communication cost model behind the calculator page
    bench/       `make bench`'s benchmarks (listed in bench/__init__.py), and the measurements
                 and runs the lessons show (zero_accounting, zero_check, moe_check,
                 tensor_parallel_check, three_d_bytes)
    exercises/   the learning guide's exercises: catalogue, stubs, checks, runner
    debugging/   errors a learner meets, reproduced on purpose
    figures/     the scripts that draw the site's figures
    notebooks/   the nbdistributed notebook and its helper
    dist.py      starting torch.distributed (every group with a timeout), spawn
    machine.py   the machine a run happened on, and the device to train on

Importing it changes nothing that alters a result: no environment variable, kernel choice,
thread count or global flag. PyTorch picks the CPU kernels your machine has (AVX2, AVX-512, AMX,
NEON on Apple silicon), so the last digits of a long run differ between machines; the pages say
which printed numbers are exact and which are checked within a stated bound
(docs/reference/reproducibility.md). A script that does set something, such as one intra-op
thread, says so in its output.
"""

import io
import sys


# Each printed line goes out in one write. Ranks started by one launcher share its terminal or
# log file, and a line written in pieces merges with another rank's: print() writes the text and
# its newline separately, which under PYTHONUNBUFFERED=1 (set by the course's launcher, its
# Dockerfile and the page tests) are two system calls, and a block-buffered stdout (into a file
# or a pipe) is cut every 8 KB, mid-line. Line buffering keeps the text until its newline, then
# writes it whole. Only the interpreter's own streams change, not one that a notebook or pytest
# has put in their place.
for _stream in (sys.stdout, sys.stderr):
    if _stream in (sys.__stdout__, sys.__stderr__) and isinstance(_stream, io.TextIOWrapper):
        _stream.reconfigure(line_buffering=True, write_through=False)
