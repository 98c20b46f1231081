"""Check of exercise 11: DistributedTrainer.save_checkpoint and load_checkpoint
(snippets/training/ddp_trainer.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.checks._trainer import _Wrapper, _trainer, _trainer_class
from snippets.exercises.runner import CheckFailed


def check_checkpoint(learner: ModuleType) -> list[str]:
    import tempfile
    from pathlib import Path

    cls = _trainer_class(learner, "save_checkpoint", "load_checkpoint", wrapper=_Wrapper)
    passed = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt.pt"
        first = _trainer(cls, learner)
        batches = first.micro_batches()
        for _ in range(3):
            first.train_step(batches)
        first.save_checkpoint(path)
        if not path.is_file():
            raise CheckFailed(f"save_checkpoint({path}) wrote no file there")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the learner may have saved anything
            raise CheckFailed(
                "torch.load(path, weights_only=True) refuses your checkpoint "
                f"({str(err).splitlines()[0][:120]}): save only tensors, numbers, strings and "
                "plain dicts/lists (config.to_dict(), asdict(train_config)), never objects; "
                "weights_only loading exists because unpickling objects can run any code"
            ) from None
        if not isinstance(state, dict):
            raise CheckFailed("save a dict: {'model': ..., 'optimizer': ..., 'step': ...}")
        model_state = next((v for v in state.values() if isinstance(v, dict) and v
                            and all(isinstance(t, torch.Tensor) for t in v.values())
                            and any("embed_tokens" in k for k in v)), None)
        if model_state is None:
            raise CheckFailed("your checkpoint holds no model state_dict: save "
                              "unwrap_model(self.model).state_dict()")
        if any(k.startswith("module.") for k in model_state):
            raise CheckFailed(
                "the saved model keys start with 'module.' (e.g. "
                f"{next(iter(model_state))}): that is the DDP wrapper's state_dict, which only "
                "another wrapped model can load; save unwrap_model(self.model).state_dict()")
        passed.append("loads with weights_only=True; model keys without the DDP 'module.' prefix")

        after_save = [first.train_step(batches)["loss"] for _ in range(3)]

        for wrapped in (True, False):
            second = _trainer(cls if wrapped else _trainer_class(
                learner, "save_checkpoint", "load_checkpoint"), learner)
            fresh = {n: p.detach().clone() for n, p in second.raw_model.named_parameters()}
            loaded = second.load_checkpoint(path)
            if second.step != 3:
                raise CheckFailed(f"after load_checkpoint self.step is {second.step}, expected "
                                  "3: restore the step, or the lr schedule restarts from warmup")
            saved = {k: v for k, v in model_state.items()}
            for n, p in second.raw_model.named_parameters():
                if not torch.equal(p, saved[n]):
                    raise CheckFailed(f"after load_checkpoint {n} does not hold the saved weights"
                                      + (" (it still holds the fresh init)"
                                         if torch.equal(p, fresh[n]) else "")
                                      + ": unwrap_model(self.model).load_state_dict(...)")
            if not second.optimizer.state_dict()["state"]:
                raise CheckFailed("after load_checkpoint the optimizer has no state: save and "
                                  "load self.optimizer.state_dict(), AdamW's moment estimates, or "
                                  "the resumed run takes different steps")
            second_sampler = second.sampler.state_dict()
            resumed = [second.train_step(second.micro_batches())["loss"] for _ in range(3)]
            if resumed != after_save:
                why = ("weights, optimizer and step are back, yet the losses differ: restore "
                       "everything a step depends on (RNG states too)")
                if second_sampler["batches_drawn"] != 3:
                    why = ("the resumed run reads different batches: restore the data position "
                           "too, save self.sampler.state_dict() and load it back with "
                           "self.sampler.load_state_dict(...)")
                raise CheckFailed(f"the resumed run's losses {[round(x, 5) for x in resumed]} "
                                  f"differ from the unbroken run's "
                                  f"{[round(x, 5) for x in after_save]}: {why}")
            if not (isinstance(loaded, dict) and "train_config" in loaded):
                raise CheckFailed("load_checkpoint must return the loaded state, with its "
                                  "train_config: main() compares it with the current settings")
        passed.append("a resumed run continues exactly like the unbroken one "
                      "(into a wrapped and a bare model)")
    return passed
