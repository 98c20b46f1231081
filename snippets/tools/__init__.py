"""Tools a learner points at their own runs: its logs, its profiler trace, its checkpoints."""
