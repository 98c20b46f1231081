"""The same quantity, stated on several pages, has one value everywhere.

tests/test_facts.py checks, on every page, the quantities a library or a formula defines (gloo's
and NCCL's default timeouts, the c10d join timeout, bytes per parameter with Adam, the bubble
formula, the "node 3 of 4" convention) against that library or formula. This file does the same
for quantities nothing installed here defines: hardware figures from a datasheet, and a few
library values the pages state in many words. Each row names the quantity, a regex that finds its
statements in docs/**/*.md (its groups, joined, are the value; thousands separators ignored), the
one true value, and where that value comes from. A page that disagrees fails the test, which
prints both values and where each is stated, so the fix is one edit away.

One regex scan per row over every page (test_facts._scan): well under a second in all.
"""

import pytest
import torch

from tests.test_facts import _scan

pytestmark = pytest.mark.kernel_independent("the pages' text against each other")


def _ddp_bucket_cap_mib() -> int:
    from torch.nn.parallel import distributed as ddp_module
    return ddp_module._DEFAULT_BUCKET_CAP_MB  # bucket_cap_mb counts MiB (x 1024 * 1024)


H100 = "NVIDIA's H100 SXM datasheet and Hopper whitepaper"

# (quantity, regex, true value or a function returning it, source)
QUANTITIES = [
    ("H100 SXM dense bf16 TFLOP/s", r"(\d[\d,]*) TFLOP/s (?:in|of) dense\s+bf16",
     989, H100 + ": 989.4 dense, 1,979 with 2:4 sparsity"),
    ("H100 SXM dense FP8 TFLOP/s", r"(\d[\d,]*)(?: TFLOP/s)? of dense FP8",
     1979, H100 + ": 1,979 dense, 3,958 with 2:4 sparsity"),
    ("H100 NVLink GB/s per direction", r"(\d+) GB/s (?:each way|per direction)|per direction, (\d+) GB/s",
     450, H100 + ": NVLink 900 GB/s per GPU, both directions together"),
    ("H100 NVLink GB/s, both directions", r"(\d+) GB/s (?:per H100, both directions|(?:per GPU )?counting both directions)"
     r"|half the (\d+) GB/s",
     900, H100),
    ("largest fp16 number", r"(\d\d,?\d\d\d),? the largest (?:float16|fp16) number|fp16's largest number is"
     r" (\d\d,?\d\d\d)|range ends at (\d\d,?\d\d\d)|(?:that )?ends at (\d\d,?\d\d\d) and normal"
     r"|must stay below (\d\d,?\d\d\d)",
     lambda: int(torch.finfo(torch.float16).max), "torch.finfo(torch.float16).max"),
    ("DDP's default bucket, MiB", r"`bucket_cap_mb` is (\d+) MiB|~(\d+) MiB buckets|packs gradients into buckets of about (\d+) MB"
     r"|~(\d+) MB buckets|`bucket_cap_mb=(\d+)`, GPT-2",
     _ddp_bucket_cap_mib, "torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB"),
]


def disagreements(what: str, pattern: str, want: str, source: str) -> tuple[int, list[str]]:
    """(statements found, one line per statement whose value is not `want`)."""
    found = [(f"{page}:{line}", value.replace(",", "")) for page, line, value in _scan(pattern)]
    agreeing = [where for where, value in found if value == want]
    example = f"{agreeing[0]} says {want}" if agreeing else f"no page says {want}"
    return len(found), [f"{where} says {what} = {value}; {example}, the true value ({source})"
                        for where, value in found if value != want]


@pytest.mark.parametrize("what, pattern, truth, source", QUANTITIES, ids=[q[0] for q in QUANTITIES])
def test_same_quantity_same_value_on_every_page(what, pattern, truth, source):
    want = str(truth() if callable(truth) else truth)
    seen, wrong = disagreements(what, pattern, want, source)
    assert seen, f"no page states {what} any more: update the row's regex, or drop the row"
    assert not wrong, "\n".join(wrong)
