"""Ranked checkpoints: every rank saves only its shard, and any world size can load them back.

    python -m snippets.cluster.ranked_checkpoint save runs/ranked/step_3 --world-size 2
    python -m snippets.cluster.ranked_checkpoint inspect runs/ranked/step_3
    python -m snippets.cluster.ranked_checkpoint consolidate runs/ranked/step_3 runs/ranked/model.pt

A ZeRO-1/2 trainer (and FSDP1, with its flat parameters) holds on each rank a contiguous slice
of one flat buffer: all parameters (or all of Adam's moments) concatenated in a fixed order, cut
into world_size equal pieces. (FSDP2 and DeepSpeed's ZeRO-3 shard each parameter on its own
instead; saving only your shard, with the layout beside it, works the same way.) Saving that
slice is all a rank can do without gathering, and it is the fastest way to save: N ranks write
N files in parallel. Each file, `rank_00001-of-00002.pt`, holds

* the rank's slice of every group of tensors (e.g. "model", "exp_avg", "exp_avg_sq"), and
* metadata: step, rank, world size, and each group's names and shapes, so the file alone says
  where its slice sits and what the whole looks like.

Because the layout is in the files, a job with a different world size can read them: rank r of
M ranks computes which part of the flat buffer it owns and reads only the old files that
overlap it (re-sharding). `consolidate` joins all slices into ordinary full tensors.
Each file is written atomically with a checksum sidecar, and loaded with weights_only=True
(snippets/training/checkpoint.py); a missing or damaged file is reported with its rank.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from snippets.training.checkpoint import (CheckpointError, NoCheckpointError, RunExistsError,
                                          _sidecar, load_checkpoint, refuse_earlier_run,
                                          save_checkpoint)
from snippets.flags import Parser, int_at_least

FILE_PATTERN = re.compile(r"^rank_(\d{5})-of-(\d{5})\.pt$")


def shard_path(directory: str | Path, rank: int, world_size: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}-of-{world_size:05d}.pt"


# --8<-- [start:bounds]
def shard_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's slice of a flat buffer of numel elements: ceil(numel / N) each,
    so the last rank's slice is shorter (or empty) when N does not divide numel."""
    size = math.ceil(numel / world_size)
    return min(rank * size, numel), min((rank + 1) * size, numel)
# --8<-- [end:bounds]


def layout_of(tensors: dict[str, torch.Tensor]) -> dict:
    """Names and shapes in a fixed order: enough to cut a flat buffer back into tensors."""
    return {"names": list(tensors), "shapes": [list(t.shape) for t in tensors.values()],
            "numel": sum(t.numel() for t in tensors.values())}


def unflatten(flat: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in zip(layout["names"], layout["shapes"]):
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape).clone()
        offset += n
    return out


# --8<-- [start:save]
def save_shard(directory: str | Path, step: int, rank: int, world_size: int,
               groups: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write this rank's slice of each group's flat buffer, with the layout, atomically.

    `groups` maps a group name to full tensors by name, e.g. {"model": dict(named_parameters())};
    every rank passes the same names and shapes (a ZeRO rank would pass its slice directly).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    meta = {"step": step, "rank": rank, "world_size": world_size, "layouts": {}}
    shards = {}
    for group, tensors in groups.items():
        layout = layout_of(tensors)
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors.values()])
        start, end = shard_bounds(layout["numel"], rank, world_size)
        shards[group] = flat[start:end].clone()  # clone: save only the slice, not the buffer
        meta["layouts"][group] = layout
    return save_checkpoint(shard_path(directory, rank, world_size), {"meta": meta, "shards": shards})
# --8<-- [end:save]


def rank_files(directory: str | Path | None) -> list[Path]:
    """The rank files in `directory`, of any world size (none if there is no such folder)."""
    if directory is None or not Path(directory).is_dir():
        return []
    return sorted(p for p in Path(directory).iterdir() if FILE_PATTERN.match(p.name))


def remove_rank_files(directory: str | Path) -> None:
    """Delete an earlier save's rank files and their checksums (what --overwrite replaces)."""
    for path in rank_files(directory):
        path.unlink()
        _sidecar(path).unlink(missing_ok=True)


def saved_world_size(directory: str | Path) -> int:
    """The world size the checkpoint in `directory` was saved with, from its file names."""
    directory = Path(directory)
    sizes = {int(FILE_PATTERN.match(p.name).group(2)) for p in rank_files(directory)}
    if not sizes:
        raise NoCheckpointError(f"{directory}: no ranked checkpoint files (rank_NNNNN-of-NNNNN.pt)")
    if len(sizes) > 1:
        raise CheckpointError(f"{directory} mixes files of world sizes {sorted(sizes)}: two runs "
                              "saved into one directory; keep one step per directory")
    return sizes.pop()


# --8<-- [start:read-rank]
def read_rank_file(directory: str | Path, rank: int, world_size: int) -> dict:
    """One saved rank's file, verified; errors name the rank and the file."""
    path = shard_path(directory, rank, world_size)
    if not path.is_file():
        raise NoCheckpointError(
            f"rank {rank}'s shard {path.name} is missing from {path.parent}: the checkpoint is "
            f"incomplete (did rank {rank} crash before saving, or is its file on another node's "
            "local disk?). Copy it there, or resume from an earlier step.")
    try:
        state = load_checkpoint(path)
    except CheckpointError as err:
        raise type(err)(f"rank {rank}'s shard is damaged: {err}") from None
    meta = state["meta"]
    if (meta["rank"], meta["world_size"]) != (rank, world_size):
        raise CheckpointError(f"{path} says it is rank {meta['rank']} of {meta['world_size']}; "
                              "the file was renamed or copied over")
    return state
# --8<-- [end:read-rank]


