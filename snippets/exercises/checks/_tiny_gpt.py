"""The small GPT config the checks of exercises 4-7 build in the learner's module and in the
solution's.
"""

from __future__ import annotations

from types import ModuleType


def _config(module: ModuleType, **fields):
    """The same small config in the learner's module and in the solution's."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=16)
    base.update(fields)
    return module.GPTConfig(**base)
