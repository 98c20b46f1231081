"""Check of exercise 9: DistributedTrainer.get_lr (snippets/training/ddp_trainer.py)."""

from __future__ import annotations

import math
from types import ModuleType

from snippets.exercises.checks._trainer import _ref_trainer, _trainer_class
from snippets.exercises.runner import CheckFailed


def check_get_lr(learner: ModuleType) -> list[str]:
    cls = _trainer_class(learner, "get_lr")
    solution = _ref_trainer()

    def schedule(**settings):
        # get_lr reads only self.train_config: no model or optimizer is needed for it.
        trainer, expected = cls.__new__(cls), solution.DistributedTrainer.__new__(
            solution.DistributedTrainer)
        trainer.train_config = learner.TrainConfig(**settings)
        expected.train_config = solution.TrainConfig(**settings)
        return trainer, expected

    settings = dict(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    trainer, expected = schedule(**settings)
    lr, min_lr, warmup, max_steps = 1e-3, 1e-4, 10, 110
    for step in range(0, 2 * max_steps):
        got, want = trainer.get_lr(step), expected.get_lr(step)
        if not isinstance(got, (int, float)):
            raise CheckFailed(f"get_lr({step}) returned {type(got).__name__}; return a float")
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
            continue
        at = f"get_lr({step}) = {got:.7g}, expected {want:.7g} (lr={lr}, min_lr={min_lr}, " \
             f"warmup_steps={warmup}, max_steps={max_steps})"
        if step < warmup:
            if math.isclose(got, lr * step / warmup, rel_tol=1e-9, abs_tol=1e-15):
                why = ("your warmup is one step late: step 0 is the first update and should "
                       "already move, so the rate is lr * (step + 1) / warmup_steps, reaching the "
                       "peak at step warmup_steps - 1")
            else:
                why = "warmup grows linearly: lr * (step + 1) / warmup_steps"
        elif step >= max_steps:
            why = ("after max_steps the rate stays at min_lr (the cosine would climb back up if "
                   "it kept going)")
        else:
            progress = (step - warmup) / (max_steps - warmup)
            if math.isclose(got, 0.5 * (1 + math.cos(math.pi * progress)) * lr, rel_tol=1e-6):
                why = "you decay to 0; the cosine ends at min_lr: min_lr + coeff * (lr - min_lr)"
            elif math.isclose(got, lr - progress * (lr - min_lr), rel_tol=1e-6):
                why = ("that is a linear decay; use the cosine: coeff = 0.5 * (1 + cos(pi * "
                       "progress)), flat at both ends")
            else:
                why = ("after warmup, progress = (step - warmup_steps) / (max_steps - "
                       "warmup_steps) goes from 0 to 1, and the rate is min_lr + 0.5 * (1 + "
                       "cos(pi * progress)) * (lr - min_lr)")
        raise CheckFailed(f"{at}: {why}")
    passed = ["linear warmup, then cosine from lr to min_lr, then min_lr, at every step 0-219"]

    trainer, _ = schedule(lr=3e-3, warmup_steps=0, max_steps=50)
    try:
        first = trainer.get_lr(0)
    except ZeroDivisionError:
        raise CheckFailed("with warmup_steps=0 your get_lr divides by zero: no warmup means the "
                          "schedule starts at the peak, get_lr(0) = lr") from None
    if not math.isclose(first, 3e-3, rel_tol=1e-9):
        raise CheckFailed(f"with warmup_steps=0 and lr=3e-3, get_lr(0) = {first:.4g}: without "
                          "warmup the schedule starts at the peak lr")
    passed.append("warmup_steps=0 starts at the peak; settings come from train_config")
    return passed
