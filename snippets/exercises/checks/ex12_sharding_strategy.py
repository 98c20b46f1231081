"""Check of exercise 12: FSDPTrainer._get_sharding_strategy (snippets/training/fsdp_trainer.py)."""

from __future__ import annotations

from types import ModuleType

from snippets.exercises import predictions
from snippets.exercises.checks._fsdp_trainer import _fsdp_trainer, _fsdp_trainer_class
from snippets.exercises.gang import run_learner
from snippets.exercises.runner import CheckFailed


# Judged by what each strategy does, measured: the learner's mapping runs one forward and
# backward on 2 gloo processes for each strategy, and the check measures the share of the
# parameters each rank stores, the share it holds between forward and backward, and the
# all-gathers over the 2 ranks in forward and in backward. Each strategy is recognised by its measurement (the behaviour
# MEANING describes), so a mapping that behaves as another strategy is named as that one.
# HYBRID_SHARD needs more ranks: its mesh is judged without processes, on 8 ranks in groups of 4.

MEASURED_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
STRATEGY_WORLD = 2
MEANING = {
    "FULL_SHARD": "ZeRO-3: each rank stores 1/N of the parameters, and the ones gathered for "
                  "a block's forward are freed after it and all-gathered again for its backward",
    "SHARD_GRAD_OP": "ZeRO-2: stored sharded as in FULL_SHARD, but the gathered parameters are "
                     "kept from forward to backward (reshard_after_forward=False): no second "
                     "all-gather, and the whole model is held at the peak",
    "NO_SHARD": "DDP: every rank stores every parameter, a (world, 1) mesh of replicas; "
                "nothing is all-gathered, the gradients are all-reduced",
}


def _measure_step(trainer) -> dict:
    """One forward and backward of trainer's sharded model, measured on this rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from snippets.models.gpt import shift_for_next_token

    def local_numel() -> int:
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                   for p in trainer.model.parameters())

    gathers, original = [], dist.all_gather_single

    def counting(output, input, group=None, async_op=False):
        if dist.get_world_size(group) > 1:  # a mesh dimension of one rank moves nothing
            gathers.append(output.numel())
        return original(output, input, group=group, async_op=async_op)

    total = sum(p.numel() for p in trainer.model.parameters())
    stored = local_numel()
    inputs, targets = shift_for_next_token(next(trainer.micro_batches()))
    dist.all_gather_single = counting
    try:
        _, loss = trainer.model(inputs, targets)
        forward, held = len(gathers), local_numel()
        loss.backward()
    finally:
        dist.all_gather_single = original
    return {"stored": round(100 * stored / total), "held": round(100 * held / total),
            "forward": forward, "backward": len(gathers) - forward}


def _strategy_worker(learner, rank: int, world: int) -> dict:
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    cls = _fsdp_trainer_class(learner, "_get_sharding_strategy")
    return {name: _measure_step(_fsdp_trainer(cls, learner, world, sharding_strategy=name))
            for name in MEASURED_STRATEGIES}


def _behaves_as(m: dict) -> str | None:
    """The strategy whose behaviour (MEANING) a measurement shows."""
    if m["stored"] == 100 and m["forward"] == m["backward"] == 0:
        return "NO_SHARD"
    if m["stored"] < 100 and m["held"] < 100 and m["forward"] and m["backward"]:
        return "FULL_SHARD"
    if m["stored"] < 100 and m["held"] == 100 and m["forward"] and not m["backward"]:
        return "SHARD_GRAD_OP"
    return None


def _measured(m: dict) -> str:
    return (f"each rank stores {m['stored']}% of the parameters and holds {m['held']}% of "
            f"them between forward and backward; {m['forward']} all-gathers in forward, "
            f"{m['backward']} in backward")


def _judge_hybrid(learner: ModuleType) -> None:
    """HYBRID_SHARD on 8 ranks in groups of 4, and the returned dict's shape for every
    strategy, from the mesh the learner asks for (recorded, not built)."""
    cls = _fsdp_trainer_class(learner, "_get_sharding_strategy",
                              _device_mesh=lambda self, replicas, shards: (replicas, shards))
    world, group = 8, 4
    for name in (*MEASURED_STRATEGIES, "HYBRID_SHARD"):
        trainer = cls.__new__(cls)
        trainer.world_size = world
        trainer.fsdp_config = learner.FSDPConfig(sharding_strategy=name, shard_group_size=group)
        try:
            got = trainer._get_sharding_strategy()
        except (RuntimeError, ValueError) as err:
            if "process group" in str(err) or "init_process_group" in str(err):
                raise CheckFailed(f"for {name} your code built a device mesh itself "
                                  f"({str(err).splitlines()[0][:80]}): return "
                                  "self._device_mesh(replicas, shards), which builds it for "
                                  "the trainer's device") from None
            raise
        if not isinstance(got, dict) or set(got) != {"mesh", "reshard_after_forward"}:
            raise CheckFailed(f"for {name} _get_sharding_strategy returned {got!r:.80}; return "
                              "a dict with two keys, 'mesh' and 'reshard_after_forward' "
                              "(fully_shard's keyword arguments)")
    where = f"with world_size={world}, shard_group_size={group}, HYBRID_SHARD"
    asked = f"{where} asked for a mesh of (replicas, shards) = {got['mesh']}, expected (2, 4)"
    if got["mesh"] == (4, 2):
        raise CheckFailed(f"{asked}: you swapped the two sizes: the mesh is (replicas, shards), "
                          "and a group of shard_group_size=4 ranks (a node) shards one copy. "
                          "Sharding across nodes instead would send every all-gather over the "
                          "slow network")
    if got["mesh"] == (1, 8):
        raise CheckFailed(f"{asked}: that is FULL_SHARD over all 8 ranks; HYBRID_SHARD shards "
                          "within groups of self.shard_group_size and replicates across them")
    if got["mesh"] != (2, 4) or got["reshard_after_forward"] is not True:
        raise CheckFailed(f"{where} gave {got}: expected a (2, 4) mesh (2 groups of "
                          "shard_group_size=4 ranks, each sharding one copy, the groups "
                          "replicas) and reshard_after_forward=True, FULL_SHARD inside a group")


def check_sharding_strategy(learner: ModuleType) -> list[str]:
    predicted = predictions.require(12, learner)  # before anything measured is shown
    _judge_hybrid(learner)
    measured = run_learner(learner, _strategy_worker, STRATEGY_WORLD)[0]  # the ranks agree
    for name in MEASURED_STRATEGIES:
        got = measured[name]
        seen = _behaves_as(got)
        if seen == name:
            continue
        message = (f"{name}, measured on {STRATEGY_WORLD} ranks: {_measured(got)}. Expected "
                   f"{name}: {MEANING[name]}")
        if seen:
            message += (f".\n  Those are {seen}'s numbers: you gave {name} {seen}'s layout "
                        f"({MEANING[seen]})")
        raise CheckFailed(message)
    passed = [f"measured on {STRATEGY_WORLD} ranks, {name}: {_measured(measured[name])}"
              for name in MEASURED_STRATEGIES]
    graded = predictions.grade(12, predicted, {
        name: {"stored_percent": m["stored"], "held_percent": m["held"],
               "forward_all_gathers": m["forward"], "backward_all_gathers": m["backward"]}
        for name, m in measured.items()})
    return passed + ["HYBRID_SHARD on 8 ranks in groups of 4: a (2, 4) mesh of (replicas, "
                     "shards), FULL_SHARD inside each group"] + graded
