"""Pipeline parallelism with torch.distributed.pipelining, the way TorchTitan uses it.

The stages are the ones built by hand in snippets/scratch/pipeline.py (`split_into_stages`), so
the only thing that changes is who runs the schedule: PyTorch's PipelineStage handles the sends
and receives between neighbouring ranks, and ScheduleGPipe / Schedule1F1B decide the order of the
forwards and backwards. tests/test_pipeline.py checks both against the from-scratch schedules and
against single-process training.

    python -m snippets.library.pipeline      # 2 stages, both schedules, compared
    python -m snippets.library.pipeline --stages 4 --micro-batches 8
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from snippets.models.gpt import GPT, get_config, shift_for_next_token
from snippets.scratch.pipeline import (cross_entropy, split_into_stages,
                                       sync_tied_embedding_grads)
from snippets.flags import Parser, int_at_least

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# --8<-- [start:build]
def build_pipeline(model: GPT, stage_index: int, num_stages: int, num_micro_batches: int,
                   schedule_name: str, device: torch.device = torch.device("cpu"), group=None):
    """This rank's stage module and a schedule that drives it."""
    module = split_into_stages(model, num_stages)[stage_index]
    # No shapes given: on the first step the stage runs its module once to learn the shapes
    # of what it sends and receives, and tells its neighbours.
    stage = PipelineStage(module, stage_index, num_stages, device, group=group)

    def loss_fn(logits, targets):
        # As in TorchTitan: each micro-batch's loss is divided by m here, and the schedule is
        # told not to divide the gradients again (scale_grads=False).
        return cross_entropy(logits, targets) / num_micro_batches

    schedule = TORCH_SCHEDULES[schedule_name](stage, n_microbatches=num_micro_batches,
                                              loss_fn=loss_fn, scale_grads=False)
    return module, schedule


def torch_pipeline_train_step(module, schedule, tokens: torch.Tensor, stage_index: int,
                              num_stages: int, group=None):
    """One global batch (B, T+1) forward and backward; the caller steps its optimizer.
    Returns the mean loss on the last stage, None elsewhere. `group`: the pipeline's ranks,
    when they are not the whole world (3-D)."""
    inputs, targets = shift_for_next_token(tokens)
    first, last = stage_index == 0, stage_index == num_stages - 1
    losses = [] if last else None
    # The schedule cuts the batch into micro-batches itself. Only the first stage passes the
    # model's input, only the last the targets.
    schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                  losses=losses)
    sync_tied_embedding_grads(module, stage_index, num_stages, group)  # the library knows no ties
    return sum(loss.item() for loss in losses) if last else None
# --8<-- [end:build]


def train_torch_pipeline(rank, world_size, schedule_names, num_micro_batches, steps, batch_size,
                         seq_len, num_layers=None):
    """The training of snippets.scratch.pipeline_check.train_pipeline, with torch's schedules."""
    results = {}
    for name in schedule_names:
        torch.manual_seed(0)
        model = GPT(get_config("tiny", num_hidden_layers=num_layers or world_size))
        module, schedule = build_pipeline(model, rank, world_size, num_micro_batches, name)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
        g = torch.Generator().manual_seed(1)  # the same batches on every rank
        losses = []
        for _ in range(steps):
            tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1),
                                   generator=g)
            losses.append(torch_pipeline_train_step(module, schedule, tokens, rank, world_size))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results[name] = {"state": {k: v.clone() for k, v in module.state_dict().items()},
                         "losses": losses}
    return results


def both_pipelines(rank, world_size, *args):
    """From scratch and torch's, in the same processes."""
    from snippets.scratch.pipeline_check import train_pipeline

    scratch = train_pipeline(rank, world_size, *args)
    return scratch, train_torch_pipeline(rank, world_size, *args)


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--stages", type=int_at_least(2), default=2,
                   help="pipeline stages, one process and one layer each")
    p.add_argument("--micro-batches", type=int_at_least(1), default=4,
                   help="micro-batches per step: at least --stages, and dividing --batch-size")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="sequences per step")
    p.add_argument("--steps", type=int_at_least(1), default=3, help="SGD steps")
    args = p.parse_args(argv)
    # torch's Schedule1F1B refuses fewer, with a traceback from every process.
    if args.micro_batches < args.stages:
        p.error(f"argument --micro-batches: must be at least --stages ({args.stages}) for "
                f"Schedule1F1B, got {args.micro_batches}")
    if args.batch_size % args.micro_batches:
        p.error(f"argument --batch-size: must be a multiple of --micro-batches "
                f"({args.micro_batches}), got {args.batch_size}")
    return args


# --8<-- [start:main]
def main(argv=None) -> None:
    from snippets.dist import spawn
    from snippets.scratch.reference import single_process

    args = parse_args(argv)
    stages, m, steps, batch, seq = (args.stages, args.micro_batches, args.steps,
                                    args.batch_size, 32)
    reference, ref_losses = single_process(steps, batch, seq, num_layers=stages)
    ranks = spawn(both_pipelines, stages, ["gpipe", "1f1b"], m, steps, batch, seq, timeout_s=120)
    print(f"tiny GPT, {stages} stages, {m} micro-batches of {batch // m} x {seq} tokens, "
          f"{steps} SGD steps")
    print(f"single process          losses {' '.join(f'{x:.4f}' for x in ref_losses)}")
    for name in ["gpipe", "1f1b"]:
        ours = [scratch[name] for scratch, _ in ranks]
        theirs = [torch_[name] for _, torch_ in ranks]
        same = all(torch.equal(a["state"][k], b["state"][k])
                   for a, b in zip(ours, theirs) for k in a["state"])
        worst = max((b["state"][k] - reference[k]).abs().max().item()
                    for b in theirs for k in b["state"])
        print(f"torch {TORCH_SCHEDULES[name].__name__:<13}   losses "
              f"{' '.join(f'{x:.4f}' for x in theirs[-1]['losses'])}   "
              f"weights equal to from scratch: {same}, "
              f"max |weight - single process| {worst:.1e}")
# --8<-- [end:main]


if __name__ == "__main__":
    main()
