"""Checks of exercises 8-11, the training loop (snippets/training/ddp_trainer.py), as in
checks_model.py: the learner's method runs, and the usual wrong answers are computed and named.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn as nn

from snippets.exercises.checks_model import _max_diff
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


# ---------------------------------------------------------------- phase 2: the trainer
#
# Each check judges one method: the learner's trainer class is subclassed with the solution's
# version of every other exercise method, so a wrong get_lr cannot fail the train_step check.

TRAINER_EXERCISE_METHODS = ("_setup_optimizer", "get_lr", "train_step", "forward_backward",
                            "clip_gradients", "save_checkpoint", "load_checkpoint")


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


# ---------------------------------------------------------------- exercise 8: param groups


def check_setup_optimizer(learner: ModuleType) -> list[str]:
    cls = _trainer_class(learner, "_setup_optimizer")
    try:
        trainer = _trainer(cls, learner, weight_decay=0.05)
    except ValueError as err:
        if "more than one parameter group" in str(err):
            raise CheckFailed(
                "a parameter is in both groups (AdamW refuses that): the tied embed_tokens / "
                "lm_head matrix is ONE Parameter under two names; named_parameters() yields it "
                "once, so put each parameter it yields in exactly one group") from None
        raise
    optimizer = trainer.optimizer
    if not isinstance(optimizer, torch.optim.AdamW):
        why = ("torch.optim.Adam's weight_decay is added to the gradient and then rescaled by "
               "Adam's per-parameter step size, so the decay is uneven; AdamW shrinks the "
               "weights directly" if isinstance(optimizer, torch.optim.Adam) else "")
        raise CheckFailed(f"_setup_optimizer returned {type(optimizer).__name__}; return a "
                          f"torch.optim.AdamW{': ' + why if why else ''}")
    passed = ["returns torch.optim.AdamW"]

    model = trainer.raw_model
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
                raise CheckFailed(f"{name} has weight_decay 0.1 with TrainConfig("
                                  "weight_decay=0.05): read it from "
                                  "self.train_config.weight_decay instead of writing a number")
            raise CheckFailed(f"{name} (a matrix, {tuple(p.shape)}) has weight_decay {wd}, "
                              "expected train_config.weight_decay = 0.05: the matrices hold the "
                              "model's capacity, and weight decay is what keeps them small")
        if p.dim() < 2 and wd != 0.0:
            raise CheckFailed(
                f"{name} (1-D: an RMSNorm gain) has weight_decay {wd}, expected 0.0: decay pulls "
                "the gains toward 0 and fights the normalisation; put parameters with "
                "p.dim() < 2 in a group with weight_decay=0.0")
    passed.append("weight decay on matrices only (norm gains and biases: 0.0)")

    model.norm.weight.requires_grad_(False)
    frozen = trainer._setup_optimizer()
    if any(p is model.norm.weight for g in frozen.param_groups for p in g["params"]):
        raise CheckFailed("a frozen parameter (requires_grad=False) is in the optimizer: skip "
                          "parameters that do not train")
    passed.append("frozen parameters are left out")
    return passed


# ---------------------------------------------------------------- exercise 9: lr schedule


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


# ---------------------------------------------------------------- exercise 10: train_step


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


# ---------------------------------------------------------------- exercise 11: checkpoints


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
