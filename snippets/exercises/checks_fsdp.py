"""Checks of exercises 12-15, the FSDP trainer (snippets/training/fsdp_trainer.py), as in
checks_model.py: the learner's method runs, and the usual wrong answers are computed and named.
"""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

import torch
import torch.nn as nn

from snippets.exercises.checks_model import _max_diff
from snippets.exercises.checks_trainer import _ref_trainer
from snippets.exercises import predictions
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


# ---------------------------------------------------------------- phase 3: the FSDP trainer
#
# As in phase 2, each check runs the learner's method inside the solution's trainer. Exercises
# 12 and 13 measure what the learner's answer makes FSDP2 do on two processes; 14 runs FSDP2
# for real in a process group of one; 15 gathers shards, so it runs on two processes. 12-14 ask
# for the learner's predictions of what they measure first, and grade them (predictions.py).

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


# ---------------------------------------------------------------- exercise 12: strategies
#
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


# ---------------------------------------------------------------- exercise 13: precision
#
# Judged by what the policy does, measured: the learner's policy shards the tiny model with the
# trainer's own _wrap_model (a unit per block, then the model) on 2 gloo processes, for each
# compute dtype, and one forward and backward records the dtype and size of every all-gather and
# reduce-scatter, the dtype of the loss handed back, and what a block computes in when it is
# handed fp32 activations. fp32 runs first: its logits and loss are the reference.

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_WORLD = 2


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _recording_collectives():
    """[(collective, dtype, bytes of the whole tensor: the all-gather's output, the
    reduce-scatter's input)] of FSDP's collectives over more than one rank, while inside."""
    import torch.distributed as dist

    sent, gather, scatter = [], dist.all_gather_single, dist.reduce_scatter_single

    def record(kind, whole, group):
        if dist.get_world_size(group) > 1:
            sent.append((kind, _dtype(whole.dtype), whole.numel() * whole.element_size()))

    def gathering(output, input, group=None, async_op=False):
        record("all-gather", output, group)
        return gather(output, input, group=group, async_op=async_op)

    def scattering(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        record("reduce-scatter", input, group)
        return scatter(output=output, input=input, op=op, group=group, async_op=async_op)

    dist.all_gather_single, dist.reduce_scatter_single = gathering, scattering
    try:
        yield sent
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def _precision_worker(learner, rank: int, world: int) -> dict:
    from snippets.models.gpt import shift_for_next_token

    cls = _fsdp_trainer_class(learner, "_get_mixed_precision_policy")
    config = ref.get_config("tiny", max_position_embeddings=16)
    seeded = torch.Generator().manual_seed(rank)
    inputs, targets = shift_for_next_token(torch.randint(0, config.vocab_size, (2, 17),
                                                         generator=seeded))
    activations = torch.randn(2, 16, config.hidden_size, generator=seeded)  # fp32
    facts, reference = {}, None
    for name in PRECISIONS:
        trainer = cls.__new__(cls)  # no data, no optimizer: only _wrap_model's inputs
        trainer.world_size, trainer.device = world, torch.device("cpu")
        trainer.fsdp_config = learner.FSDPConfig(mixed_precision=name)
        torch.manual_seed(0)  # the same weights on every rank and for every dtype
        model = trainer._wrap_model(ref.GPT(config))
        with _recording_collectives() as sent:
            try:
                logits, loss = model(inputs, targets)
            except RuntimeError as err:  # both ranks fail alike: no collective is left waiting
                facts[name] = {"error": str(err).splitlines()[0][:120]}
                continue
            gathered = list(sent)
            loss.backward()
        backward = sent[len(gathered):]
        got = {"gathered": gathered,
               "regathered": [s for s in backward if s[0] == "all-gather"],
               "reduced": [s for s in backward if s[0] == "reduce-scatter"],
               "loss dtype": _dtype(loss.dtype), "loss": loss.item(),
               "stored": sorted({_dtype(p.dtype) for p in model.parameters()})}
        try:
            with torch.no_grad():
                got["block on fp32"] = _dtype(model.layers[0](activations).dtype)
        except RuntimeError as err:
            got["block on fp32"] = str(err).splitlines()[0][:120]
        if reference is None:
            reference = logits.detach().float(), loss.item()
        else:
            # Cross-entropy's gradient with respect to the logits, softmax - onehot, has an L1
            # norm of at most 2, so a loss computed in fp32 from these logits moves by at
            # most 2 x their largest change from the fp32 run's.
            got["bound"] = 2 * (logits.detach().float() - reference[0]).abs().max().item()
            got["loss change"] = abs(loss.item() - reference[1])
        facts[name] = got
    return facts


def _total(sent: list) -> str:
    return f"{sum(size for _, _, size in sent):,} bytes"


def _judge_precision(name: str, got: dict, policy, fp32: dict | None) -> None:
    want = _dtype(PRECISIONS[name])
    where = f"{name}, measured on {PRECISION_WORLD} ranks"
    if "error" in got:
        if "same dtype" in got["error"] and policy.output_dtype is not None:
            raise CheckFailed(
                f"{where}: forward raised {got['error']!r}. output_dtype="
                f"{_dtype(policy.output_dtype)} casts the outputs of EVERY unit, each block's "
                "too: the final norm then hands lm_head activations that are not in its "
                f"weights' {want}. output_dtype suits a unit whose outputs go to code outside "
                "the policy; this GPT computes its loss in fp32 itself (logits.float()): "
                "leave output_dtype=None")
        raise CheckFailed(f"{where}: forward raised {got['error']!r}")
    gathered = {dtype for _, dtype, _ in got["gathered"] + got["regathered"]}
    if gathered != {want}:
        swapped = " (bf16 and fp16 swapped?)" if gathered <= {"bfloat16", "float16"} else ""
        raise CheckFailed(
            f"{where}: the parameters were all-gathered in {', '.join(sorted(gathered))}, "
            f"{_total(got['gathered'])} per forward, expected {want}{swapped}. param_dtype is "
            "what each unit's all-gather produces and its forward and backward compute in: "
            f"{name} computes in {want}")
    reduced = {dtype for _, dtype, _ in got["reduced"]}
    if reduced != {"float32"}:
        full = sum(size * 32 // torch.finfo(getattr(torch, dtype)).bits
                   for _, dtype, size in got["reduced"])
        raise CheckFailed(
            f"{where}: the gradients were reduce-scattered in {', '.join(sorted(reduced))}, "
            f"{_total(got['reduced'])} per backward where float32 moves {full:,}; fp32 was "
            "asked for. reduce_dtype defaults to param_dtype, so left out it reduces in the "
            "compute dtype: the sum of N ranks' gradients is then rounded to 16 bits at every "
            "partial sum (8 significant bits in bf16). Set reduce_dtype=torch.float32")
    if got["loss dtype"] != "float32":
        # The gap between neighbouring values of that dtype at the loss: eps x 2^exponent.
        step = (torch.finfo(getattr(torch, got["loss dtype"])).eps
                * 2 ** math.floor(math.log2(got["loss"])))
        change = f"{got['loss']:.5f} where the fp32 run's is {fp32['loss']:.5f}" if fp32 else ""
        raise CheckFailed(
            f"{where}: the loss came back in {got['loss dtype']} ({change}): output_dtype="
            f"{_dtype(policy.output_dtype)} casts every unit's outputs, the loss included, "
            f"after the model computed it in fp32. Near {got['loss']:.1f} a {got['loss dtype']} "
            f"loss moves in steps of {step:g}, so the loss you log and compare is rounded to "
            "that. Leave output_dtype=None (this GPT computes its loss in fp32 itself)")
    if got["block on fp32"] != want:
        raise CheckFailed(
            f"{where}: a block handed fp32 activations (as from any module outside the policy) "
            f"gave {got['block on fp32']!r}, expected to compute in {want}. With "
            "cast_forward_inputs=False FSDP passes a unit's inputs through uncast, and fp32 "
            f"activations meet {want} weights in its matmuls. Keep cast_forward_inputs=True "
            "(the default)")
    if "bound" in got and not got["loss change"] <= got["bound"]:
        raise CheckFailed(
            f"{where}: the loss differs from the fp32 run's by {got['loss change']:.3g}, more "
            f"than {got['bound']:.3g}, twice the logits' largest change (cross-entropy moves "
            "by at most that): the loss was not computed in fp32 from these logits")


@shows_prints
def check_mixed_precision_policy(learner: ModuleType) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    predicted = predictions.require(13, learner)  # before anything measured is shown
    cls = _fsdp_trainer_class(learner, "_get_mixed_precision_policy")
    policies = {}
    for name in PRECISIONS:
        trainer = cls.__new__(cls)
        trainer.fsdp_config = learner.FSDPConfig(mixed_precision=name)
        policies[name] = trainer._get_mixed_precision_policy()
        if not isinstance(policies[name], MixedPrecisionPolicy):
            raise CheckFailed(f"for {name!r} you returned {type(policies[name]).__name__}; "
                              "return a torch.distributed.fsdp.MixedPrecisionPolicy")
    trainer = cls.__new__(cls)
    trainer.fsdp_config = learner.FSDPConfig()
    trainer.fsdp_config.mixed_precision = "fp8"  # past FSDPConfig's own validation
    try:
        policy = trainer._get_mixed_precision_policy()
    except ValueError as err:  # ConfigError is a ValueError
        if not all(n in str(err) for n in PRECISIONS):
            raise CheckFailed(f"for an unknown name your error says {str(err)!r}: name the "
                              "valid choices, bf16, fp16 and fp32") from None
    else:
        raise CheckFailed(f"for mixed_precision='fp8' you returned {policy!r:.60}: raise a "
                          "ConfigError naming the valid choices instead of training in "
                          "something nobody asked for")

    ranks = run_learner(learner, _precision_worker, PRECISION_WORLD)
    for name in PRECISIONS:
        for facts in ranks:
            _judge_precision(name, facts[name], policies[name], facts.get("fp32"))
    passed = []
    for name, got in ranks[0].items():
        passed.append(
            f"measured on {PRECISION_WORLD} ranks, {name}: forward all-gathers "
            f"{_total(got['gathered'])} of {_dtype(PRECISIONS[name])} parameters, backward "
            f"{_total(got['regathered'])} more (the blocks') and reduce-scatters "
            f"{_total(got['reduced'])} of float32 gradients; the loss comes back in float32, "
            f"and a block handed fp32 activations computes in {got['block on fp32']}")
    measured = {name: {"forward_all_gather_bytes": sum(s for _, _, s in got["gathered"]),
                       "backward_reduce_scatter_bytes": sum(s for _, _, s in got["reduced"]),
                       "loss_dtype": got["loss dtype"],
                       "block_on_fp32_activations": got["block on fp32"]}
                for name, got in ranks[0].items()}
    return passed + [
        "bf16 and fp16: each rank's loss within twice its logits' largest change of the fp32 "
        "run's, the most a cross-entropy computed in fp32 can move",
        f"the shards stay {', '.join(ranks[0]['bf16']['stored'])}; an unknown name raises an "
        "error listing bf16, fp16, fp32"] + predictions.grade(13, predicted, measured)


# ---------------------------------------------------------------- exercise 14: FSDP units


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


# ---------------------------------------------------------------- exercise 15: checkpoint


def _fsdp_checkpoint_worker(rank: int, world_size: int, learner_path: str, tmp: str) -> dict:
    """Runs in each of two processes: train, save with the learner's save_checkpoint, resume
    with the solution's load_checkpoint. Returns facts; the parent judges them, so that no
    rank stops early and leaves the other waiting in a collective."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from snippets.exercises.runner import _describe, load_learner_module

    path = Path(learner_path)
    learner = load_learner_module(path)
    writers = []
    save_atomic = learner.save_atomic

    def recording_save(target, state):
        writers.append(rank)
        return save_atomic(target, state)

    learner.save_atomic = recording_save
    cls = _fsdp_trainer_class(learner, "save_checkpoint")
    full = StateDictOptions(full_state_dict=True)
    ckpt = f"{tmp}/ckpt.pt"
    try:
        trainer = _fsdp_trainer(cls, learner, world_size)
        batches = trainer.micro_batches()
        for _ in range(2):
            trainer.train_step(batches)
        returned = trainer.save_checkpoint(ckpt)
        torch.distributed.barrier()
        at_save = get_model_state_dict(trainer.model, options=full)
        trainer.train_step(batches)
        unbroken = get_model_state_dict(trainer.model, options=full)
    except Exception as err:  # noqa: BLE001 - the learner's code may raise anything
        raise RuntimeError(f"LEARNER: {_describe(err, path)}") from None
    facts = {"writers": writers, "returned": returned is not None}
    try:
        resumed = _fsdp_trainer(cls, learner, world_size)
        resumed.load_checkpoint(ckpt)
        resumed.train_step(resumed.micro_batches())
        after = get_model_state_dict(resumed.model, options=full)
        facts["resumed equal"] = all(torch.equal(after[k], unbroken[k]) for k in unbroken)
    except Exception as err:  # noqa: BLE001 - the loader rejects what the learner wrote
        facts["load error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    if rank == 0:
        facts["at save"] = {k: v.clone() for k, v in at_save.items()}
    return facts


def check_fsdp_checkpoint(learner: ModuleType) -> list[str]:
    import tempfile
    from pathlib import Path

    from snippets.dist import spawn

    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = spawn(_fsdp_checkpoint_worker, 2, learner.__file__, tmp, timeout_s=30)
        except (RuntimeError, TimeoutError) as err:
            text = str(err)
            if "LEARNER: " in text:
                raise CheckFailed("on 2 processes your code raised "
                                  + text.split("LEARNER: ", 1)[1].strip()) from None
            if "timed out" in text.lower() or "did not finish" in text:
                raise CheckFailed(
                    "a rank waited 30 s for the other in a collective: get_state_dict "
                    "all-gathers the shards, so EVERY rank must call it (only the writing "
                    "is rank 0's alone)") from None
            raise
        path = Path(tmp) / "ckpt.pt"
        if not path.is_file():
            raise CheckFailed("save_checkpoint wrote nothing at the path it was given (with 2 "
                              "processes): rank 0 must write it")
        if ranks[1]["writers"]:
            raise CheckFailed(
                "rank 1 wrote the checkpoint too: with cpu_offload=True only rank 0 receives "
                "the gathered tensors (the others get empty dicts), so rank 1's file would "
                "hold no weights and, renamed last, replace rank 0's. Return None on ranks "
                "other than 0 (if not self.is_main)")
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the learner may have saved anything
            why = str(err).splitlines()[0][:100]
            if "DTensor" in str(err) or "distributed" in str(err):
                why = ("it holds DTensors: self.model.state_dict() of a sharded model is each "
                       "rank's slices. Gather them into plain tensors with get_state_dict(..., "
                       "options=StateDictOptions(full_state_dict=True, cpu_offload=True))")
            raise CheckFailed(f"torch.load(path, weights_only=True) refuses your checkpoint: "
                              f"{why}") from None
    expected = ranks[0]["at save"]
    model_state = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model_state, dict) or set(model_state) != set(expected):
        raise CheckFailed("the checkpoint's 'model' must be the full state dict, keyed like a "
                          "plain GPT's (embed_tokens.weight, layers.0...)")
    for name, value in expected.items():
        saved = model_state[name]
        if saved.shape != value.shape:
            raise CheckFailed(
                f"{name} is saved with shape {tuple(saved.shape)}, the full tensor is "
                f"{tuple(value.shape)}: you saved rank 0's shard only. Every rank holds a "
                "different slice; get_state_dict with full_state_dict=True all-gathers them")
        if not torch.equal(saved.float(), value):
            raise CheckFailed(f"{name} in the checkpoint differs from the model's weights at "
                              f"the time of saving by {_max_diff(saved, value):.3g}")
    plain = ref.GPT(ref.get_config("tiny", max_position_embeddings=16))
    plain.load_state_dict(model_state)
    passed = ["every rank gathers, rank 0 alone writes; loads with weights_only=True",
              "full, unsharded weights: they load into a plain GPT"]
    if not state.get("optimizer", {}).get("state"):
        raise CheckFailed("the checkpoint has no optimizer state: save the optimizer state "
                          "dict get_state_dict returns (AdamW's moments, gathered too)")
    if "load error" in ranks[0]:
        raise CheckFailed(f"load_checkpoint could not restore your checkpoint: "
                          f"{ranks[0]['load error']}: save the same pieces as exercise 11 "
                          "(step, sampler, rng, model_config, train_config)")
    if not all(r["resumed equal"] for r in ranks):
        raise CheckFailed("a run resumed from your checkpoint does not continue like the "
                          "unbroken run: save step, self.sampler.state_dict() and "
                          "capture_rng_state() as well")
    if not ranks[0]["returned"]:
        raise CheckFailed("save_checkpoint returned None on rank 0: return what "
                          "save_atomic(path, state) returns")
    passed.append("a run resumed from it continues exactly like the unbroken run")
    return passed
