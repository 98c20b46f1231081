"""DeepSpeed ZeRO on the tiny GPT: one training loop, the ZeRO stage chosen by a JSON config.

    # CPU, gloo (this machine): torchrun starts the processes, DeepSpeed shards the state
    torchrun --nproc_per_node=2 snippets/cluster/deepspeed/train_deepspeed.py --config zero2
    # a GPU node, NCCL: DeepSpeed's own launcher, one process per GPU
    deepspeed --num_gpus 8 snippets/cluster/deepspeed/train_deepspeed.py --config zero3

The configs live beside this file: zero1.json, zero2.json, zero3.json, zero3_offload.json.
The loop is the same for all of them; only the JSON says what each rank keeps:
stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters,
and offload moves the shards to CPU memory.

Every rank trains on its own slice of the same global batch, so the result can be compared with
one process training on the whole batch (tests/test_deepspeed.py does exactly that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from snippets.data.dataset import load_tokens
from snippets.dist import init_from_env, leave_process_group
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import refuse_earlier_run
from snippets.flags import Parser, int_at_least, positive_float

CONFIG_DIR = Path(__file__).resolve().parent
# On the CPU accelerator DeepSpeed compiles a small C++ op (shared-memory collectives) the first
# time it starts, which takes minutes on a small machine; keeping the build in the checkout's
# build/ folder makes every later start skip it. `make test` builds it once at install time.
JIT_CACHE = CONFIG_DIR.parents[2] / "build" / "torch_extensions"


def torch_lib_dir() -> Path:
    return Path(torch.__file__).parent / "lib"


def check_build_path() -> None:
    """PyTorch's C++ extension builder, which DeepSpeed compiles its ops with, writes the link
    step's -L<torch/lib> unquoted: under a path with a space the linker splits it in two and
    fails ("cannot find -lc10"), after a minute of compiling and in 40 lines of ninja output."""
    if " " in str(torch_lib_dir()):
        raise RuntimeError(
            f"DeepSpeed cannot build its op: PyTorch is installed under {sys.prefix!r}, a path "
            "with a space, which PyTorch's C++ extension builder passes to the linker unquoted. "
            "Create the environment at a path without spaces (make test VENV=$HOME/.venvs/course)"
            " or clone the course to one")


def use_jit_cache() -> None:
    """Build DeepSpeed's CPU op into build/torch_extensions, always with the ninja installed
    beside this interpreter (pip's, a DeepSpeed dependency). A system ninja of another version
    does not trust the other's build log and compiles the op again, 35-100 s on 2 cores: that
    happened whenever a test ran with .venv/bin first on PATH after `make` had built without."""
    check_build_path()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(JIT_CACHE))
    here = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def zero_groups_with_timeout(timeout_s: float) -> None:
    """Give ZeRO's collectives a timeout. DeepSpeed runs them on its own copy of the world group,
    which it creates without one (`_clone_world_group` in deepspeed/utils/groups.py): torch's
    default, 30 minutes under gloo, whatever the default group was given. Made here first, with
    the timeout, the copy is used as it is."""
    use_jit_cache()
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())),
                                             timeout=timedelta(seconds=timeout_s))


STAGES = ("zero1", "zero2", "zero3", "zero3_offload")


# --8<-- [start:load-config]
def load_ds_config(name_or_path: str) -> dict:
    """A DeepSpeed config: 'zero1'..'zero3_offload' (the files beside this module) or a JSON path."""
    path = CONFIG_DIR / f"{name_or_path}.json" if name_or_path in STAGES else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {name_or_path!r}: no such file; use one of "
                                f"{', '.join(STAGES)} or the path of a DeepSpeed JSON config")
    config = json.loads(path.read_text())
    if config.get("gradient_accumulation_steps", 1) != 1:
        raise ValueError(f"{path}: gradient_accumulation_steps must be 1 here; this loop calls "
                         "engine.step() once per global batch")
    return config
# --8<-- [end:load-config]


# --8<-- [start:global-batches]
def global_batches(steps: int, global_batch: int, context: int) -> list[torch.Tensor]:
    """The same fixed global batches on every rank: consecutive windows of the built-in corpus."""
    tokens = load_tokens(None, context_length=context)
    window = context + 1
    need = steps * global_batch * window
    if need > len(tokens):
        raise ValueError(f"{steps} steps x {global_batch} sequences x {window} tokens = {need} "
                         f"tokens, but the corpus has {len(tokens)}; use fewer steps")
    return [tokens[i * global_batch * window:(i + 1) * global_batch * window]
            .view(global_batch, window).long() for i in range(steps)]
# --8<-- [end:global-batches]


# --8<-- [start:train]
def train(ds_config: dict, steps: int, context: int = 32, seed: int = 0, log=print):
    """Train the tiny GPT with DeepSpeed for `steps` steps; the process group must exist.

    Returns the DeepSpeed engine and the global loss of each step (the mean over ranks, which
    equals the loss one process computes on the whole global batch).
    """
    use_jit_cache()
    import deepspeed  # imported here: importing it prints accelerator detection messages

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = GPT(get_config("tiny", max_position_embeddings=context))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for batch in global_batches(steps, micro * world, context):
        inputs, targets = shift_for_next_token(batch.chunk(world)[rank].to(engine.device))
        _, loss = engine(inputs, targets)
        engine.backward(loss)  # ZeRO: reduce-scatter the gradients, each rank keeps its shard
        engine.step()          # each rank updates its shard; stage 1/2 then all-gather params
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        log(f"rank {rank} step {len(losses)} loss {losses[-1]:.4f}")
    return engine, losses
# --8<-- [end:train]


def prebuild_ops() -> str:
    """Compile, now, the op DeepSpeed would JIT-compile when the first job starts (CPU only)."""
    use_jit_cache()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and shutil.which("c++") is None:
        return ("WARNING: no C++ compiler (c++): DeepSpeed on the CPU cannot build its "
                "shared-memory op and will fail to start; install one (apt-get install g++)")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return f"nothing to build for the {get_accelerator().device_name()} accelerator"
    builder.load()
    return f"{builder.NAME} built in {os.environ['TORCH_EXTENSIONS_DIR']}"


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="zero2", help=f"{', '.join(STAGES)} or a JSON path")
    p.add_flag("max-steps", "--steps", dest="steps", type=int_at_least(1), default=5)
    p.add_flag("seq-len", "--context", dest="context", type=int_at_least(1), default=32,
               help="tokens per sequence")
    p.add_argument("--save-dir", default=None, help="write a ZeRO checkpoint here at the end")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint an earlier run of as many steps left in SAVE_DIR")
    p.add_argument("--timeout", type=positive_float, default=120,
                   help="seconds a collective may wait")
    p.add_argument("--prebuild-ops", action="store_true",
                   help="only compile DeepSpeed's JIT ops for this machine, then exit")
    # The deepspeed launcher passes --local_rank=N to every process (it also sets LOCAL_RANK).
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.prebuild_ops:
        print(prebuild_ops())
        return
    ds_config = load_ds_config(args.config)
    tag_dir = Path(args.save_dir) / f"step{args.steps}" if args.save_dir else None
    refuse_earlier_run([tag_dir] if tag_dir and tag_dir.exists() else [],
                       overwrite=args.overwrite, keep="--save-dir")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    env = init_from_env(backend, timeout_s=args.timeout)
    zero_groups_with_timeout(args.timeout)
    log = print if env["rank"] == 0 else (lambda *a: None)
    engine, losses = train(ds_config, args.steps, args.context, log=log)
    if tag_dir:
        if env["rank"] == 0 and tag_dir.exists():  # --overwrite: no old rank's file stays behind
            shutil.rmtree(tag_dir)
        dist.barrier()
        # Every rank writes its own shard files under SAVE_DIR/stepN/ (its optimizer states; the
        # module states come from rank 0, or from every rank under ZeRO-3).
        engine.save_checkpoint(args.save_dir, tag=f"step{args.steps}")
    if env["rank"] == 0:
        print(f"ZeRO stage {engine.zero_optimization_stage()} on {env['world_size']} {backend} "
              f"ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if tag_dir:
            print(f"checkpoint {tag_dir}: {', '.join(sorted(os.listdir(tag_dir)))}")
    leave_process_group()  # rank 0, which hosts the store, leaves last


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
