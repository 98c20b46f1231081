"""Check of exercise 8: build_optimizer (snippets/training/optim.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def _optimizer(learner: ModuleType, model: torch.nn.Module, weight_decay: float):
    """The learner's build_optimizer(model, lr, weight_decay), AdamW's refusals explained."""
    try:
        return learner.build_optimizer(model, 1e-3, weight_decay)
    except ValueError as err:
        if "more than one parameter group" in str(err):
            raise CheckFailed(
                "a parameter is in both groups (AdamW refuses that): the tied embed_tokens / "
                "lm_head matrix is ONE Parameter under two names; named_parameters() yields it "
                "once, so put each parameter it yields in exactly one group") from None
        raise


def check_build_optimizer(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    model = ref.GPT(ref.get_config("tiny", max_position_embeddings=16))
    optimizer = _optimizer(learner, model, weight_decay=0.05)
    if not isinstance(optimizer, torch.optim.AdamW):
        why = ("torch.optim.Adam's weight_decay is added to the gradient and then rescaled by "
               "Adam's per-parameter step size, so the decay is uneven; AdamW shrinks the "
               "weights directly" if isinstance(optimizer, torch.optim.Adam) else "")
        raise CheckFailed(f"build_optimizer returned {type(optimizer).__name__}; return a "
                          f"torch.optim.AdamW{': ' + why if why else ''}")
    passed = ["returns torch.optim.AdamW"]

    names = {id(p): n for n, p in model.named_parameters()}
    decay_of: dict[int, list[float]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            decay_of.setdefault(id(p), []).append(group["weight_decay"])
    twice = [n for i, n in names.items() if len(decay_of.get(i, [])) > 1]
    if twice:
        raise CheckFailed(f"{twice[0]} is listed twice in the optimizer: the tied embed_tokens / "
                          "lm_head matrix is ONE Parameter under two names; iterate over "
                          "named_parameters() (it yields each Parameter once), not "
                          "named_parameters(remove_duplicate=False)")
    missing = [n for i, n in names.items() if i not in decay_of]
    if missing:
        raise CheckFailed(f"{len(missing)} parameters are in no group ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): every trainable parameter "
                          "must be in one of the two groups, or it never trains")
    passed.append("every parameter in exactly one group (the tied matrix once)")

    for name, p in model.named_parameters():
        wd = decay_of[id(p)][0]
        if p.dim() >= 2 and wd != 0.05:
            if wd == 0.1:
                raise CheckFailed(f"{name} has weight_decay 0.1 with build_optimizer(model, lr, "
                                  "weight_decay=0.05): use the weight_decay argument instead "
                                  "of writing a number")
            raise CheckFailed(f"{name} (a matrix, {tuple(p.shape)}) has weight_decay {wd}, "
                              "expected the weight_decay argument, 0.05: the matrices hold the "
                              "model's capacity, and weight decay is what keeps them small")
        if p.dim() < 2 and wd != 0.0:
            raise CheckFailed(
                f"{name} (1-D: an RMSNorm gain) has weight_decay {wd}, expected 0.0: decay pulls "
                "the gains toward 0 and fights the normalisation; put parameters with "
                "p.dim() < 2 in a group with weight_decay=0.0")
    passed.append("weight decay on matrices only (norm gains and biases: 0.0)")

    model.norm.weight.requires_grad_(False)
    frozen = _optimizer(learner, model, weight_decay=0.05)
    if any(p is model.norm.weight for g in frozen.param_groups for p in g["params"]):
        raise CheckFailed("a frozen parameter (requires_grad=False) is in the optimizer: skip "
                          "parameters that do not train")
    passed.append("frozen parameters are left out")
    return passed
