"""The ring all-reduce, step by step, recorded from the course's own `ring_all_reduce`.

Nothing about the ring is re-derived here. The script runs `snippets.scratch.collectives.
ring_all_reduce` itself, once per rank, each rank in a thread, with a stand-in for
`torch.distributed` that delivers `isend`/`recv` through queues and writes down every message.
Rank r starts with the value 2**r in every chunk, so each number in the result is a set of ranks
in binary: 0b011 is "ranks 0 and 1 added in". The figure shows, after every step, what each rank
holds in each chunk, and which chunk it sent to its right neighbour.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import torch

from snippets.figures import svg
from snippets.scratch import collectives

NAME = "ring-allreduce"
WORLD = 3
LETTERS = "abcdefgh"


class _Done:
    def wait(self):
        return None


class RecordingDist:
    """Just enough of torch.distributed for ring_all_reduce, run by threads, one per rank."""

    def __init__(self, world: int):
        self.world = world
        self.local = threading.local()
        self.links = {(s, d): queue.Queue() for s in range(world) for d in range(world)}
        self.sent: dict[int, list[int]] = {r: [] for r in range(world)}  # rank -> chunk per step
        self.tensors: dict[int, torch.Tensor] = {}

    def get_rank(self):
        return self.local.rank

    def get_world_size(self):
        return self.world

    def isend(self, tensor, dst):
        rank = self.local.rank
        base = self.tensors[rank]
        # The chunks are views of the rank's tensor: the offset says which chunk this is.
        index = (tensor.data_ptr() - base.data_ptr()) // base.element_size()
        self.sent[rank].append(index)
        self.links[(rank, dst)].put(tensor.clone())
        return _Done()

    def recv(self, tensor, src):
        rank = self.local.rank
        tensor.copy_(self.links[(src, rank)].get(timeout=10))


def record(world: int = WORLD):
    """Run ring_all_reduce on `world` threads; returns the recorder and the starting values."""
    fake = RecordingDist(world)
    # One element per chunk keeps the picture exact: chunk k is element k.
    start = []
    for r in range(world):
        fake.tensors[r] = torch.full((world,), float(2 ** r), dtype=torch.float64)
        start.append([int(v) for v in fake.tensors[r]])
    errors = []

    def worker(rank):
        fake.local.rank = rank
        try:
            collectives.ring_all_reduce(fake.tensors[rank])
        except Exception as err:  # surfaced below, so a broken ring fails loudly
            errors.append(err)

    saved = collectives.dist
    collectives.dist = fake
    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        collectives.dist = saved
    if errors:
        raise errors[0]
    return fake, start


def replay(world: int = WORLD):
    """Rebuild each rank's chunks after every step from the recorded sends.

    At step t every rank r sent chunk sent[r][t]; its right neighbour received it. In the first
    world-1 steps the receiver adds it into its copy, in the last world-1 it overwrites it:
    exactly what ring_all_reduce does with what `recv` returns.
    """
    fake, start = record(world)
    steps = 2 * (world - 1)
    for r in range(world):
        if len(fake.sent[r]) != steps:
            raise RuntimeError(f"rank {r} sent {len(fake.sent[r])} messages, expected {steps}")
    held = [list(row) for row in start]
    history = [[list(h) for h in held]]
    for t in range(steps):
        new = [list(h) for h in held]
        for r in range(world):
            chunk, dst = fake.sent[r][t], (r + 1) % world
            value = held[r][chunk]
            new[dst][chunk] = new[dst][chunk] + value if t < world - 1 else value
        held = new
        history.append([list(h) for h in held])
    final = [[int(v) for v in fake.tensors[r]] for r in range(world)]
    if final != held:
        raise RuntimeError("the replay does not match what ring_all_reduce computed")
    return fake.sent, history


def label(mask: int, chunk: int, world: int) -> str:
    if mask == 2 ** world - 1:
        return f"Σ{chunk}"
    return "+".join(f"{LETTERS[r]}{chunk}" for r in range(world) if mask >> r & 1)


CELL_W, CELL_H, GAP, LEFT, ROW = 74, 30, 34, 170, 52


def render(world: int = WORLD) -> str:
    sent, history = replay(world)
    steps = 2 * (world - 1)
    rank_w = world * CELL_W
    width = LEFT + world * rank_w + (world - 1) * GAP + 20
    body = []
    for r in range(world):
        x = LEFT + r * (rank_w + GAP)
        body.append(svg.text(x + rank_w / 2, 22, f"rank {r}", size=16, weight="bold"))
        body.append(svg.text(x + rank_w / 2, 42, f"sends to rank {(r + 1) % world}", size=12,
                             fill="#444444"))
    full = 2 ** world - 1
    for t in range(steps + 1):
        y = 60 + t * ROW
        phase = ("start" if t == 0 else
                 f"reduce-scatter {t}" if t <= world - 1 else f"all-gather {t - world + 1}")
        body.append(svg.text(LEFT - 12, y + CELL_H / 2, phase, size=14, anchor="end",
                             weight="bold" if t in (0, world - 1, steps) else "normal"))
        for r in range(world):
            x0 = LEFT + r * (rank_w + GAP)
            # Outline thick the chunk this rank sends at the next step.
            next_send = sent[r][t] if t < steps else None
            for k in range(world):
                mask = history[t][r][k]
                done = mask == full
                x = x0 + k * CELL_W
                body.append(svg.rect(x, y, CELL_W, CELL_H,
                                     fill="#1f4e79" if done else "#ffffff",
                                     stroke="#c0392b" if k == next_send else "#222222",
                                     stroke_width=4 if k == next_send else 1))
                body.append(svg.text(x + CELL_W / 2, y + CELL_H / 2 + 1, label(mask, k, world),
                                     size=13, weight="bold" if done else "normal",
                                     fill="#ffffff" if done else "#111111"))
        if t < steps:
            body.append(svg.text(LEFT + (world * rank_w + (world - 1) * GAP) / 2,
                                 y + CELL_H + 11,
                                 "↓ each rank sends its outlined chunk to the right; the "
                                 "receiver "
                                 + ("adds it in" if t < world - 1 else "overwrites its copy"),
                                 size=12, fill="#444444"))
    height = 60 + (steps + 1) * ROW + 4
    desc = (f"The ring all-reduce over {world} ranks, recorded from the course's ring_all_reduce. "
            f"Each rank's tensor is cut into {world} chunks; rank r's chunks are "
            f"{', '.join(LETTERS[r] for r in range(world))}-chunks. In each of the "
            f"{world - 1} reduce-scatter steps every rank sends one chunk to its right neighbour, "
            f"which adds it into its own copy; after them each rank holds one chunk summed over "
            f"all ranks (shown dark, as Σ). In each of the {world - 1} all-gather steps the "
            f"finished chunks move one rank further right, overwriting stale copies, until every "
            f"rank holds every sum.")
    return svg.document(width, height, f"Ring all-reduce, {world} ranks, step by step", desc,
                        body)


if __name__ == "__main__":
    print(f"wrote {svg.write(NAME, render())}")
