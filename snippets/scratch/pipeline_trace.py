"""Measuring a pipeline (snippets/scratch/pipeline.py): what each stage did when, and the
bubble, the idle share of a step, measured from those timelines against the theory."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


# --8<-- [start:trace]
@dataclass
class StageTrace:
    """What one stage did in one step. Times are time.perf_counter() seconds, a monotonic clock
    that all processes on one machine share, so the stages' events line up on one timeline."""

    stage_index: int
    events: list = field(default_factory=list)  # (kind "F"/"B", micro-batch, start, end)
    peak_live: int = 0  # most micro-batches whose activations were held at once

    @contextmanager
    def op(self, kind: str, micro_batch: int):
        start = time.perf_counter()
        yield
        self.events.append((kind, micro_batch, start, time.perf_counter()))

    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.events)
# --8<-- [end:trace]


# --8<-- [start:bubble]
def theoretical_bubble(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of a step when every F (and every B) takes the same time on every stage."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def measured_bubble(traces: list[StageTrace]) -> list[float]:
    """Per stage, idle time / total time, where the total is the step's span: from the first
    op to start on any stage to the last op to end."""
    start = min(e[2] for t in traces for e in t.events)
    end = max(e[3] for t in traces for e in t.events)
    return [1 - t.busy_s() / (end - start) for t in traces]
# --8<-- [end:bubble]
