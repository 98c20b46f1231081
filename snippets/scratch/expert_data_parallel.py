"""Expert parallelism with data parallelism (EP x DP), from the course's own parts.

Experts are big and tokens are many: expert parallelism (moe.py) splits each layer's experts
over the ep ranks of an EP group, and data parallelism (ddp.py) repeats that group dp times.
Each of the world = ep * dp ranks trains on its own 1/world of the batch, in three groups cut
from one rank layout (three_d.py's Mesh): its EP group (ep ranks holding every expert between
them: tokens go to their experts and back by all_to_all); its expert-data group (the dp ranks
holding the *same* experts: an expert's gradient is reduced over these only); and the world
(every weight outside the experts is on every rank: its gradient is averaged over all).
The two classic mistakes, and the training that shows the test catches them, are in
expert_data_parallel_check.py.

Only torch.distributed primitives are used (new_group, all_reduce, all_to_all_single);
tests/test_expert_data_parallel.py checks EP x DP = 2 x 2 against one process. Run it:
`python -m snippets.scratch.expert_data_parallel_check`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from snippets.dist import DEFAULT_TIMEOUT_S
from snippets.models.gpt import GPT, GPTConfig, get_config
from snippets.scratch.ddp import make_buckets
from snippets.scratch.moe import apply_expert_parallel, is_expert_parameter, swap_mlps_for_moe
from snippets.scratch.three_d import Mesh, average_gradients, build_groups

EP, DP, EXPERTS, TOP_K = 2, 2, 4, 2
STEPS, BATCH, SEQ, AUX_WEIGHT, LR = 3, 8, 16, 0.01, 0.5
CONFIG = get_config("tiny")  # 2 layers, hidden 64: each MoE layer gets 4 SwiGLU experts


# --8<-- [start:layout]
def ep_dp_mesh(ep: int, dp: int) -> Mesh:
    """three_d's mesh with one pipeline stage and EP in TP's place, innermost: like TP it talks
    in every layer, on the critical path (the all-to-alls), so an EP group is consecutive ranks,
    one node. rank = d * ep + i; the expert-data group of EP index i is ranks i, ep + i, ..."""
    return Mesh(dp=dp, pp=1, tp=ep)


def build_ep_dp_groups(mesh: Mesh, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """This rank's groups, every one with a timeout (three_d.build_groups makes them all, on
    every rank, in the same order): "ep" moves tokens, "expert_dp" reduces expert gradients,
    "dense" (the world) averages the rest."""
    groups = build_groups(mesh, timeout_s)
    return {"ep": groups["tp"], "expert_dp": groups["dp"], "dense": dist.group.WORLD}


def layout_table(mesh: Mesh, num_experts: int) -> str:
    local = num_experts // mesh.tp
    lines = ["rank  dp ep  experts  EP group  expert-data group  dense group"]
    for r in range(mesh.size):
        c = mesh.coords(r)
        ep_group, expert_dp = (next(g for g in mesh.groups(a) if r in g) for a in ("tp", "dp"))
        experts = list(range(c["tp"] * local, (c["tp"] + 1) * local))
        lines.append(f"{r:>4}  {c['dp']:>2} {c['tp']:>2}  {str(experts):<7}  {str(ep_group):<8}"
                     f"  {str(expert_dp):<17}  {list(range(mesh.size))}")
    return "\n".join(lines)
# --8<-- [end:layout]


# --8<-- [start:parallelize]
def moe_gpt(config: GPTConfig = CONFIG) -> GPT:
    """The tiny GPT with MoE MLPs, the same everywhere (same seed). No capacity limit: every
    assignment is kept, so the all-to-all's bytes are a formula (test_moe.py tests capacity)."""
    torch.manual_seed(0)
    return swap_mlps_for_moe(GPT(config), EXPERTS, TOP_K, capacity_factor=None)


def parallelize_ep_dp(model: GPT, groups: dict) -> tuple[list, list]:
    """Keep this rank's experts (moe.py); then ddp.py's buckets, one set per reducing group (a
    bucket is one all-reduce): returns (dense buckets, expert buckets)."""
    apply_expert_parallel(model, groups["ep"])
    named = list(model.named_parameters())  # a tied weight once
    dense = nn.ParameterList(p for n, p in named if not is_expert_parameter(n))
    experts = nn.ParameterList(p for n, p in named if is_expert_parameter(n))
    return make_buckets(dense, bucket_cap_mb=25), make_buckets(experts, bucket_cap_mb=25)
# --8<-- [end:parallelize]


# --8<-- [start:sync]
def sync_gradients(dense_buckets: list, expert_buckets: list, groups: dict) -> dict:
    """Make every gradient the mean over the world's shards of the batch; returns the bytes
    this rank handed to each all-reduce. Dense: each copy saw only its rank's shard: mean over
    all ranks (ddp.py). Expert: after backward its gradient already sums its EP group's ep
    shards (the backward all-to-all brought them where the expert lives); the sum over the
    expert-data group adds the other replicas': all world shards. average_gradients divides by
    the group's size, dp: divide by ep as well."""
    sent = {"dense": average_gradients(dense_buckets, groups["dense"]),
            "experts": average_gradients(expert_buckets, groups["expert_dp"])}
    ep = dist.get_world_size(groups["ep"])
    for bucket in expert_buckets:
        for p in bucket.params:
            p.grad /= ep
    return sent
# --8<-- [end:sync]

