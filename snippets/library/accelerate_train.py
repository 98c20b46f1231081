"""Hugging Face Accelerate: the tiny-GPT training of scripts/ddp_simulation_train.py, with the
distributed parts handed to an `Accelerator`.

Two CPU processes (the script's --cpu is what makes them one job, see check_launch):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no snippets/library/accelerate_train.py --cpu --max-steps 5

On a GPU machine drop --cpu and set --num_processes to the number of GPUs. The same script also
runs alone (`python snippets/library/accelerate_train.py`) or under torchrun.

What `accelerator.prepare` does, printed at the start of the run: the model moves to the
process's device and, with more than one process, is wrapped in DistributedDataParallel; the
optimizer is wrapped (AcceleratedOptimizer: its state on the device, steps skipped while
gradients accumulate, the fp16 gradient scaler applied when there is one); the DataLoader is
rebuilt so each process loads its own share of every epoch's batches, onto its device.
"""

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from snippets.data.dataset import load_tokens
from snippets.training.checkpoint import refuse_earlier_run
from snippets.flags import Parser, int_at_least, positive_float
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scripts.ddp_simulation_train import Windows


class IndexedWindows(Dataset):
    """The demo's token windows, each with its index, so a process can say which examples it got."""

    def __init__(self, windows: Windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return i, self.windows[i]


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_flag("max-steps", "--steps", dest="steps", type=int_at_least(1), default=20,
               help="optimizer steps in total")
    p.add_flag("batch-size", type=int_at_least(1), default=8,
               help="sequences per process per step")
    p.add_argument("--config", default="tiny")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--cpu", action="store_true",
                   help="Accelerator(cpu=True): run on the CPU, and join the launched processes\n"
                        "into one gloo job even though there is no GPU")
    p.add_argument("--state-dir", default="runs/accelerate/state",
                   help="accelerator.save_state writes the final model, optimizer and RNG states here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the state an earlier run saved in --state-dir")
    p.add_argument("--allow-independent", action="store_true",
                   help="demo of the trap: run even if every process trains its own copy alone")
    return p.parse_args(argv)


# The files accelerator.save_state writes (accelerate/checkpointing.py). A run refuses a folder
# that holds any of them unless --overwrite says to replace them; then only these are removed,
# so an old run's random_states_3.pkl never sits beside a new 2-process state. Anything else in
# the folder is the learner's and stays.
SAVED_STATE = ("model*.safetensors", "pytorch_model*.bin", "optimizer*.bin", "scheduler*.bin",
               "sampler*.bin", "scaler.pt", "random_states_*.pkl", "custom_checkpoint_*.pkl")


def saved_state(state_dir: str) -> list[Path]:
    return sorted(path for pattern in SAVED_STATE for path in Path(state_dir).glob(pattern))


def check_state_dir(state_dir: str, overwrite: bool) -> None:
    """Refuse to save over an earlier run's state, before anything starts."""
    refuse_earlier_run([path.name for path in saved_state(state_dir)], state_dir,
                       overwrite=overwrite, keep="--state-dir")


# --8<-- [start:check-launch]
class IndependentCopiesError(RuntimeError):
    """The launcher started several processes, but Accelerate runs each of them alone."""


def check_launch(accelerator: Accelerator, allow_independent: bool = False) -> bool:
    """Refuse the silent trap: N processes launched, each one training its own copy.

    `accelerate launch --multi_gpu` and torchrun start N processes and set WORLD_SIZE=N. On a
    machine without a GPU, a plain Accelerator() finds no GPU backend and settles on
    DistributedType.NO, with num_processes == 1 in every process: no DDP wrapper, no sharded
    data, no gradient all-reduce, every process its own main process. Nothing fails; the job is
    just N copies of a one-process run. Returns True if it is that (and allow_independent).
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        message = (
            f"the launcher started {launched} processes (WORLD_SIZE={launched}), but Accelerate "
            f"sees num_processes=1, distributed_type={accelerator.distributed_type.value} in each: "
            "every process would train its own copy on all the data, with no gradient sync. "
            "Without a GPU, Accelerate joins the processes only when told to use the CPU: "
            "create Accelerator(cpu=True) (this script: --cpu) or set ACCELERATE_USE_CPU=1, "
            "and keep `accelerate launch --multi_gpu --num_processes N` "
            "(`accelerate launch --cpu` starts a single process)."
        )
        if not allow_independent:
            raise IndependentCopiesError(message)
        print(f"warning (--allow-independent): {message}", flush=True)
        return True
    return False
# --8<-- [end:check-launch]


def print_in_rank_order(accelerator: Accelerator, line: str) -> None:
    """Every process prints its line, process 0 first: the others wait at a barrier for their
    turn, so the output reads the same on every run. Independent copies (the trap) each think they
    are process 0 of 1, and print whenever they get there."""
    for turn in range(accelerator.num_processes):
        if turn == accelerator.process_index:
            print(line, flush=True)
        accelerator.wait_for_everyone()


# --8<-- [start:checksum]
def parameter_checksum(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """This process's sum of all its weights, as a 1-element tensor that gather can collect."""
    total = sum(p.detach().double().sum() for p in model.parameters())
    return total.reshape(1).to(device)
