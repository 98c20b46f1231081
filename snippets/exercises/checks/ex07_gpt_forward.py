"""Check of exercise 7: GPT.forward (snippets/models/gpt.py)."""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from snippets.exercises.checks._tensors import _close, _expect_tensor, _max_diff
from snippets.exercises.checks._tiny_gpt import _config
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def check_gpt_forward(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.GPT(_config(ref))
    model = learner.GPT(_config(learner))
    # The solution's weights: this checks forward, whatever exercise 6 drew.
    model.load_state_dict(solution.state_dict())
    tokens = torch.randint(0, 64, (2, 11))
    input_ids, targets = ref.shift_for_next_token(tokens)
    B, T = input_ids.shape
    passed = []

    with torch.no_grad():
        result = model(input_ids, targets)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise CheckFailed(f"GPT.forward returned {type(result).__name__}; it must return the "
                              "pair (logits, loss)")
        logits, loss = result
        logits = _expect_tensor(logits, "GPT.forward (logits)")
        if logits.shape != (B, T, 64):
            raise CheckFailed(f"logits have shape {tuple(logits.shape)}, expected (batch, T, "
                              f"vocab_size) = {(B, T, 64)}: one score per vocabulary entry at "
                              "every position, from self.lm_head")
        expected_logits, expected_loss = solution(input_ids, targets)
        if not _close(logits, expected_logits, tol=1e-4):
            x = solution.embed_tokens(input_ids)
            no_blocks = solution.lm_head(solution.norm(x))
            for block in solution.layers:
                x = block(x)
            mistakes = [
                (solution.lm_head(x), "you skipped the final norm: apply self.norm to the output "
                                      "of the last block, before self.lm_head"),
                (no_blocks, "the blocks did not run: x = block(x) for each block in "
                            "self.layers, feeding each block's output to the next"),
            ]
            for wrong, why in mistakes:
                if _close(logits, wrong, tol=1e-4):
                    raise CheckFailed(f"your logits are wrong: {why}")
            raise CheckFailed(f"your logits differ from the solution's (same weights) by up to "
                              f"{_max_diff(logits, expected_logits):.3g}: embed, blocks, final "
                              "norm, lm_head")
        passed.append("logits: embed, every block, final norm, lm_head")

        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise CheckFailed(f"with targets, loss must be a scalar tensor; got "
                              f"{type(loss).__name__}"
                              + (f" of shape {tuple(loss.shape)}" if hasattr(loss, "shape") else "")
                              + ": F.cross_entropy averages over all positions")
        if not _close(loss, expected_loss, tol=1e-4):
            flat = logits.float()
            shifted = F.cross_entropy(flat[:, :-1].reshape(-1, 64), targets[:, 1:].reshape(-1))
            why = "F.cross_entropy(logits.view(-1, vocab_size), targets.reshape(-1))"
            if _close(loss, shifted, tol=1e-4):
                why = ("you shifted the targets again; here the caller already did "
                       "(shift_for_next_token): targets[:, t] is the token after input_ids[:, t], "
                       "so compare logits[:, t] with targets[:, t] directly")
            elif _close(loss, F.cross_entropy(flat.reshape(-1, 64), targets.reshape(-1),
                                              reduction="sum"), tol=1e-4):
                why = "you summed the losses; take the mean over positions (the default)"
            raise CheckFailed(f"your loss is {loss.item():.4f}, expected "
                              f"{expected_loss.item():.4f}: {why}")
        passed.append(f"loss: mean next-token cross-entropy ({loss.item():.4f}, near "
                      f"ln(64) = {math.log(64):.4f} for random weights)")

        ignored = targets.clone()
        ignored[:, :4] = -100
        got_ignored = model(input_ids, ignored)[1]
        if not _close(got_ignored, solution(input_ids, ignored)[1], tol=1e-4):
            raise CheckFailed("targets of -100 must be left out of the loss (padding): "
                              "F.cross_entropy(..., ignore_index=-100)")
        passed.append("targets of -100 are ignored")

        no_targets = model(input_ids)
        if not (isinstance(no_targets, tuple) and len(no_targets) == 2
                and no_targets[1] is None):
            raise CheckFailed("without targets, forward must return (logits, None)")
        passed.append("without targets: (logits, None)")

    import torch.utils.checkpoint as torch_checkpoint

    calls = []
    original_module_fn, original_torch_fn = getattr(learner, "checkpoint", None), \
        torch_checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        return original_torch_fn(fn, *args, **kwargs)

    checkpointed = learner.GPT(_config(learner, gradient_checkpointing=True))
    checkpointed.load_state_dict(solution.state_dict())
    checkpointed.train()
    try:
        learner.checkpoint = counting
        torch_checkpoint.checkpoint = counting
        checkpointed(input_ids, targets)[1].backward()
    finally:
        torch_checkpoint.checkpoint = original_torch_fn
        if original_module_fn is not None:
            learner.checkpoint = original_module_fn
    if len(calls) != len(checkpointed.layers):
        raise CheckFailed(
            f"with config.gradient_checkpointing = True in training mode, checkpoint() ran "
            f"{len(calls)} times for {len(checkpointed.layers)} blocks: run each block as "
            "x = checkpoint(block, x, use_reentrant=False), so its activations are recomputed in "
            "backward instead of stored")
    solution.train()
    solution(input_ids, targets)[1].backward()
    grad, expected_grad = checkpointed.embed_tokens.weight.grad, solution.embed_tokens.weight.grad
    if grad is None or not _close(grad, expected_grad, tol=1e-4):
        raise CheckFailed("with gradient checkpointing the gradients differ from the plain "
                          "forward's: checkpointing must only trade memory for compute")
    passed.append("gradient checkpointing: each block through checkpoint(), same gradients")
    return passed
