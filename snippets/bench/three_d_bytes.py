"""What the planner prices for the from-scratch 3-D run, beside what the run sends:

    python -m snippets.bench.three_d_bytes

The run is snippets/scratch/three_d_check.py's (DP x TP x PP = 2 x 2 x 2, 8 processes, the tiny
GPT with one layer per stage). For each stage, the bytes per step and rank that its rank 0
counted as it sent them, the formula from sizes alone (three_d_check.bytes_per_step), and the
planner's `messages_per_rank` (snippets/planner/cost_model.py), the numbers `plan_training`
turns into time; the planner prices every stage as its busiest, the first.
tests/test_three_d.py derives each difference between run and planner exactly.
"""

from __future__ import annotations

from snippets.dist import spawn
from snippets.models.gpt import get_config
from snippets.planner.cost_model import MODELS, messages_per_rank
from snippets.scratch.three_d import Mesh
from snippets.scratch.three_d_check import (BATCH, BYTES_HEADER, MICRO_BATCHES, SEQ, STEPS,
                                            bytes_per_step, bytes_row, train_3d)


def sent_worker(rank: int, world_size: int, mesh: Mesh) -> dict:
    return train_3d(rank, world_size, mesh, STEPS, BATCH, SEQ, MICRO_BATCHES)["sent"]


# --8<-- [start:compare]
def main() -> None:
    mesh = Mesh(dp=2, pp=2, tp=2)
    sent = spawn(sent_worker, mesh.size, mesh, timeout_s=60)
    config = get_config("tiny", num_hidden_layers=mesh.pp)
    plan = dict(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, zero_stage=0, precision="fp32", seq_len=SEQ,
                micro_batch_size=BATCH // mesh.dp // MICRO_BATCHES, micro_batches=MICRO_BATCHES)
    planner = messages_per_rank(dict(MODELS["tiny"], num_hidden_layers=mesh.pp), plan)
    print(BYTES_HEADER)
    for p in range(mesh.pp):
        print(bytes_row(p, "counted", sent[mesh.rank(dp=0, pp=p, tp=0)]))
        print(bytes_row(p, "formula", bytes_per_step(config, mesh, BATCH, SEQ, p)))
        print(bytes_row(p, "planner", planner))
# --8<-- [end:compare]


if __name__ == "__main__":
    main()
