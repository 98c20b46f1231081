"""Two shape errors from inside attention, and the silent bug that raises none.

    python snippets/debugging/attention_view_error.py
"""

import torch

B, T, hidden = 2, 8, 64
q = torch.randn(B, T, hidden)  # what q_proj returns: (batch, time, hidden)

# 1. Splitting into heads when hidden_size is not a multiple of the head count (what
#    GPTConfig.validate prevents): 64 // 6 = 10, and 64 features are not a whole number of 10s.
try:
    q.view(B, T, -1, hidden // 6)
except RuntimeError as err:
    print(f"1. RuntimeError: {err}")

# 2. Merging heads back with .view after the transpose: the transposed tensor is not laid out
#    contiguously in memory, and .view never copies.
y = torch.randn(B, 4, T, 16)  # attention output: (batch, heads, time, head_dim)
try:
    y.transpose(1, 2).view(B, T, hidden)
except RuntimeError as err:
    print(f"2. RuntimeError: {err}")
merged = y.transpose(1, 2).reshape(B, T, hidden)  # the fix: reshape copies when it must
print(f"   transpose(1, 2).reshape(B, T, hidden) works: {tuple(merged.shape)}")

# 3. Forgetting the transpose: the right shape, no error, and wrong numbers. Row t of the
#    result mixes several time steps of one head instead of all heads at time t.
wrong = y.reshape(B, T, hidden)
print(f"3. reshape without transpose: shape {tuple(wrong.shape)}, "
      f"equal to the right merge: {torch.equal(wrong, merged)}")
