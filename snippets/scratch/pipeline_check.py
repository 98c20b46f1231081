"""Train the tiny GPT through the from-scratch pipeline (snippets/scratch/pipeline.py) with both
schedules, and compare with one process trained on the same batches (reference.py):

    python -m snippets.scratch.pipeline_check

tests/test_pipeline.py runs the same training on more pipeline shapes and holds the weights to
a stated bound; lessons_src/pipeline_timeline.py draws the traces it returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from snippets.models.gpt import GPT, get_config
from snippets.scratch.pipeline import SCHEDULES, pipeline_train_step, split_into_stages
from snippets.scratch.reference import SGD, single_process, token_batches


# --8<-- [start:training]
def train_pipeline(rank, world_size, schedule_names, num_micro_batches, steps, batch_size, seq_len,
                   config_name="tiny", num_layers=None):
    """Train a GPT (by default the tiny one with one layer per stage) for a few steps with each
    schedule; return, per schedule, this stage's weights, the losses and every step's trace."""
    results = {}
    for name in schedule_names:
        torch.manual_seed(0)
        model = GPT(get_config(config_name, num_hidden_layers=num_layers or world_size))
        stage = split_into_stages(model, world_size)[rank]
        optimizer = torch.optim.SGD(stage.parameters(), **SGD)
        losses, traces = [], []
        for tokens in token_batches(model.config.vocab_size, steps, batch_size, seq_len):
            dist.barrier()  # only so that each step's timeline starts together on every rank
            loss, trace = pipeline_train_step(stage, SCHEDULES[name], tokens,
                                              num_micro_batches, rank, world_size)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
            traces.append(trace)
        state = {k: v.clone() for k, v in stage.state_dict().items()}
        results[name] = {"state": state, "losses": losses, "traces": traces}
    return results
# --8<-- [end:training]


def main(stages=2, micro_batches=4, steps=3, batch=8, seq=16):
    from snippets.dist import spawn

    ranks = spawn(train_pipeline, stages, list(SCHEDULES), micro_batches, steps, batch, seq,
                  timeout_s=60)
    reference, ref_losses = single_process(steps, batch, seq, num_layers=stages)
    torch.manual_seed(0)  # the initial weights: how far training moved them sets the bound
    init = GPT(get_config("tiny", num_hidden_layers=stages)).state_dict()
    bound = 1e-5 * max((reference[k] - init[k]).abs().max().item() for k in reference)
    print(f"tiny GPT, {stages} stages, {micro_batches} micro-batches, {steps} SGD steps")
    print(f"one process    losses {' '.join(f'{x:.4f}' for x in ref_losses)}")
    for name in SCHEDULES:
        worst = max((w - reference[k]).abs().max().item()
                    for r in ranks for k, w in r[name]["state"].items())
        losses = " ".join(f"{x:.4f}" for x in ranks[-1][name]["losses"])
        print(f"{name:<5} pipeline losses {losses}   max |weight diff| "
              f"{'<' if worst < bound else '>='} 1e-5 x the largest change")


if __name__ == "__main__":
    main()