# --8<-- [end:checksum]


def main(argv=None) -> None:
    args = parse_args(argv)
    # --8<-- [start:prepare]
    accelerator = Accelerator(cpu=args.cpu)  # reads the launcher's environment: rank, world, device
    independent_copies = check_launch(accelerator, args.allow_independent)
    if not independent_copies:  # they save nothing (below)
        check_state_dir(args.state_dir, args.overwrite)  # in every process, before training
    print_in_rank_order(accelerator, f"launcher RANK={os.environ.get('RANK', '-')} -> accelerate "
                        f"process {accelerator.process_index} of {accelerator.num_processes}, "
                        f"main process: {accelerator.is_main_process}, device: {accelerator.device}")

    set_seed(args.seed)  # the same initial weights in every process (DDP also broadcasts them)
    config = get_config(args.config)
    context = config.max_position_embeddings
    dataset = IndexedWindows(Windows(load_tokens(None, context_length=context), context))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches_before = len(loader)

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # --overwrite: the old state goes before the new is saved. Independent copies save nothing,
    # so they delete nothing (and every one of them is "the main process").
    if accelerator.is_main_process and not independent_copies:
        for path in saved_state(args.state_dir):
            path.unlink()

    accelerator.print(f"{accelerator.distributed_type.value}: {accelerator.num_processes} "
                      f"processes, backend {accelerator.state.backend}")
    accelerator.print(f"model -> {type(model).__name__} on {next(model.parameters()).device}; "
                      f"optimizer -> {type(optimizer).__name__}; loader -> {type(loader).__name__}: "
                      f"{batches_before} batches -> {len(loader)} per process")
    # --8<-- [end:prepare]

    # --8<-- [start:loop]
    step = 0
    while step < args.steps:
        for indices, batch in loader:  # already on accelerator.device, this process's share only
            if step == 0:
                everyone = accelerator.gather(indices).view(accelerator.num_processes, -1)
                for process, seen in enumerate(everyone.tolist()):
                    accelerator.print(f"process {process} first batch: examples {seen}")
            inputs, targets = shift_for_next_token(batch)
            _, loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)  # DDP averages the gradients over processes in here
            optimizer.step()
            step += 1

            global_loss = accelerator.gather(loss.detach()).mean()  # every process's loss
            sums = accelerator.gather(parameter_checksum(model, accelerator.device)).tolist()
            accelerator.print(f"step {step:3d} | global loss {global_loss.item():.4f} | replicas in sync: "
                              f"{len(set(sums)) == 1} | checksums {', '.join(f'{s:.6f}' for s in sums)}")
            if step == args.steps:
                break
    # --8<-- [end:loop]

    # --8<-- [start:save]
    accelerator.wait_for_everyone()  # nobody saves, or exits, before the last step is done everywhere
    if independent_copies:  # every copy is "the main process": all would write the same files
        print("not saving: every process would write the same files at once", flush=True)
    else:
        accelerator.save_state(args.state_dir)  # weights + optimizer once, RNG state per process
        accelerator.wait_for_everyone()  # every process has written its part before we list them
        if accelerator.is_main_process:
            files = sorted(p.name for p in Path(args.state_dir).iterdir())
            print(f"saved {args.state_dir}: {', '.join(files)}")
    # Printed by every process: equal on all of them iff the replicas ended in sync.
    checksum = parameter_checksum(model, accelerator.device).item()
    print_in_rank_order(accelerator, f"launcher RANK={os.environ.get('RANK', '-')}, accelerate "
                        f"process {accelerator.process_index}: final checksum {checksum:.6f}")
    accelerator.end_training()  # tears down the process group
    # --8<-- [end:save]


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
