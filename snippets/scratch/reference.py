"""The one-process reference the from-scratch pipeline and 3-D checks compare with.

The whole GPT (the tiny one by default) in one process, SGD with momentum, trained on batches
drawn from one seeded generator. A parallel run draws the same batches on every rank
(`token_batches`), uses the same optimizer settings (`SGD`) and the same seed for the initial
weights (torch.manual_seed(0) before building the GPT), so after N steps its weights, gathered
back into one model's layout, must equal these within a bound that only summation order sets.
"""

from __future__ import annotations

import torch

from snippets.models.gpt import GPT, get_config, shift_for_next_token


# --8<-- [start:reference]
SGD = dict(lr=0.5, momentum=0.9)  # momentum, not Adam: Adam would hide a gradient m times off


def token_batches(vocab_size: int, steps: int, batch_size: int, seq_len: int):
    """`steps` batches of token ids (batch_size, seq_len + 1), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)


def single_process(steps, batch_size, seq_len, config_name="tiny", num_layers=2):
    """The training with the whole model in one process: (its state_dict, its losses)."""
    torch.manual_seed(0)
    model = GPT(get_config(config_name, num_hidden_layers=num_layers))
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for tokens in token_batches(model.config.vocab_size, steps, batch_size, seq_len):
        _, loss = model(*shift_for_next_token(tokens))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model.state_dict(), losses
# --8<-- [end:reference]
