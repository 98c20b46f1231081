"""torch.distributed.checkpoint (DCP): save a sharded model in one layout, load it in another.

Two ranks train the tiny GPT, sharded with FSDP2, for one step and save the model and AdamW's
moments with `dcp.save`: every rank writes its own shards, nothing is gathered. They save the
same state again with `dcp.async_save`, which copies it to CPU memory and writes it from a
background thread while the ranks train a second step. Then four ranks, with a 2 x 2 mesh of
FSDP x tensor parallelism, load the first checkpoint (DCP reads, for each rank, the slices that
overlap its new shards), and one plain process converts each to an ordinary torch.save file.
Every load is compared, bit for bit, with the state the two ranks held when they saved.

    python -m snippets.library.dcp_checkpoint --out runs/dcp    # 2 ranks save; 4 ranks and 1 process load
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from snippets.data.dataset import random_token_batches
from snippets.dist import DEFAULT_TIMEOUT_S, init_mesh, spawn
from snippets.library.tensor_parallel import apply_fsdp, apply_tp
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import RunExistsError, fsync_dir, refuse_earlier_run
from snippets.flags import Parser

SYNC, ASYNC = "step-1.dcp", "step-1-async.dcp"
CONSOLIDATED = {SYNC: "step-1.pt", ASYNC: "step-1-async.pt"}


def build(mesh_shape: tuple[int, ...]) -> tuple[GPT, torch.optim.Optimizer]:
    """The tiny GPT, the same initial weights on every rank, sharded over a CPU mesh:
    (N,) is FSDP2 over N ranks, (dp, tp) is FSDP2 x tensor parallelism."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    if len(mesh_shape) == 1:
        apply_fsdp(model, init_mesh("cpu", mesh_shape, ("dp",)))
    else:
        mesh = init_mesh("cpu", mesh_shape, ("dp", "tp"))
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: GPT, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    """One AdamW step; each rank takes its own slice of the global batch."""
    _, loss = model(*shift_for_next_token(batch.chunk(dist.get_world_size())[dist.get_rank()]))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --8<-- [start:save]
def save(model, optimizer, directory: Path) -> None:
    """Every rank writes its own shards into `directory`; rank 0 also writes .metadata, last."""
    # Sharded state dicts: the parameters and AdamW's moments as DTensors, this rank's slices.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)


def save_in_background(model, optimizer, directory: Path, group):
    """dcp.async_save: returns once the state is copied to CPU memory (staging), and writes it
    from a thread. The thread's collectives run on `group`, a process group of their own, so
    they never interleave with the training step's collectives on the default group."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return dcp.async_save({"model": model_state, "optimizer": optimizer_state},
                          checkpoint_id=directory, process_group=group)
# --8<-- [end:save]


# --8<-- [start:publish]
def publish(written: Path, directory: Path) -> None:
    """Rank 0, once the save has returned there (its .metadata is written): rename the finished
    directory into place. A crash before this leaves only `written`, a hidden name no loader
    looks for; then every rank waits, so all see the final name."""
    if dist.get_rank() == 0:
        os.replace(written, directory)
        fsync_dir(directory.parent)
    dist.barrier()
# --8<-- [end:publish]


# --8<-- [start:load]
def load(model, optimizer, directory: Path) -> None:
    """Fill this rank's shards, in whatever layout it has now, from a DCP checkpoint."""
    # This layout's state dicts say which slices this rank needs; DCP reads just those (from
    # every file that holds part of them) into the tensors, in place.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
# --8<-- [end:load]


