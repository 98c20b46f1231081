"""Check of exercise 13: FSDPTrainer._get_mixed_precision_policy
(snippets/training/fsdp_trainer.py).
"""

from __future__ import annotations

import contextlib
import math
from types import ModuleType

import torch

from snippets.exercises import predictions
from snippets.exercises.checks._fsdp_trainer import _fsdp_trainer_class
from snippets.exercises.gang import run_learner, shows_prints
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


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
