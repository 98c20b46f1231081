"""The trainer the checks of exercises 10 and 11 (and 14) run: the solution's, with the learner's
method in it.

Each check judges one method: the learner's trainer class is subclassed with the solution's
version of every other exercise method, so a wrong save_checkpoint cannot fail the train_step
check. (Exercises 8 and 9 are functions of optim.py, checked on their own; the trainer calls
the course's copy of them.)
"""

from __future__ import annotations

from types import ModuleType

import torch.nn as nn

from snippets.models import gpt as ref


TRAINER_EXERCISE_METHODS = ("train_step", "forward_backward", "clip_gradients", "save_checkpoint",
                            "load_checkpoint")


def _ref_trainer() -> ModuleType:
    from snippets.training import ddp_trainer

    return ddp_trainer


def _trainer_class(learner: ModuleType, *mine: str, wrapper: type | None = None) -> type:
    """The learner's DistributedTrainer, their methods `mine`, the solution's for the others."""
    solution = _ref_trainer().DistributedTrainer
    namespace = {name: getattr(solution, name) for name in TRAINER_EXERCISE_METHODS
                 if name not in mine}
    namespace["log"] = lambda self, message: None  # the trainer's own progress lines
    if wrapper is not None:
        namespace["_wrap_model"] = lambda self, model: wrapper(model)
    return type("CheckedTrainer", (learner.DistributedTrainer,), namespace)


def _trainer(cls: type, module: ModuleType, **settings):
    train = dict(batch_size=4, seq_len=16, max_steps=20, warmup_steps=3, lr=1e-3,
                 data="dummy")
    train.update(settings)
    model_config = ref.get_config("tiny", max_position_embeddings=16)
    return cls(model_config, module.TrainConfig(**train), "cpu")


class _Wrapper(nn.Module):
    """Stands in for DistributedDataParallel: the real model is .module; counts forwards."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        self.forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return self.module(*args, **kwargs)
