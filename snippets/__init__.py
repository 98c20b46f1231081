"""The course's runnable code: every block on the site is included from this package.

Where each kind of thing lives:

    models/      the tiny GPT (gpt.py), its fused path, nanoGPT's model as a yardstick
    data/        tokenizers (bytes, BPE), the corpus, token files and shards, batch samplers
    basics/      Session A's first steps: autograd graph, forward-backward-update, memory table
    scratch/     each parallelism built from torch.distributed primitives only, one file each,
                 at most 300 lines: collectives, sampler, ddp, zero and fsdp (on flat_shard),
                 pipeline, pipeline_interleaved, tensor_parallel, sequence_parallel,
                 context_parallel, moe, expert_data_parallel, three_d, precision; ddp_check,
                 zero_check and fsdp_check run three of them against one process
    library/     the library versions of the same ideas under the same names, applied to a
                 plain model (scratch/X <-> library/X): pipeline, tensor_parallel (and 2-D with
                 FSDP2), sequence_parallel, context_parallel, three_d; FSDP2 itself is in
                 training/fsdp_trainer.py, DDP in training/ddp_trainer.py, DeepSpeed in
                 cluster/deepspeed/, Accelerate in training/; TorchTitan's CPU launcher
    training/    the trainers and the lesson scripts (train_tiny_transformer, ddp_trainer,
                 fsdp_trainer, accelerate_train, ...), checkpoints, command-line flag checks
    cluster/     more than one node: the fake multi-node launcher, SLURM scripts, DeepSpeed
                 (deepspeed/), Kubernetes (k8s/), ranked checkpoints, log merging
    planner/     the memory / FLOPs / communication cost model behind the calculator page
    bench/       `make bench`'s benchmarks (listed in bench/__init__.py), and the measurements
                 and runs the lessons show (zero_accounting, moe_check, tensor_parallel_check)
    exercises/   the learning guide's exercises: catalogue, stubs, checks, runner
    debugging/   errors a learner meets, reproduced on purpose
    figures/     the scripts that draw the site's figures
    notebooks/   the nbdistributed notebook and its helper
    dist.py      starting torch.distributed (every group with a timeout), spawn
    machine.py   the machine a run happened on, and the device to train on

Importing it pins the CPU kernels that PyTorch picks by instruction set, so a page's printed
numbers come out the same on any x86-64 machine with AVX2 (every Intel Core since Haswell, 2013,
and every AMD Zen), not only on the one that wrote the page:

- ATen's vectorised kernels (elementwise ops, softmax, reductions) are compiled for AVX2 and
  AVX-512 and chosen at the first op: 8 or 16 floats per instruction sum in different orders.
- MKL's matmuls pick a code path per CPU as well; MKL_CBWR ("conditional bitwise reproducibility")
  fixes it to the AVX2 one.

Both are read when the first op runs, not when torch is imported, so a script may import torch
before this package. A variable the reader set already is kept, and COURSE_NATIVE_KERNELS=1 (which
`make bench` sets) leaves both alone, to measure what the machine can do. The thread count matters
too: the course's scripts that print exact numbers run one thread.
"""

import io
import os
import platform
import sys


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


if (os.environ.get("COURSE_NATIVE_KERNELS") != "1"
        and platform.machine() in ("x86_64", "AMD64") and _has_avx2()):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    os.environ.setdefault("MKL_CBWR", "AVX2")


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
