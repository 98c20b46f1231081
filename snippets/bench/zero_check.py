"""Watch ZeRO 1, 2 and 3 from scratch (snippets/scratch/zero.py) train the tiny GPT on 2 processes:

    python -m snippets.bench.zero_check

For each stage: is the trained model the one a single process trains on the same global batches,
how many bytes of model state each rank holds (measured, beside the paper's formula), and how many
bytes each rank sent in one step (counted, beside the ring formula). It lives in bench/, not
beside zero.py, because the formulas it prints (zero_accounting.py) come from the planner's
bytes per parameter, and snippets/scratch/ imports only scratch, models, data, dist and flags.
"""

import torch

from snippets.dist import spawn
from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.data.dataset import random_token_batches
from snippets.scratch.ddp_check import GLOBAL_BATCH, SEQ, STEPS  # the DDP check's batches
from snippets.bench.zero_accounting import (
    expected_model_state_bytes, expected_traffic_bytes, model_state_bytes)
from snippets.scratch.zero import CommStats, ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3

BATCHES = random_token_batches(STEPS, GLOBAL_BATCH, SEQ)  # the same on every rank

ADAMW = dict(lr=1e-2, weight_decay=0.1)


def make_model():
    torch.manual_seed(0)
    return GPT(get_config("tiny"))


# --8<-- [start:check]
def shard(stage, model, comm):
    """The three stages, as a training script would set them up: (model to call, optimizer)."""
    if stage == 1:
        return model, ZeRO1Optimizer(model.parameters(), comm=comm, **ADAMW)
    if stage == 2:
        return model, ZeRO2Optimizer(model.parameters(), comm=comm, bucket_cap_mb=0.1, **ADAMW)
    net = ZeRO3(model, comm=comm)
    return net, torch.optim.AdamW(net.parameters(), **ADAMW)


def moment_shards(stage, model, net, optimizer):
    """This rank's slices of AdamW's first moment, one per flat buffer, with the names and sizes
    of the parameters laid end to end in it (see full_moments)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if stage == 1:
        pairs = [(optimizer.shard, optimizer.flat)]
    elif stage == 2:
        pairs = list(zip(optimizer.shards, optimizer.buckets))
    else:
        pairs = list(zip(net.parameters(), [unit.flat for unit in net.units]))
    state = getattr(optimizer, "optimizer", optimizer).state
    return [([names[id(p)] for p in flat.params], flat.sizes, state[shard]["exp_avg"].clone())
            for shard, flat in pairs]


def full_moments(per_rank: list) -> dict:
    """Put each flat buffer's slices from all ranks end to end; split it into parameters."""
    out = {}
    for i, (names, sizes, _) in enumerate(per_rank[0]):
        flat = torch.cat([rank_shards[i][2] for rank_shards in per_rank])
        out.update(zip(names, flat[:sum(sizes)].split(sizes)))
    return out


def train_stages(rank, world_size):
    results = {}
    for stage in (1, 2, 3):
        model, comm = make_model(), CommStats()
        net, optimizer = shard(stage, model, comm)
        for batch in BATCHES:
            comm.reset()
            inputs, targets = shift_for_next_token(batch.chunk(world_size)[rank])  # my slice
            net(inputs, targets)[1].backward()
            optimizer.step()
            held, sent = model_state_bytes(model, optimizer), sum(comm.bytes.values())
            optimizer.zero_grad()
        weights = net.full_state_dict() if stage == 3 else {
            n: p.detach().clone() for n, p in model.named_parameters()}
        results[stage] = weights, held, sent, moment_shards(stage, model, net, optimizer)
    return results


def main(world_size: int = 2):
    model = make_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    for batch in BATCHES:  # one process, whole global batches
        inputs, targets = shift_for_next_token(batch)
        model(inputs, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    single = dict(model.named_parameters())
    single_moments = {n: optimizer.state[p]["exp_avg"] for n, p in single.items()}
    moved = max((single[n] - start[n]).abs().max().item() for n in single)
    largest_moment = max(m.abs().max().item() for m in single_moments.values())
    psi = model.num_parameters()
    print(f"tiny GPT, {psi:,} parameters, {world_size} ranks, {STEPS} AdamW steps; "
          "bytes per rank, measured (formula)")
    print(f"{'stage':<7}{'same as 1 process':>18}{'model state':>24}{'sent per step':>22}")
    ranks = spawn(train_stages, world_size)
    for stage, (weights, held, sent, _) in ranks[0].items():  # rank 0's view of the weights
        moments = full_moments([r[stage][3] for r in ranks])
        # The weights within 1e-3 of how far training moved them, and AdamW's first moment
        # within 1e-3 of its largest value: Adam's update hides a gradient twice too large (a
        # sum over ranks instead of a mean), the moment does not (tests/test_zero.py says why).
        same = (max((weights[n] - single[n]).abs().max().item() for n in single) < 1e-3 * moved
                and max((moments[n].view_as(m) - m).abs().max().item()
                        for n, m in single_moments.items()) < 1e-3 * largest_moment)
        formula = expected_model_state_bytes(stage, psi, world_size)["total"]
        theory = sum(expected_traffic_bytes(stage, psi, world_size).values())
        print(f"ZeRO-{stage:<2}{str(same):>18}"
              f"{held['total']:>12,} ({formula:>9,.0f}){sent:>12,} ({theory:>7,.0f})")
# --8<-- [end:check]


if __name__ == "__main__":
    main()
