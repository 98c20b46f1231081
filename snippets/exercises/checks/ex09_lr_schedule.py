"""Check of exercise 9: lr_at (snippets/training/optim.py)."""

from __future__ import annotations

import math
from types import ModuleType

from snippets.exercises.runner import CheckFailed
from snippets.training import optim as solution


def check_lr_at(learner: ModuleType) -> list[str]:
    lr, min_lr, warmup, max_steps = 1e-3, 1e-4, 10, 110
    for step in range(0, 2 * max_steps):
        got = learner.lr_at(step, lr, min_lr, warmup, max_steps)
        want = solution.lr_at(step, lr, min_lr, warmup, max_steps)
        if not isinstance(got, (int, float)):
            raise CheckFailed(f"lr_at({step}, ...) returned {type(got).__name__}; return a float")
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15):
            continue
        at = f"lr_at({step}, ...) = {got:.7g}, expected {want:.7g} (lr={lr}, min_lr={min_lr}, " \
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

    try:
        first = learner.lr_at(0, 3e-3, 3e-4, 0, 50)
    except ZeroDivisionError:
        raise CheckFailed("with warmup_steps=0 your lr_at divides by zero: no warmup means the "
                          "schedule starts at the peak, lr_at(0, ...) = lr") from None
    if not math.isclose(first, 3e-3, rel_tol=1e-9):
        raise CheckFailed(f"with warmup_steps=0 and lr=3e-3, lr_at(0, ...) = {first:.4g}: "
                          "without warmup the schedule starts at the peak lr")
    passed.append("warmup_steps=0 starts at the peak; every setting comes from the arguments")
    return passed
