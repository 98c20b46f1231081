"""The FLOPs formula behind MFU, checked against PyTorch's own FLOP counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from snippets.models.gpt import GPT, get_config
from snippets.planner.flops import training_flops_per_token


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_training_flops_per_token_matches_flop_counter(name):
    # Eager attention: FlopCounterMode (torch 2.13) does not count the CPU flash-attention kernel
    # that scaled_dot_product_attention dispatches to, so with "sdpa" it would under-count by
    # exactly the 12 L T h attention term.
    config = get_config(name, attn_implementation="eager")
    model = GPT(config)
    batch, seq_len = 2, config.max_position_embeddings
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    counted = counter.get_total_flops() / (batch * seq_len)
    # Exact: the counter counts every matmul (and full, unmasked T x T attention scores, as the
    # formula does); elementwise ops (norms, SiLU, softmax) are not counted by either.
    assert counted == training_flops_per_token(config, seq_len)
