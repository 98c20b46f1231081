"""The optimizer and the learning-rate schedule of every trainer in the course, written once.

* `build_optimizer(model, lr, weight_decay)` (exercise 8): AdamW, weight decay on matrices only.
* `lr_at(step, lr, min_lr, warmup_steps, max_steps)` (exercise 9): linear warmup, then cosine
  decay to a floor.

Session A's script (snippets/scripts/train_tiny_transformer.py) and the trainer core
(ddp_trainer.py, and the FSDP and parallel trainers built on it) both call these two, so a run of
one and a run of the other follow the same curve: the script's schedule is this one with
min_lr = lr / 10, the trainer's default floor.
"""

from __future__ import annotations

import math

import torch


# --8<-- [start:optimizer]
def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with two parameter groups: weight_decay on the matrices, none on the 1-D
    parameters. Parameters that do not require grad (frozen ones) are left out."""
    # --8<-- [start:exercise-8]
    decay, no_decay = [], []
    # named_parameters() yields each Parameter object once. The tied embed_tokens / lm_head
    # matrix is one tensor under two names, so it is listed (and decayed) once; a tensor in
    # two groups would make AdamW raise.
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        # Matrices (Linear and Embedding weights) hold the model's capacity: decay keeps them
        # small. 1-D parameters (RMSNorm gains, biases) only scale or shift; decay would pull
        # the gains from 1 toward 0 and fight the normalisation.
        if param.dim() >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # betas=(0.9, 0.95) as in GPT-3 and Llama: a shorter second-moment memory than the
    # default 0.999 reacts faster to loss spikes. The schedule sets the lr of every step; lr
    # here is only where it starts. On CUDA, fused=True would run the update as one kernel.
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    # --8<-- [end:exercise-8]
# --8<-- [end:optimizer]


# --8<-- [start:lr-schedule]
def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based): linear warmup to lr over
    warmup_steps, cosine decay to min_lr at max_steps, then min_lr."""
    # --8<-- [start:exercise-9]
    if step < warmup_steps:
        # Adam's moment estimates are noise for the first steps; small steps meanwhile avoid
        # an early blow-up. (step + 1): step 0 already moves (lr / warmup_steps).
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0, flat at both ends
    return min_lr + coeff * (lr - min_lr)
    # --8<-- [end:exercise-9]
# --8<-- [end:lr-schedule]
