"""Reproducibility: what makes two training runs bit-identical, and what cannot be.

    python snippets/scripts/reproducibility.py              # the first seven demos
    python snippets/scripts/reproducibility.py float-order  # one of them

The first seven print a short result that is the same on every run; drift, threads and kernels
print this machine's numbers; cuda needs an NVIDIA GPU.

    same-seed      the same seed gives bit-identical losses; another seed does not
    data-order     a shuffling DataLoader, with and without a generator of its own
    workers        DataLoader workers and an RNG object kept by the dataset
    deterministic  torch.use_deterministic_algorithms(True) on the CPU
    float-order    the same four float32 numbers, added in three orders
    batch-split    one batch of 8 vs two batches of 4: the gradients data parallelism averages
    resume         a run stopped at step 25 and resumed equals an unbroken run
    drift          one weight changed in its last bit: how far the losses drift
    threads        the same sum and the same training steps with 1 and 2 CPU threads
    kernels        the same training steps on the kernels of three kinds of x86-64 CPU
    cuda           the GPU's non-deterministic atomics and CUBLAS_WORKSPACE_CONFIG
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

from snippets.data.dataset import RandomWindowSampler, load_tokens
from snippets.machine import KERNEL_FAMILIES, set_threads
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.training.checkpoint import seed_everything
from snippets.scripts.train_tiny_transformer import parse_args, train


# --8<-- [start:same-seed]
def train_losses(seed: int, steps: int = 5, batch_size: int = 8) -> torch.Tensor:
    """The losses of a few training steps of the tiny GPT; every random choice comes from seed."""
    seed_everything(seed)  # Python, NumPy and torch: here, the model's initial weights
    config = get_config("tiny")
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    tokens = load_tokens(None)  # the built-in corpus: the same bytes on every machine
    # The sampler has a generator of its own, so the data order needs the seed too.
    sampler = RandomWindowSampler(tokens, batch_size, config.max_position_embeddings, seed=seed)
    losses = []
    for _ in range(steps):
        inputs, targets = shift_for_next_token(sampler.next_batch())
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def demo_same_seed() -> dict:
    first, again, other = train_losses(seed=0), train_losses(seed=0), train_losses(seed=1)
    result = {"same_seed_identical": torch.equal(first, again),
              "other_seed_identical": torch.equal(first, other)}
    print(f"seed 0, run twice:  bit-identical losses: {result['same_seed_identical']}")
    print(f"seed 0 vs seed 1:   bit-identical losses: {result['other_seed_identical']}")
    return result
# --8<-- [end:same-seed]


# --8<-- [start:data-order]
def epoch_order(loader: DataLoader) -> list[int]:
    return [i for batch in loader for i in batch.tolist()]


def demo_data_order() -> dict:
    data = list(range(16))  # any list works as a dataset: items are their own indices

    def shuffled(generator=None) -> DataLoader:
        return DataLoader(data, batch_size=4, shuffle=True, generator=generator)

    # Without a generator, each epoch's shuffle is seeded from the *global* torch RNG when
    # iteration starts: reproducible, but it moves when anything else draws a random number.
    torch.manual_seed(0)
    reference = epoch_order(shuffled())
    torch.manual_seed(0)
    again = epoch_order(shuffled())
    torch.manual_seed(0)
    torch.nn.Linear(8, 8)  # initialising a layer draws from the global RNG first
    after_layer = epoch_order(shuffled())

    # With a generator of its own, the order ignores the global RNG, torch.manual_seed
    # included: the run's seed reaches it only if you seed it yourself.
    torch.manual_seed(0)
    own_0 = epoch_order(shuffled(torch.Generator()))
    torch.manual_seed(1)
    own_1 = epoch_order(shuffled(torch.Generator()))
    seeded_1 = epoch_order(shuffled(torch.Generator().manual_seed(1)))
    result = {"global_same": reference == again, "global_after_layer": reference == after_layer,
              "own_ignores_manual_seed": own_0 == own_1, "own_seeded_differs": own_1 != seeded_1}
    print("shuffle seeded from the global RNG (no generator=):")
    print(f"  torch.manual_seed(0) twice: same order: {result['global_same']}")
    print(f"  torch.manual_seed(0), a layer built first: same order: "
          f"{result['global_after_layer']}")
    print("shuffle with generator=torch.Generator():")
    print(f"  torch.manual_seed(0) vs torch.manual_seed(1): same order: "
          f"{result['own_ignores_manual_seed']}")
    print(f"  unseeded vs torch.Generator().manual_seed(1): same order: "
          f"{not result['own_seeded_differs']}")
    return result
# --8<-- [end:data-order]


# --8<-- [start:workers]
class RandomCrops(Dataset):
    """Each item is a random crop offset, drawn from an RNG object that the dataset owns,
    as augmentation code often does. Each worker process gets a *copy* of the dataset, and
    with it a copy of that RNG in the same state."""

    def __init__(self, length: int, seed: int = 0):
        self.length = length
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return self.rng.randrange(1000)


def reseed_worker(worker_id: int) -> None:
    """worker_init_fn: reseed this worker's copy of the dataset's RNG from the seed the
    DataLoader chose for the worker (base seed + worker_id, the base drawn from generator=).
    PyTorch seeds each worker's global `random`, NumPy and torch RNGs from the same two numbers
    itself; RNG objects of your own are yours to reseed."""
    info = torch.utils.data.get_worker_info()
    info.dataset.rng.seed(info.seed)


def crops_per_worker(worker_init_fn=None, seed: int = 0) -> list[list[int]]:
    loader = DataLoader(RandomCrops(8), batch_size=4, num_workers=2,
                        worker_init_fn=worker_init_fn,
                        generator=torch.Generator().manual_seed(seed))
    return [batch.tolist() for batch in loader]  # batch 0 from worker 0, batch 1 from worker 1


def demo_workers() -> dict:
    copied = crops_per_worker()
    reseeded = crops_per_worker(reseed_worker)
    result = {"copies_repeat": copied[0] == copied[1],
              "reseeded_differ": reseeded[0] != reseeded[1],
              "reseeded_reproducible": reseeded == crops_per_worker(reseed_worker)}
    print(f"no worker_init_fn: both workers drew the same crops: {result['copies_repeat']}")
    print(f"reseed_worker: the workers' crops differ: {result['reseeded_differ']}")
    print(f"reseed_worker, same generator seed again: same crops: "
          f"{result['reseeded_reproducible']}")
    return result
# --8<-- [end:workers]


# --8<-- [start:deterministic]
def demo_deterministic() -> dict:
    torch.use_deterministic_algorithms(True)
    try:
        # Memory from torch.empty is filled with NaN, so code that reads it before writing
        # gives NaN instead of whatever the last user of that memory left behind.
        empty_is_nan = bool(torch.empty(3).isnan().all())
        print(f"torch.empty(3) is all NaN: {empty_is_nan}")
        target = torch.zeros(3)
        try:
            # Two values written to index 0: which one ends up there is unspecified. Without
            # accumulate=True, put_ raises in this mode whatever the indices: it could repeat.
            target.put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
            error = ""
        except RuntimeError as err:
            error = str(err).split(",")[0]
        print(f"put_ with a repeated index raises RuntimeError: {error}")
    finally:
        torch.use_deterministic_algorithms(False)
    return {"empty_is_nan": empty_is_nan, "put_error": error}
# --8<-- [end:deterministic]


# --8<-- [start:float-order]
def add_left_to_right(values: torch.Tensor) -> torch.Tensor:
    """One accumulator, rounded to float32 after every addition (a ring all-reduce's order)."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def add_pairwise(values: torch.Tensor) -> torch.Tensor:
    """Neighbours first, then the partial sums (a tree all-reduce's or a GPU reduction's order)."""
    while len(values) > 1:
        values = values[0::2] + values[1::2]
    return values[0]


def demo_float_order() -> dict:
    values = torch.tensor([0.1, 0.6, 0.7, 0.9])  # float32, like gradients from four workers
    sums = {"((0.1 + 0.6) + 0.7) + 0.9": add_left_to_right(values),
            "(0.1 + 0.6) + (0.7 + 0.9)": add_pairwise(values),
            "((0.9 + 0.7) + 0.6) + 0.1": add_left_to_right(values.flip(0))}
    for order, total in sums.items():
        print(f"{order} = {total.item():.9g}")
    distinct = len({total.item() for total in sums.values()})
    spacing = (torch.nextafter(sums["(0.1 + 0.6) + (0.7 + 0.9)"], torch.tensor(3.0))
               - sums["(0.1 + 0.6) + (0.7 + 0.9)"]).item()
    print(f"{distinct} different float32 results; neighbouring float32 values near 2.3 are "
          f"{spacing:.3g} apart")
    return {"sums": {k: v.item() for k, v in sums.items()}, "distinct": distinct}
# --8<-- [end:float-order]


# --8<-- [start:batch-split]
def gradients(model, batch: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _, loss = model(*shift_for_next_token(batch))
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def demo_batch_split() -> dict:
    """1 worker with a batch of 8 vs 2 data-parallel workers with 4 each, averaging gradients."""
    torch.manual_seed(0)
    config = get_config("tiny")
    model = GPT(config)
    sampler = RandomWindowSampler(load_tokens(None), 8, config.max_position_embeddings, seed=0)
    batch = sampler.next_batch()
    whole = gradients(model, batch)
    averaged = [(a + b) / 2 for a, b in zip(gradients(model, batch[:4]),
                                            gradients(model, batch[4:]))]
    identical = all(torch.equal(w, a) for w, a in zip(whole, averaged))
    close = all(torch.allclose(w, a, rtol=0, atol=1e-6) for w, a in zip(whole, averaged))
    print(f"one batch of 8 vs the average of two batches of 4: bit-identical gradients: "
          f"{identical}")
    print(f"equal within atol=1e-6: {close}")
    return {"identical": identical, "close": close}
# --8<-- [end:batch-split]


# --8<-- [start:drift]
def demo_drift(steps: int = 200) -> dict:
    """Train twice from the same seed; in the second run, one weight is one float32 step larger."""
    config = get_config("tiny")
    tokens = load_tokens(None)
    runs = []
    for nudge in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        if nudge:
            with torch.no_grad():
                weight = model.layers[0].mlp.up_proj.weight
                weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
        sampler = RandomWindowSampler(tokens, 8, config.max_position_embeddings, seed=0)
        losses = []
        for _ in range(steps):
            _, loss = model(*shift_for_next_token(sampler.next_batch()))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs.append(losses)
    checkpoints = [s for s in (1, 10, 25, 50, 100, 150, 200) if s <= steps]
    print("step   loss      |difference| after nudging one weight by one float32 step")
    for step in checkpoints:
        a, b = runs[0][step - 1], runs[1][step - 1]
        print(f"{step:4d}   {a:.4f}    {abs(a - b):.1e}")
    return {"losses": runs[0], "nudged": runs[1]}
# --8<-- [end:drift]


# --8<-- [start:resume]
def demo_resume() -> dict:
    """Train 40 steps unbroken; train again, stop at 25 (--max-steps saves a checkpoint
    there), resume from it."""
    common = ["--config", "tiny", "--device", "cpu", "--threads", "1", "--batch-size", "8",
              "--seq-len", "32", "--steps-per-epoch", "40", "--ckpt-every", "10",
              "--eval-every", "0", "--sample-tokens", "8"]

    def losses(records) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    quiet = io.StringIO()  # the trainer's log lines and progress bar are not the point here
    with (tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(quiet),
          contextlib.redirect_stderr(quiet)):
        unbroken = losses(train(parse_args(common + ["--out", f"{tmp}/unbroken"])))
        train(parse_args(common + ["--out", f"{tmp}/broken", "--max-steps", "25"]))
        resumed = losses(train(parse_args(common + ["--out", f"{tmp}/broken", "--resume"])))
    same = resumed == {step: unbroken[step] for step in range(26, 41)}
    print(f"resumed at step 25, steps 26-40 equal the unbroken run's, bit for bit: {same}")
    return {"resumed_equals_unbroken": same}
# --8<-- [end:resume]


# --8<-- [start:threads]
def demo_threads() -> dict:
    """The same sum and the same training steps with 1 and 2 CPU threads."""
    values = torch.rand(10_000_000, generator=torch.Generator().manual_seed(0))
    result, before = {}, torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            result[threads] = {"sum": values.sum().item(), "losses": train_losses(seed=0)}
    finally:
        torch.set_num_threads(before)
    exact = values.double().sum().item()
    print(f"sum of 10M float32 numbers: 1 thread {result[1]['sum']:.1f}, "
          f"2 threads {result[2]['sum']:.1f} (float64: {exact:.2f})")
    print(f"training losses, 1 vs 2 threads: bit-identical: "
          f"{torch.equal(result[1]['losses'], result[2]['losses'])}")
    return result
# --8<-- [end:threads]


# --8<-- [start:kernels]
def losses_in_family(family: str, steps: int) -> tuple[str, list[float]]:
    """train_losses in a fresh process whose kernels are capped to a family (snippets/machine.py):
    the kernels are chosen at a process's first op, so each family needs a process of its own."""
    code = ("import json, torch; from snippets.scripts.reproducibility import train_losses; "
            f"torch.set_num_threads(1); losses = train_losses(seed=0, steps={steps}).tolist(); "
            "print(json.dumps([torch.backends.cpu.get_cpu_capability(), losses]))")
    env = {k: v for k, v in os.environ.items()
           if k not in {key for caps in KERNEL_FAMILIES.values() for key in caps}}
    result = subprocess.run([sys.executable, "-c", code], env={**env, **KERNEL_FAMILIES[family]},
                            capture_output=True, text=True, timeout=600, check=True)
    return tuple(json.loads(result.stdout.splitlines()[-1]))


def demo_kernels(steps: int = 100) -> dict:
    """The same seed and the same steps on the kernels of three kinds of CPU (emulated here)."""
    runs = {family: losses_in_family(family, steps) for family in KERNEL_FAMILIES}
    native = runs["native"][1]
    print(f"step {'  '.join(f'{f} ({runs[f][0]})'.rjust(18) for f in runs)}")
    for step in (1, 10, 50, 100):
        if step <= steps:
            print(f"{step:4d} " + "  ".join(f"{runs[f][1][step - 1]:18.6f}" for f in runs))
    for family in ("avx2", "default"):
        diff = [abs(a - b) for a, b in zip(runs[family][1], native)]
        first = next((i + 1 for i, d in enumerate(diff) if d > 0), None)
        print(f"{family} vs native: first step that differs {first}, "
              f"largest |difference| {max(diff):.1e}")
    return runs
# --8<-- [end:kernels]


# --8<-- [start:cuda]
def distinct_scatter_add_results(runs: int = 20, deterministic: bool = False) -> int:
    """How many different results `runs` identical scatter_add_ calls give on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(1_000_000, device="cuda", generator=generator)
    index = torch.randint(0, 100, (1_000_000,), device="cuda", generator=generator)
    torch.use_deterministic_algorithms(deterministic)
    try:
        # About 10,000 values land in each of the 100 slots. The default kernel adds them with
        # atomics, in whatever order the GPU's threads happen to arrive.
        results = {torch.zeros(100, device="cuda").scatter_add_(0, index, src).cpu()
                   .numpy().tobytes() for _ in range(runs)}
    finally:
        torch.use_deterministic_algorithms(False)
    return len(results)


def demo_cuda() -> dict:
    default = distinct_scatter_add_results(deterministic=False)
    pinned = distinct_scatter_add_results(deterministic=True)
    print(f"scatter_add_, 20 identical calls: {default} distinct result(s) by default, "
          f"{pinned} with use_deterministic_algorithms(True)")
    # cuBLAS promises the same bits run to run only with a fixed workspace configuration (by
    # default its choice of algorithm, and so of summation order, can depend on the workspace
    # free on each stream). In deterministic mode PyTorch refuses a matmul without the setting.
    torch.use_deterministic_algorithms(True)
    try:
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        matmul = "ran"
    except RuntimeError as err:  # the message names the setting it wants
        wants = "CUBLAS_WORKSPACE_CONFIG" in str(err)
        matmul = "raised RuntimeError" + (", asking for CUBLAS_WORKSPACE_CONFIG" if wants
                                          else f": {err}")
    finally:
        torch.use_deterministic_algorithms(False)
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "unset")
    print(f"matmul in deterministic mode, CUBLAS_WORKSPACE_CONFIG={config}: {matmul}")
    return {"default": default, "deterministic": pinned, "matmul": matmul}
# --8<-- [end:cuda]


DEMOS = {
    "same-seed": demo_same_seed,
    "data-order": demo_data_order,
    "workers": demo_workers,
    "deterministic": demo_deterministic,
    "float-order": demo_float_order,
    "batch-split": demo_batch_split,
    "resume": demo_resume,
    "drift": demo_drift,
    "threads": demo_threads,
    "kernels": demo_kernels,
    "cuda": demo_cuda,
}


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or [
        name for name in DEMOS if name not in ("drift", "threads", "kernels", "cuda")]
    unknown = [name for name in names if name not in DEMOS]
    if unknown:
        print(f"error: unknown demo {', '.join(unknown)}; choose from {', '.join(DEMOS)}",
              file=sys.stderr)
        return 2
    if "cuda" in names and not torch.cuda.is_available():
        print("error: the cuda demo needs an NVIDIA GPU", file=sys.stderr)
        return 2
    # One thread, as in train_tiny_transformer.py: the results below must not depend on how
    # many cores this machine has (the threads demo sets its own).
    set_threads(1, "the results below must not depend on this machine's core count")
    for i, name in enumerate(names):
        if len(names) > 1:
            print(f"{'' if i == 0 else chr(10)}== {name}")
        DEMOS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
