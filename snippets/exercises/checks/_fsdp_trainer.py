"""The FSDP trainer the checks of exercises 12-15 run: the solution's, with the learner's method in
it.

As in phase 2, each check runs the learner's method inside the solution's trainer. Exercises 12
and 13 measure what the learner's answer makes FSDP2 do on two processes; 14 runs FSDP2 for real
in a process group of one; 15 gathers shards, so it runs on two processes. 12-14 ask for the
learner's predictions of what they measure first, and grade them (predictions.py).
"""

from __future__ import annotations

from types import ModuleType

from snippets.models import gpt as ref


FSDP_EXERCISE_METHODS = ("_get_sharding_strategy", "_get_mixed_precision_policy",
                         "_get_fsdp_policy", "save_checkpoint")


def _fsdp_trainer_class(learner: ModuleType, *mine: str, **overrides) -> type:
    """The learner's FSDPTrainer, their methods `mine`, the solution's for the others."""
    from snippets.training import fsdp_trainer

    solution = fsdp_trainer.FSDPTrainer
    namespace = {name: getattr(solution, name) for name in FSDP_EXERCISE_METHODS
                 if name not in mine}
    namespace["log"] = lambda self, message: None
    namespace.update(overrides)
    return type("CheckedFSDPTrainer", (learner.FSDPTrainer,), namespace)


def _fsdp_trainer(cls: type, module: ModuleType, world_size: int = 1, **fsdp):
    train = module.TrainConfig(batch_size=4 // world_size, seq_len=16, max_steps=20,
                               warmup_steps=3, lr=1e-3, data="dummy")
    return cls(ref.get_config("tiny", max_position_embeddings=16), train,
               module.FSDPConfig(**fsdp), "cpu")
