"""Check of exercise 10: DistributedTrainer.train_step (snippets/training/ddp_trainer.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch

from snippets.exercises.checks._tensors import _max_diff
from snippets.exercises.checks._trainer import _Wrapper, _ref_trainer, _trainer, _trainer_class
from snippets.exercises.runner import CheckFailed


def check_train_step(learner: ModuleType) -> list[str]:
    solution = _ref_trainer()
    cls = _trainer_class(learner, "train_step", "forward_backward", "clip_gradients",
                         wrapper=_Wrapper)
    batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    passed = []

    trainer = _trainer(cls, learner, batch_size=4, grad_accum_steps=2)
    quiet = type("Reference", (solution.DistributedTrainer,), {"log": lambda self, m: None})
    reference = _trainer(quiet, solution, batch_size=8)
    syncs = []
    original_sync = trainer._grad_sync

    def recording_sync(last_micro_step):
        syncs.append(last_micro_step)
        return original_sync(last_micro_step)

    trainer._grad_sync = recording_sync
    drawn = []

    def micro_batches(*batches):
        for b in batches:
            drawn.append(b)
            yield b

    try:
        stats = trainer.train_step(micro_batches(batch[:4], batch[4:]))
    except RuntimeError as err:
        if "StopIteration" in str(err) or isinstance(err.__cause__, StopIteration):
            raise CheckFailed("train_step asked batch_iter for more than grad_accum_steps=2 "
                              "micro-batches: draw exactly one per micro-step") from None
        raise
    except StopIteration:
        raise CheckFailed("train_step asked batch_iter for more than grad_accum_steps=2 "
                          "micro-batches: draw exactly one per micro-step") from None
    expected = reference.train_step(iter([batch]))

    if not isinstance(stats, dict) or not {"loss", "grad_norm", "lr", "tokens"} <= set(stats):
        raise CheckFailed("train_step must return a dict with loss, grad_norm, lr and tokens "
                          f"(the training loop logs them); got {stats!r:.80}")
    if len(drawn) != 2:
        raise CheckFailed(f"with grad_accum_steps=2 train_step drew {len(drawn)} micro-batches: "
                          "run forward and backward on one batch per micro-step, "
                          "grad_accum_steps of them per optimizer step")
    if trainer.model.forwards == 0:
        raise CheckFailed("the forward pass did not go through self.model: under DDP that is "
                          "the wrapper whose backward averages the gradients across processes; "
                          "self.raw_model would skip it")
    if syncs != [False, True]:
        raise CheckFailed(
            f"self._grad_sync was entered with last_micro_step={syncs}, expected [False, True]: "
            "run each micro-batch's forward and backward inside "
            "`with self._grad_sync(last_micro_step=micro_step == accum - 1):`, so that under DDP "
            "only the last backward all-reduces the gradients")
    passed.append("two micro-batches, through self.model, gradients synchronised on the last")

    if trainer.step != 1:
        raise CheckFailed(f"after one train_step self.step is {trainer.step}, expected 1: "
                          "count the optimizer steps (get_lr and checkpoints read self.step)")
    if stats["lr"] != reference.get_lr(0) or any(
            g["lr"] != reference.get_lr(0) for g in trainer.optimizer.param_groups):
        raise CheckFailed(
            f"at step 0 the optimizer's lr is {trainer.optimizer.param_groups[0]['lr']:.4g} "
            f"(reported {stats['lr']:.4g}), expected get_lr(0) = {reference.get_lr(0):.4g}: "
            "before optimizer.step(), set group['lr'] = self.get_lr(self.step) for every group "
            "in self.optimizer.param_groups")
    passed.append("the scheduled lr is set on every parameter group; self.step counts steps")

    for clip, expect in ((0.01, "0.01"), (0.0, "the unclipped norm")):
        clipped = _trainer(cls, learner, grad_clip=clip)
        seen = []
        step = clipped.optimizer.step

        def recording_step(*args, _step=step, _opt=clipped.optimizer, **kwargs):
            grads = [p.grad.norm() for g in _opt.param_groups for p in g["params"]
                     if p.grad is not None]
            seen.append(torch.stack(grads).norm().item() if grads else 0.0)
            return _step(*args, **kwargs)

        clipped.optimizer.step = recording_step
        out = clipped.train_step(iter([batch[:4]]))
        target = clip if clip else out["grad_norm"]
        if not seen or not math.isclose(seen[0], target, rel_tol=1e-3):
            if clip:
                why = ("clip after the last backward and before optimizer.step(): "
                       "torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)")
            else:
                why = ("grad_clip=0 turns clipping off (see TrainConfig); clip_grad_norm_ with "
                       "max_norm 0 would zero every gradient: pass math.inf instead")
            raise CheckFailed(f"with grad_clip={clip} the optimizer saw gradients of norm "
                              f"{f'{seen[0]:.4f}' if seen else 'none'} (expected {expect}): "
                              f"{why}")
    passed.append("gradients clipped to grad_clip before the step; grad_clip=0 means no clipping")

    if not math.isclose(stats["grad_norm"], expected["grad_norm"], rel_tol=1e-4):
        ratio = stats["grad_norm"] / expected["grad_norm"]
        why = ("compute it with clip_grad_norm_ after the LAST backward, before the step: it "
               "returns the norm before clipping")
        if math.isclose(ratio, 2.0, rel_tol=1e-3):
            why = ("that is grad_accum_steps times too large: backward() ADDS into .grad, so "
                   "divide each micro-batch's loss by grad_accum_steps before backward(); the "
                   "summed gradients are then the mean over the whole batch")
        raise CheckFailed(f"your gradient norm is {stats['grad_norm']:.4f} ({ratio:.2f}x) where "
                          f"one batch of 8 gives {expected['grad_norm']:.4f}: {why}")
    if not math.isclose(stats["loss"], expected["loss"], rel_tol=1e-5):
        raise CheckFailed(f"your reported loss is {stats['loss']:.4f}, expected "
                          f"{expected['loss']:.4f}: report the mean of the micro-batches' "
                          "(unscaled) losses")
    if stats["tokens"] != 8 * 16:
        raise CheckFailed(f"tokens = {stats['tokens']}, expected 2 micro-batches x 4 sequences x "
                          "16 targets = 128 (times world_size): count the targets trained on")
    for (name, p), q in zip(trainer.raw_model.named_parameters(),
                            reference.raw_model.parameters()):
        # Not bit-identical: two half-batch gradients are summed in a different order than
        # one backward over 8 sequences (~1e-6 here); a real mistake moves weights by ~lr = 1e-3.
        if not torch.allclose(p, q, rtol=0, atol=1e-5):
            raise CheckFailed(f"after one step {name} differs from one step on the whole batch "
                              f"by {_max_diff(p, q):.3g}: accumulate, clip, optimizer.step()")
    passed.append("2 x 4 sequences accumulated = one step on 8: same loss, gradient norm, weights")

    second = trainer.train_step(micro_batches(batch[4:], batch[:4]))
    reference.train_step(iter([batch]))
    for (name, p), q in zip(trainer.raw_model.named_parameters(),
                            reference.raw_model.parameters()):
        if not torch.allclose(p, q, rtol=0, atol=1e-5):
            raise CheckFailed(
                f"the second step differs ({name} by {_max_diff(p, q):.3g}) though the first "
                "matched: the first step's gradients were still in .grad; clear them after the "
                "step with self.optimizer.zero_grad(set_to_none=True)")
    if second["lr"] != reference.get_lr(1):
        raise CheckFailed(f"the second step used lr {second['lr']:.4g}, expected get_lr(1) = "
                          f"{reference.get_lr(1):.4g}: read the lr for self.step each call")
    passed.append("a second step starts from clean gradients and the next lr")

    return passed
