"""How much memory each rank needs for the model states under ZeRO, by formula and by DeepSpeed.

    python -m snippets.cluster.deepspeed.memory_estimates

DeepSpeed ships estimators (`estimate_zero2_model_states_mem_needs_all_live`, the zero3 ones)
that print per-GPU and per-CPU memory for a model and a cluster shape. This module writes the
same accounting out as a formula, bytes per parameter, so the printed numbers can be checked
(tests/test_deepspeed.py does) and compared with the ZeRO paper's.

Mixed-precision Adam, per parameter:
  2 bytes  16-bit parameter (what forward and backward use)
  2 bytes  16-bit gradient
  12 bytes fp32 master weight + Adam's two moments        (the paper's K = 12)
  4 bytes  fp32 gradient partition, which DeepSpeed's estimator also counts (the paper does not)
Stage 1 shards the optimizer states, stage 2 also the gradients, stage 3 also the parameters;
each shard is 1/N of the whole, N the number of GPUs.
"""

from __future__ import annotations

import contextlib
import io

from snippets.models.gpt import GPT, get_config

GiB = 2**30


# --8<-- [start:formulas]
def zero_paper_bytes(num_params: int, gpus: int, stage: int) -> float:
    """Model-state bytes per GPU from the ZeRO paper (Rajbhandari et al. 2020), K = 12."""
    p, k = num_params, 12
    return {0: (2 + 2 + k) * p,
            1: 2 * p + 2 * p + k * p / gpus,
            2: 2 * p + (2 + k) * p / gpus,
            3: (2 + 2 + k) * p / gpus}[stage]


def deepspeed_estimator_bytes(num_params: int, gpus: int, stage: int,
                              largest_layer_params: int = 0) -> int:
    """The same accounting as DeepSpeed's estimators (no offload): 18 bytes per parameter are
    sharded (2 gradient + 4 fp32 gradient + 12 fp32 weights and moments). Stage 2 keeps the full
    16-bit parameters (2 bytes each) on every GPU; stage 3 keeps only the largest layer, gathered
    (4 bytes per parameter of it: its 16-bit weights and gradients)."""
    sharded = int(18 * num_params / gpus)
    if stage in (1, 2):  # DeepSpeed has one estimator for both: it uses stage 2's numbers
        return 2 * num_params + sharded
    if stage == 3:
        return 4 * largest_layer_params + sharded
    raise ValueError(f"stage must be 1, 2 or 3, got {stage}")
# --8<-- [end:formulas]


def count_params(model) -> tuple[int, int]:
    """(total, largest layer) as DeepSpeed's `*_all_live` estimators count them from a model."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    return model_to_params(model)


def deepspeed_estimates(total_params: int, largest_layer_params: int, gpus_per_node: int,
                        nodes: int) -> dict:
    """DeepSpeed's numbers (GPU bytes per rank, no offload) and the tables its estimators print."""
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)

    _, zero2_gpu = estimate_zero2_model_states_mem_needs(
        total_params, gpus_per_node, nodes, cpu_offload=False)
    _, zero3_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params, largest_layer_params, gpus_per_node, nodes, cpu_offload=False,
        cpu_offload_params=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        estimate_zero2_model_states_mem_needs_all_cold(total_params, gpus_per_node, nodes)
        estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params,
                                                       gpus_per_node, nodes)
    return {"zero2_gpu": zero2_gpu, "zero3_gpu": zero3_gpu, "tables": printed.getvalue()}


# A 7B model of the Llama 2 shape: 32 layers of width 4096, a 32000-token embedding that is its
# largest single layer (32000 x 4096 = 131 M parameters).
SEVEN_B = {"total_params": 6_738_415_616, "largest_layer_params": 32_000 * 4_096}


# --8<-- [start:demo]
def main() -> None:
    tiny_total, tiny_largest = count_params(GPT(get_config("tiny")))
    print(f"tiny GPT: {tiny_total:,} parameters (the tied embedding counted once), "
          f"largest layer {tiny_largest:,}")
    p, largest, nodes, per_node = *SEVEN_B.values(), 2, 8
    est = deepspeed_estimates(p, largest, per_node, nodes)
    print(f"a 7B model on {nodes} nodes x {per_node} GPUs, as DeepSpeed estimates it:")
    print(est["tables"].rstrip())
    n = nodes * per_node
    print(f"\n{'per GPU, model states only':26} {'DeepSpeed':>10} {'formula':>10} "
          f"{'ZeRO paper':>11}")
    print(f"{'no ZeRO (plain DDP)':26} {'':>10} {'':>10} {zero_paper_bytes(p, n, 0) / GiB:10.2f}G")
    for stage, ds in ((2, est["zero2_gpu"]), (3, est["zero3_gpu"])):
        ours = deepspeed_estimator_bytes(p, n, stage, largest)
        print(f"{'ZeRO-' + str(stage):26} {ds / GiB:9.2f}G {ours / GiB:9.2f}G "
              f"{zero_paper_bytes(p, n, stage) / GiB:10.2f}G")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
