"""Check of exercise 4: MLP.forward (snippets/models/gpt.py)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from snippets.exercises.checks._tensors import _close, _expect_tensor, _max_diff
from snippets.exercises.checks._tiny_gpt import _config
from snippets.exercises.runner import CheckFailed
from snippets.models import gpt as ref


def check_mlp(learner: ModuleType) -> list[str]:
    torch.manual_seed(0)
    solution = ref.MLP(_config(ref))
    mlp = learner.MLP(_config(learner))
    mlp.load_state_dict(solution.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = _expect_tensor(mlp(x), "MLP.forward")
        expected = solution(x)
        gate, up, down = solution.gate_proj(x), solution.up_proj(x), solution.down_proj
    if got.shape != x.shape:
        raise CheckFailed(
            f"your MLP maps shape {tuple(x.shape)} to {tuple(got.shape)}; it must return "
            f"{tuple(x.shape)}: finish with down_proj, from intermediate_size back to hidden_size")
    if _close(got, expected):
        return ["matches down_proj(silu(gate_proj(x)) * up_proj(x))"]
    with torch.no_grad():
        mistakes = [
            (down(F.gelu(gate) * up), "you used GELU; SwiGLU gates with SiLU: F.silu"),
            (down(F.gelu(gate, approximate="tanh") * up),
             "you used GELU; SwiGLU gates with SiLU: F.silu"),
            (down(F.relu(gate) * up), "you used ReLU; SwiGLU gates with SiLU: F.silu"),
            (down(torch.sigmoid(gate) * up),
             "you used sigmoid(gate); SiLU is gate * sigmoid(gate): F.silu"),
            (down(gate * F.silu(up)), "SiLU goes on gate_proj(x), not on up_proj(x)"),
            (down(F.silu(gate)), "you dropped up_proj: the SiLU-gated projection must be "
                                 "multiplied element-wise by up_proj(x)"),
            (down(F.silu(gate) + up), "you added the two projections; SwiGLU multiplies them "
                                      "element-wise: silu(gate_proj(x)) * up_proj(x)"),
            (down(F.silu(gate * up)), "apply SiLU to gate_proj(x) alone, then multiply by "
                                      "up_proj(x)"),
        ]
    for wrong, why in mistakes:
        if _close(got, wrong):
            raise CheckFailed(f"your MLP computes the wrong function: {why}")
    raise CheckFailed(f"your MLP differs from down_proj(silu(gate_proj(x)) * up_proj(x)) by up to "
                      f"{_max_diff(got, expected):.3g}")
