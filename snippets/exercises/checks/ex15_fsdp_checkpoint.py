"""Check of exercise 15: FSDPTrainer.save_checkpoint (snippets/training/fsdp_trainer.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from snippets.exercises.checks._fsdp_trainer import _fsdp_trainer, _fsdp_trainer_class
from snippets.exercises.checks._tensors import _max_diff
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


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
