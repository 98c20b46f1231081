"""What the checks that run the learner's file on gloo processes share: an error a rank raised,
described where the learner's file raised it, and the tolerances of comparing ranks with one
process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from snippets.exercises.runner import _describe as describe


def _describe(err: BaseException, learner) -> str:
    return describe(err, Path(learner.__file__))


def _same(a, b) -> bool:
    # fp32. The mean over the ranks is summed in another order than the reference's (gloo's
    # order), and AdamW turns a relative error e in a gradient into about e in the update:
    # 1e-5 relative, far below every mistake's difference (a factor N, a whole step).
    return (a is not None and b is not None and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-5, atol=1e-6))


def _close(a, b) -> bool:
    # fp32, the same products summed in another order (partial sums over ranks, gloo's order):
    # a bound, not exact; 1e-5 is far below every mistake's difference (a rank's share, a swap).
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-5, atol=1e-5))


def _permutations(p: int):
    from itertools import permutations

    return permutations(range(p))
