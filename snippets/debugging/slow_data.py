"""Slow training from a slow data loader, timed per step, and the fix: loader workers.

    python -m snippets.debugging.slow_data [--delay-ms 10] [--workers 0 2] [--steps 5]

Each example is cut from the course corpus and, to stand in for reading a file or tokenizing on
the fly, waits `delay_ms` before it is returned. With `num_workers=0` the training process does
that work itself, between steps; with workers, background processes prepare the next batches
while the model computes. The timer splits every step into waiting for the batch and compute.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from snippets.data.dataset import load_tokens
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.machine import set_threads


# --8<-- [start:slow-loader]
class SlowWindows(Dataset):
    """Windows of `seq_len + 1` tokens from the corpus; each takes `delay_ms` to produce."""

    def __init__(self, seq_len: int, delay_ms: float, size: int = 256, seed: int = 0):
        self.tokens = load_tokens(None)
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.tokens) - seq_len - 1, (size,), generator=generator)
        self.seq_len, self.delay_s = seq_len, delay_ms / 1e3

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay_s)  # I/O or tokenization: time on the clock, little CPU
        start = int(self.starts[i])
        return self.tokens[start:start + self.seq_len + 1].long()


def timed_training(num_workers: int, steps: int, batch_size: int = 8,
                   delay_ms: float = 10.0, config_name: str = "tiny") -> list[dict]:
    """Train for `steps` steps, timing how long each step waited for its batch and how long
    it computed. Wall-clock time: waiting is exactly what a CPU-time clock would not see."""
    torch.manual_seed(0)
    model = GPT(get_config(config_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = SlowWindows(model.config.max_position_embeddings, delay_ms)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        persistent_workers=False)
    log, batches = [], iter(loader)
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = next(batches)
        loaded = time.perf_counter()
        _, loss = model(*shift_for_next_token(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        log.append({"step": step, "loss": loss.item(), "data_ms": 1e3 * (loaded - start),
                    "compute_ms": 1e3 * (done - loaded), "first_tokens": batch[0, :4].tolist()})
    return log
# --8<-- [end:slow-loader]


def main(argv=None) -> None:
    from snippets.flags import Parser, float_at_least, int_at_least

    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float_at_least(0), default=10.0)
    parser.add_argument("--workers", type=int_at_least(0), nargs="+", default=[0, 2])
    parser.add_argument("--steps", type=int_at_least(2), default=5,
                        help="at least 2: step 1 pays for starting the workers and is left out")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8)
    args = parser.parse_args(argv)
    set_threads(1, "the data loader's workers and the model share the cores")
    print(f"tiny GPT, batch {args.batch_size}, each example takes {args.delay_ms:g} ms to load")
    for workers in args.workers:
        log = timed_training(workers, args.steps, args.batch_size, args.delay_ms)
        later = log[1:]  # step 1 also pays for starting the workers
        data = sum(r["data_ms"] for r in later) / len(later)
        compute = sum(r["compute_ms"] for r in later) / len(later)
        print(f"num_workers={workers}: step 1 waited {log[0]['data_ms']:.0f} ms; steps 2-"
              f"{args.steps} waited {data:.0f} ms and computed {compute:.0f} ms on average "
              f"(data share {data / (data + compute):.0%})")


if __name__ == "__main__":
    main()