# --8<-- [start:load]
def load_shard(directory: str | Path, rank: int, world_size: int,
               reshard: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, {group: flat slice}) for rank `rank` of a job with `world_size` ranks.

    With a different world size than the checkpoint's, the slice is assembled from the saved
    files that overlap it (re-sharding); with reshard=False that is an error instead.
    """
    saved = saved_world_size(directory)
    if saved != world_size and not reshard:
        raise CheckpointError(
            f"{directory} was saved by {saved} ranks but this job has world_size={world_size}. "
            f"Load with reshard=True, or consolidate it first: python -m "
            f"snippets.cluster.ranked_checkpoint consolidate {directory} model.pt")
    first = read_rank_file(directory, 0, saved)
    meta, layouts = first["meta"], first["meta"]["layouts"]
    pieces = {group: [] for group in layouts}
    for old_rank in range(saved):
        state = first if old_rank == 0 else None
        for group, layout in layouts.items():
            want = shard_bounds(layout["numel"], rank, world_size)
            have = shard_bounds(layout["numel"], old_rank, saved)
            lo, hi = max(want[0], have[0]), min(want[1], have[1])
            if lo >= hi:
                continue  # this old file holds nothing of our new slice: not even opened
            if state is None:
                state = read_rank_file(directory, old_rank, saved)
                if state["meta"]["step"] != meta["step"]:
                    raise CheckpointError(f"rank {old_rank}'s shard is from step "
                                          f"{state['meta']['step']}, rank 0's from {meta['step']}")
            pieces[group].append(state["shards"][group][lo - have[0]:hi - have[0]])
    shards = {group: torch.cat(p) if p else torch.empty(0) for group, p in pieces.items()}
    return {**meta, "rank": rank, "world_size": world_size, "saved_world_size": saved}, shards
# --8<-- [end:load]


# --8<-- [start:consolidate]
def consolidate(directory: str | Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(metadata, {group: {name: full tensor}}): every rank's slice joined, as one process."""
    meta, flat = load_shard(directory, rank=0, world_size=1)
    layouts = meta["layouts"]
    return meta, {group: unflatten(flat[group], layouts[group]) for group in layouts}
# --8<-- [end:consolidate]


def adam_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters and Adam's two moments by parameter name: the groups a ZeRO rank would shard."""
    groups = {"model": dict(model.named_parameters()), "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            groups[key][name] = state.get(key, torch.zeros_like(p))
    return groups


def _demo_save(rank: int, world_size: int, directory: str, step: int) -> str:
    """One rank of the demo: train the tiny GPT a few steps on its data, save its shard."""
    import torch.distributed as dist

    from snippets.models.gpt import GPT, get_config, shift_for_next_token

    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(step):
        batch = torch.randint(0, 256, (2 * world_size, 17), generator=g).chunk(world_size)[rank]
        model(*shift_for_next_token(batch))[1].backward()
        for p in model.parameters():  # average gradients: the replicas stay equal
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()
        optimizer.zero_grad()
    path = save_shard(directory, step, rank, world_size, adam_groups(model, optimizer))
    dist.barrier()  # the checkpoint is complete only when every rank has written its file
    return str(path)


def _inspect(directory: str) -> None:
    saved = saved_world_size(directory)
    print(f"{directory}: saved by {saved} ranks")
    for rank in range(saved):
        state = read_rank_file(directory, rank, saved)
        meta = state["meta"]
        sizes = ", ".join(f"{g} {len(t):,}" for g, t in state["shards"].items())
        print(f"  rank {rank}: step {meta['step']}, {shard_path(directory, rank, saved).name}, "
              f"elements: {sizes}")
    layout = meta["layouts"]["model"] if "model" in meta["layouts"] else None
    if layout:
        print(f"  model: {len(layout['names'])} tensors, {layout['numel']:,} elements, "
              f"first {layout['names'][0]} {layout['shapes'][0]}")


def main(argv=None) -> None:
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="demo: N processes train the tiny GPT, each saves its shard")
    save.add_argument("directory")
    save.add_argument("--world-size", type=int_at_least(1), default=2)
    save.add_argument("--step", type=int_at_least(1), default=3, help="training steps before saving")
    save.add_argument("--overwrite", action="store_true",
                      help="replace the rank files an earlier save left in DIRECTORY")
    sub.add_parser("inspect", help="list the rank files and their metadata").add_argument(
        "directory")
    cons = sub.add_parser("consolidate", help="join all shards into one ordinary checkpoint")
    cons.add_argument("directory")
    cons.add_argument("output")
    cons.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    args = p.parse_args(argv)
    try:
        _run(args)
    except CheckpointError as err:  # a missing, damaged or refused checkpoint: one line
        p.exit(1, f"error: {err}\n")


def _run(args) -> None:
    if args.command == "save":
        from snippets.dist import spawn

        earlier = rank_files(args.directory)
        refuse_earlier_run([path.name for path in earlier], args.directory,
                           overwrite=args.overwrite, keep="directory")
        remove_rank_files(args.directory)  # all first: files of two world sizes never mix
        for path in spawn(_demo_save, args.world_size, args.directory, args.step, timeout_s=120):
            print(f"wrote {path}")
    elif args.command == "inspect":
        _inspect(args.directory)
    else:
        if Path(args.output).exists() and not args.overwrite:
            raise RunExistsError(f"{args.output} exists: pass another output path, or "
                                 "--overwrite to replace it")
        meta, groups = consolidate(args.directory)
        save_checkpoint(args.output, {"step": meta["step"], **groups})
        numel = sum(t.numel() for g in groups.values() for t in g.values())
        print(f"{args.output}: step {meta['step']}, groups {', '.join(groups)}, "
              f"{numel:,} elements from {meta['saved_world_size']} rank files")


if __name__ == "__main__":
    main()