def full_state(model, optimizer) -> dict:
    """Model and optimizer as whole tensors on rank 0 (empty dicts elsewhere); a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    # A copy: AdamW's `step` counters come back as the optimizer's own tensors, which the next
    # optimizer.step() increments in place.
    return copy.deepcopy({"model": model_state, "optimizer": optimizer_state})


def save_worker(rank: int, world_size: int, out: Path, timeout_s: float) -> dict:
    model, optimizer = build((world_size,))
    first, second = random_token_batches(2, 8, 32)
    train_step(model, optimizer, first)
    save(model, optimizer, out / f".{SYNC}.tmp")
    publish(out / f".{SYNC}.tmp", out / SYNC)
    at_save = full_state(model, optimizer)
    # --8<-- [start:async]
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    future = save_in_background(model, optimizer, out / f".{ASYNC}.tmp", group)
    train_step(model, optimizer, second)  # runs while the checkpoint is written
    future.result(timeout=timeout_s)      # an error in the background save is raised here
    publish(out / f".{ASYNC}.tmp", out / ASYNC)
    # --8<-- [end:async]
    return {"at_save": at_save, "after_step_2": full_state(model, optimizer),
            "local": tuple(model.layers[0].self_attn.q_proj.weight.to_local().shape)}


def load_worker(rank: int, world_size: int, directory: Path) -> dict:
    # Gathering a 2-D shard for the comparison takes two all-gathers, and DTensor warns, on
    # every rank, that one would be faster; that is not this demo's subject.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model, optimizer = build((2, world_size // 2))
    load(model, optimizer, directory)
    q = model.layers[0].self_attn.q_proj.weight
    return {"state": full_state(model, optimizer), "local": tuple(q.to_local().shape),
            "placements": str(q.placements)}


def same(a, b) -> bool:
    """Nested dicts and lists equal, tensors bit for bit (same dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def tensor_count(state) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(tensor_count(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_count(v) for v in state)
    return 0


def consolidate(directory: Path, path: Path) -> dict:
    """One plain process, no process group: the whole checkpoint as one torch.save file."""
    dcp_to_torch_save(directory, path)
    return torch.load(path, weights_only=True)


def ours(out: Path) -> list[Path]:
    """What this script writes in --out, and nothing else there."""
    return [out / name for name in (SYNC, ASYNC, *CONSOLIDATED.values())]


def prepare(out: Path) -> None:
    """Remove this script's own earlier checkpoints (the caller asked for --overwrite), and any
    hidden directory a crashed run of it left mid-save."""
    for path in ours(out) + [out / f".{name}.tmp" for name in (SYNC, ASYNC)]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/dcp"),
                        help="folder for the checkpoints (default runs/dcp)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace this demo's checkpoints in --out if they exist")
    args = parser.parse_args(argv)
    try:  # refused at parse time, as a usage error: nothing has started yet
        refuse_earlier_run([p.name for p in ours(args.out) if p.exists()], args.out,
                           overwrite=args.overwrite)
    except RunExistsError as err:
        parser.error(f"argument --out: {err}")
    prepare(args.out)
    timeout_s = DEFAULT_TIMEOUT_S
    saved = spawn(save_worker, 2, args.out, timeout_s, timeout_s=timeout_s)[0]
    files = sorted(p.name for p in (args.out / SYNC).iterdir())
    print(f"2 ranks, FSDP2 on a mesh of (2,): each stores q_proj as {saved['local']} of (64, 64)")
    print(f"dcp.save wrote {args.out / SYNC}: {', '.join(files)}")
    at_save = saved["at_save"]
    print(f"state at save: {tensor_count(at_save['model'])} model tensors, "
          f"{tensor_count(at_save['optimizer'])} optimizer tensors")

    loaded = spawn(load_worker, 4, args.out / SYNC, timeout_s=timeout_s)[0]
    print(f"4 ranks, FSDP2 x TP on a mesh of (2, 2): each stores q_proj as {loaded['local']}, "
          f"placements {loaded['placements']}")
    print(f"  loaded {SYNC}, equal to the state at save: {same(loaded['state'], at_save)}")

    whole = consolidate(args.out / SYNC, args.out / CONSOLIDATED[SYNC])
    print(f"1 process, no process group: dcp_to_torch_save -> {args.out / CONSOLIDATED[SYNC]}, "
          f"equal to the state at save: {same(whole, at_save)}")
    background = consolidate(args.out / ASYNC, args.out / CONSOLIDATED[ASYNC])
    print(f"async_save, written while step 2 trained: equal to the state at save: "
          f"{same(background, at_save)}; to the state after step 2: "
          f"{same(background, saved['after_step_2'])}")


if __name__ == "__main__":
    main()
