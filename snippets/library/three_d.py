"""3-D parallelism with PyTorch's own parts: one DeviceMesh, FSDP2, DTensor TP and pipelining.

The library counterpart of snippets/scratch/three_d.py, with the same training (tiny GPT, one
layer per stage, SGD with momentum, the same batches) so that both can be checked against one
process. What the scratch version builds by hand, the libraries provide:

- the groups: `init_device_mesh(..., ("pp", "dp", "tp"))`, one call, and `mesh["tp"]`,
  `mesh["dp"]`, `mesh["pp"]` are its 1-D slices (scratch: `Mesh` and `build_groups`);
- TP: `parallelize_module` with the plan of snippets/library/tensor_parallel.py (scratch:
  `apply_tensor_parallel`);
- DP: `fully_shard` over `mesh["dp"]`, which shards each block over the data-parallel ranks of
  its stage and TP shard, and reduce-scatters its gradients among exactly those (scratch:
  replicated weights and `average_gradients` over the DP group);
- PP: `PipelineStage` over `mesh["pp"]` and `Schedule1F1B` (scratch: `pipeline_train_step`
  with `one_f_one_b_schedule`).

The order of the mesh's dimensions is TorchTitan's: PP outermost, TP innermost.

    python -m snippets.library.three_d     # PP x DP x TP = 2 x 2 x 2 on 8 CPU processes
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import parallelize_module

from snippets.models.gpt import GPT, get_config
from snippets.library.pipeline import torch_pipeline_train_step
from snippets.library.tensor_parallel import block_plan, full_weights
from snippets.scratch.pipeline import cross_entropy, split_into_stages
from snippets.scratch.reference import single_process
from snippets.scratch.tensor_parallel import check_tensor_parallel_sizes
from snippets.flags import Parser


# --8<-- [start:parallelize]
def parallelize_3d(model: GPT, pp: int, dp: int, tp: int, micro_batches: int,
                   device_type: str = "cpu"):
    """This rank's pipeline stage of `model`, TP-sharded and FSDP-sharded, and a 1F1B schedule
    that drives it. Returns (mesh, stage module, schedule)."""
    check_tensor_parallel_sizes(model.config, tp)
    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage_index = mesh["pp"].get_local_rank()
    module = split_into_stages(model, pp)[stage_index]
    for block in module.layers.values():
        parallelize_module(block, mesh["tp"], block_plan())  # TP first, then FSDP shards the shards
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])  # the embedding, norm and head left over
    stage = PipelineStage(module, stage_index, pp, torch.device(device_type),
                          group=mesh["pp"].get_group())

    def loss_fn(logits, targets):  # the mean over micro-batches, as in library/pipeline.py
        return cross_entropy(logits, targets) / micro_batches

    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=loss_fn,
                            scale_grads=False)
    return mesh, module, schedule
# --8<-- [end:parallelize]


# --8<-- [start:train]
def train_3d(rank: int, world_size: int, pp: int, dp: int, tp: int, steps: int, batch_size: int,
             seq_len: int, micro_batches: int) -> dict:
    """scratch/reference.py's single_process training, spread over a pp x dp x tp mesh. Each DP
    rank takes its 1/dp of every global batch; the TP ranks of a replica take the same."""
    torch.manual_seed(0)  # the same initial weights as single_process
    model = GPT(get_config("tiny", num_hidden_layers=pp))
    mesh, module, schedule = parallelize_3d(model, pp, dp, tp, micro_batches)
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)  # the same global batches on every rank
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq_len + 1), generator=g)
        losses.append(torch_pipeline_train_step(module, schedule, tokens.chunk(dp)[dp_rank],
                                                stage_index, pp, group=mesh["pp"].get_group()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    q = next(iter(module.layers.values())).self_attn.q_proj.weight
    return {"coordinate": mesh.get_coordinate(), "losses": losses,
            "q_placements": tuple(str(p) for p in q.placements), "q_mesh": q.device_mesh.mesh_dim_names,
            "q_local": tuple(q.to_local().shape), "weights": full_weights(module)}
# --8<-- [end:train]


# --8<-- [start:demo]
PP, DP, TP = 2, 2, 2
STEPS, BATCH, SEQ, MICRO_BATCHES = 3, 8, 16, 2  # scratch/three_d_check.py's run


def main(argv: list[str] | None = None) -> None:
    from snippets.dist import spawn
    from snippets.scratch.three_d_check import tolerance

    # No flags: one given by mistake is refused, not silently ignored.
    Parser(description=__doc__.splitlines()[0]).parse_args(argv)
    ranks = spawn(train_3d, PP * DP * TP, PP, DP, TP, STEPS, BATCH, SEQ, MICRO_BATCHES,
                  timeout_s=120)
    reference, ref_losses = single_process(STEPS, BATCH, SEQ, num_layers=PP)
    config = get_config("tiny", num_hidden_layers=PP)
    torch.manual_seed(0)
    init = GPT(config).state_dict()
    moved = max((reference[k] - init[k]).abs().max().item() for k in reference)
    print(f"PP x DP x TP = {PP} x {DP} x {TP}: rank -> (pp, dp, tp) "
          + ", ".join(f"{r}->{tuple(x['coordinate'])}" for r, x in enumerate(ranks)))
    q = ranks[0]
    print(f"layer 0's q_proj on rank 0: {q['q_placements']} over mesh {q['q_mesh']}, "
          f"local shard {q['q_local']} of {tuple(reference['layers.0.self_attn.q_proj.weight'].shape)}")
    last = [x for x in ranks if x["losses"][0] is not None]
    for step, ref in enumerate(ref_losses):
        loss = sum(x["losses"][step] for x in last) / len(last)  # the DP replicas' mean
        print(f"step {step}: loss {loss:.4f}, one process {ref:.4f}, "
              f"|diff| < bound: {abs(loss - ref) < tolerance(config, BATCH, SEQ, ref)}")
    worst = max((x["weights"][k] - reference[k]).abs().max().item()
                for x in ranks for k in x["weights"])
    bound = tolerance(config, BATCH, SEQ, moved)
    print(f"weights after {STEPS} steps, every rank's stage gathered: max |diff| < bound "
          f"({bound:.0e}): {worst < bound}")
# --8<-- [end:demo]


if __name__ == "__main__":
    main()
