"""Check of exercise 14: FSDPTrainer._get_fsdp_policy (snippets/training/fsdp_trainer.py)."""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

import torch
import torch.nn as nn

from snippets.exercises import predictions
from snippets.exercises.checks._fsdp_trainer import _fsdp_trainer, _fsdp_trainer_class
from snippets.exercises.checks._tensors import _max_diff
from snippets.exercises.checks._trainer import _ref_trainer
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


@contextlib.contextmanager
def _process_group_of_one():
    """FSDP2 needs a process group even for one process: an in-memory one, removed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _whole_at_peak(model: nn.Module) -> int:
    """The largest share (%) of the parameters held whole (gathered, not a DTensor shard) when
    any module starts its forward: FSDP's peak parameter memory, measured in one forward."""
    from torch.distributed.tensor import DTensor

    total, seen = sum(p.numel() for p in model.parameters()), [0]

    def record(module, args):  # FSDP swaps a unit's gathered parameters in, then out
        whole = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        seen[0] = max(seen[0], round(100 * whole / total))

    handles = [m.register_forward_pre_hook(record) for m in model.modules()]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return seen[0]


def check_fsdp_policy(learner: ModuleType) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    predicted = predictions.require(14, learner)  # before anything measured is shown
    cls = _fsdp_trainer_class(learner, "_get_fsdp_policy")
    quiet = type("Plain", (_ref_trainer().DistributedTrainer,), {"log": lambda self, m: None})
    fresh = ref.GPT(ref.get_config("tiny"))
    order = cls._get_fsdp_policy(cls.__new__(cls), fresh)
    if not isinstance(order, (list, tuple)) or not all(isinstance(m, nn.Module) for m in order):
        raise CheckFailed(f"_get_fsdp_policy returned {order!r:.80}; return a list of modules, "
                          "each of which becomes an FSDP unit")
    if fresh in order and any(isinstance(m, ref.Block) for m in order[order.index(fresh):]):
        raise CheckFailed(
            "the model comes first in your list, before blocks: fully_shard(model) claims "
            "every parameter not yet in a unit, the blocks' included, so applied first it "
            "leaves the blocks nothing (and FSDP fails or trains the blocks as one piece). "
            "Apply it bottom-up: the blocks first, the model itself last")
    with _process_group_of_one():
        try:
            trainer = _fsdp_trainer(cls, learner)
        except (TypeError, AssertionError, RuntimeError, ValueError) as err:
            raise CheckFailed(f"applying fully_shard to your units raised "
                              f"{type(err).__name__}: {str(err)[:160]}") from None
        model = trainer.model
        units = [name or "the model" for name, m in model.named_modules()
                 if isinstance(m, FSDPModule)]
        # With N ranks each unit is one all-gather in forward (and again in backward, but for
        # the root).
        n, s = len(units), "s" if len(units) > 1 else ""
        gathers = f"{n} unit{s}, so {n} all-gather{s} per forward on N ranks"
        blocks = [f"layers.{i}" for i in range(len(model.layers))]
        extra = [u for u in units if u not in blocks and u != "the model"]
        if extra:
            raise CheckFailed(
                f"you made {gathers} ({', '.join(extra[:3])}, ...). Units smaller than a block "
                "mean one all-gather and one reduce-scatter per unit and step, each a small "
                "message paying the collective's start-up cost. One unit per Block, then the "
                "model")
        # The share of the parameters whole at once, measured, is their peak memory.
        measured = (f"{gathers}; measured in one forward: at most {_whole_at_peak(model)}% of "
                    "the parameters whole at once")
        if not isinstance(model, FSDPModule):
            raise CheckFailed(
                f"your FSDP units are {units}, without the model itself: embed_tokens (tied to "
                "lm_head) and the final norm stay ordinary tensors, a full copy on every rank, "
                "and nothing averages their gradients over the ranks, so the replicas drift "
                "apart. End the list with the model: fully_shard(model) takes what the blocks "
                "did not")
        if not all(b in units for b in blocks):
            raise CheckFailed(
                f"your FSDP units are {units}; {measured}. With no unit per Block, what a "
                "block holds is all-gathered at once with the model when forward starts, so "
                "every rank holds it all at the peak (FSDP saves nothing there) and no "
                "gathering overlaps computation. Put each transformer Block in the list, then "
                "the model")
        passed = [f"units: {', '.join(blocks)} and the model itself, applied bottom-up; "
                  f"{measured}"]
        if predicted is not None:  # the other layout the learner predicted: the model alone
            alone = _fsdp_trainer(_fsdp_trainer_class(
                learner, "_get_fsdp_policy", _get_fsdp_policy=lambda self, m: [m]), learner)
            graded = predictions.grade(14, predicted, {
                "model_alone": {"all_gathers_per_forward": sum(
                    isinstance(m, FSDPModule) for m in alone.model.modules()),
                    "peak_percent_whole": _whole_at_peak(alone.model)},
                "blocks_then_model": {"all_gathers_per_forward": n,
                                      "peak_percent_whole": _whole_at_peak(model)}})
            passed += graded

        solution = _ref_trainer()
        reference = quiet(ref.get_config("tiny", max_position_embeddings=16),
                          solution.TrainConfig(batch_size=4, seq_len=16, max_steps=20,
                                               warmup_steps=3, lr=1e-3, data="dummy"))
        batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
        ours, theirs = trainer.train_step(iter([batch])), reference.train_step(iter([batch]))
        plain = dict(reference.raw_model.named_parameters())
        for name, p in model.named_parameters():
            # A process group of one: FSDP's gather and average are copies, so one step
            # matches plain training up to the order of additions (~1e-7).
            if not torch.allclose(p.full_tensor(), plain[name], rtol=0, atol=1e-6):
                raise CheckFailed(f"after one step {name} differs from plain training by "
                                  f"{_max_diff(p.full_tensor(), plain[name]):.3g}")
        if not math.isclose(ours["loss"], theirs["loss"], rel_tol=1e-6):
            raise CheckFailed(f"the sharded model's loss {ours['loss']:.5f} differs from the "
                              f"plain model's {theirs['loss']:.5f}")
    passed.append("one training step of the sharded model equals one step of the plain model")
    return passed
