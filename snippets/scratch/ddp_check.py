"""See for yourself that DDP from scratch trains the same model as one process.

Trains the tiny GPT for 3 SGD steps on 2 ranks with each wrapper from snippets/scratch/ddp.py,
each rank on its half of every global batch, and once in a single process on the whole global
batches; prints whether the weights agree. A fourth run with no gradient synchronisation at all
shows what the check catches: its replicas drift apart and away from the single-process model.

    python -m snippets.scratch.ddp_check

tests/test_ddp_scratch.py runs the same comparison with 2 and 4 ranks and against torch's DDP.
"""

import torch

from snippets.data.dataset import random_token_batches
from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.ddp import BucketedDDP, NaiveDDP, OverlappedDDP

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16


# --8<-- [start:check]
WRAPPERS = {
    "naive": NaiveDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.1),  # small buckets: several of them
    "overlapped": lambda m: OverlappedDDP(m, bucket_cap_mb=0.1),
    "no sync": lambda m: m,  # every rank trains alone on its half: the mistake to catch
}


def train(model: torch.nn.Module, ddp: torch.nn.Module, batches: list[torch.Tensor]) -> dict:
    # SGD with momentum, not Adam: Adam divides out the gradient's scale, so it would hide a
    # DDP that summed the ranks' gradients instead of averaging them.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for batch in batches:
        _, loss = ddp(*shift_for_next_token(batch))
        loss.backward()
        if hasattr(ddp, "sync_gradients"):  # naive and bucketed average after backward
            ddp.sync_gradients()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def rank_worker(rank: int, world_size: int) -> dict:
    weights = {}
    for variant, wrap in WRAPPERS.items():
        torch.manual_seed(0)  # the same initial model on every rank and in the reference
        model = GPT(get_config("tiny"))
        batches = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank
        my_slices = [batch.chunk(world_size)[rank] for batch in batches]
        weights[variant] = train(model, wrap(model), my_slices)
    return weights


def same_model(a: dict, b: dict, start: dict) -> bool:
    """Equal up to fp32 rounding: the per-rank means are added in a different order than one
    mean over the global batch, a few ulps. A bug moves weights by the size of an update."""
    moved = max((b[n] - start[n]).abs().max().item() for n in b)
    return max((a[n] - b[n]).abs().max().item() for n in a) < 1e-5 * moved


def main(world_size: int = 2) -> None:
    torch.manual_seed(0)
    model = GPT(get_config("tiny"))
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    batches = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)
    reference = train(model, model, batches)  # one process, the whole global batch
    per_rank = spawn(rank_worker, world_size)
    for variant in WRAPPERS:
        ranks = [weights[variant] for weights in per_rank]
        replicas_identical = all(torch.equal(r[n], ranks[0][n]) for r in ranks for n in r)
        print(f"{variant:>10}: replicas identical {replicas_identical}, equal to one process "
              f"on the global batch {same_model(ranks[0], reference, start)}")
# --8<-- [end:check]


if __name__ == "__main__":
    main()
