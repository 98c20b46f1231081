"""What ZeRO holds and sends per rank: measured, and the ZeRO paper's formulas beside it.

model_state_bytes counts the bytes of parameters, gradients and optimizer state a rank really
holds (the storages it can reach); expected_model_state_bytes and expected_traffic_bytes are the
per-rank formulas for the stages of snippets/scratch/zero.py. tests/test_zero.py, the ZeRO check
(python -m snippets.bench.zero_check) and the benchmark (snippets/bench/zero_memory.py) put
the two side by side.
"""

from __future__ import annotations

import torch
from torch import nn

from snippets.planner.memory import BYTES_PER_PARAM


# --8<-- [start:measure]
def model_state_bytes(model: nn.Module, optimizer, local=lambda tensor: tensor) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, counted from the
    storages of the tensors it can reach (each storage once; a freed storage has 0 bytes).
    `local` maps a library's sharded tensor to this rank's piece (the benchmark's FSDP2 row)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO1/2Optimizer wrap an AdamW
    params = [*model.parameters(), *(p for group in inner.param_groups for p in group["params"])]
    held, seen = {"params": 0, "grads": 0, "optimizer": 0}, set()

    def count(kind: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = local(tensor).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    for p in params:
        count("params", p)
    for p in params:
        count("grads", p.grad)
    for state in inner.state.values():
        for value in state.values():
            count("optimizer", value)
    held["total"] = sum(held.values())
    return held


def expected_model_state_bytes(stage: int, num_params: int, world_size: int,
                               precision: str = "fp32") -> dict[str, float]:
    """The paper's per-rank model-state memory. stage 0 is plain data parallelism."""
    per_param = BYTES_PER_PARAM[precision]
    table_name = {"params": "weights", "grads": "gradients", "optimizer": "optimizer"}
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    out = {kind: per_param[table_name[kind]] * num_params / (world_size if sharded[kind] else 1)
           for kind in table_name}
    out["total"] = sum(out.values())
    return out


def expected_traffic_bytes(stage: int, num_params: int, world_size: int,
                           bytes_per_elem: int = 4) -> dict[str, float]:
    """Bytes one rank sends per step (ring volumes, see CommStats in
    snippets/scratch/flat_shard.py) for the stages of snippets/scratch/zero.py."""
    size, f = num_params * bytes_per_elem, (world_size - 1) / world_size
    return {
        0: {"all_reduce": 2 * f * size},  # DDP
        1: {"all_reduce": 2 * f * size, "all_gather": f * size},  # as zero.py builds it: 1.5x DDP
        2: {"reduce_scatter": f * size, "all_gather": f * size},  # = DDP's volume
        3: {"reduce_scatter": f * size, "all_gather": 2 * f * size},  # 1.5x DDP
    }[stage]
# --8<-- [end:measure]
