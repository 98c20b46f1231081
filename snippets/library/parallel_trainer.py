"""The parallel trainer's seams with PyTorch's own parts: DeviceMesh, DTensor TP, FSDP2, pipelining.

training/parallel_trainer.py lays the GPT out over DP x TP x PP with the course's scratch parts.
`LibraryParts` overrides the same seams with the parts of library/three_d.py, and keeps
everything else of ParallelTrainer: the flags, the data, AdamW, the run protocol, the per-rank
logs and the one checkpoint layout (a file written here loads in the scratch trainer, in
DistributedTrainer in one process, and back). What each seam uses:

* `_wrap_model`: `parallelize_3d` (one `init_device_mesh`, `parallelize_module` with the block
  plan, `fully_shard` over mesh["dp"], a `PipelineStage` driven by `Schedule1F1B`);
* `forward_backward`: the schedule's step on this DP replica's grad_accum_steps micro-batches;
  FSDP2 reduce-scatters the gradients over DP inside it, so nothing is left to average;
* `clip_gradients`: TorchTitan's rule: the norm of the DTensor gradients (one reduction per
  mesh they live on), then the squares summed over the pipeline stages, which no mesh spans;
* checkpoints: `get_model_state_dict` / `get_optimizer_state_dict` with full_state_dict=True
  gather each stage; rank 0 merges the stages; `set_model_state_dict` /
  `set_optimizer_state_dict` cut a full state back into this rank's DTensor shards.

It is a mixin, not a subclass, so that training/parallel_trainer.py can import it (the course's
modules import each other in one direction only): there, the library trainer is

    class LibraryParallelTrainer(LibraryParts, ParallelTrainer): ...

and `--library` picks it. Sequence and context parallelism and interleaved stages are
scratch-only for now.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from snippets.dist import DEFAULT_TIMEOUT_S
from snippets.library.pipeline import torch_pipeline_train_step
from snippets.library.three_d import parallelize_3d
from snippets.models.gpt import ConfigError
from snippets.training.checkpoint import CheckpointError, config_diff, restore_rng_state
from snippets.training.checkpoint import load_checkpoint as load_verified

FULL = StateDictOptions(full_state_dict=True)  # whole tensors, not this rank's shards


def check_library_layout(layout, micro_batches: int) -> None:
    """What the library parts do not cover yet, each a one-line error naming the fix."""
    scratch_only = [flag for flag, used in (("--cp", layout.cp > 1), ("--sp", layout.sp),
                                            ("--virtual-stages", layout.virtual_stages > 1),
                                            ("--zero", layout.zero > 0))
                    if used]
    if scratch_only:
        raise ConfigError(f"{', '.join(scratch_only)} with --library: sequence and context "
                          "parallelism, interleaved stages and the scratch ZeRO-1 are "
                          "scratch-only (--library's FSDP2 shards everything over DP "
                          "already); drop --library, or drop those flags")
    if micro_batches < layout.pp:
        raise ConfigError(f"--library runs torch's Schedule1F1B, which needs at least as many "
                          f"micro-batches as stages: --grad-accum-steps {micro_batches} < --pp "
                          f"{layout.pp}; use --grad-accum-steps {layout.pp} or more")


class LibraryParts:
    """ParallelTrainer's seams with the library's parts; mixed in before ParallelTrainer."""

    # --8<-- [start:init]
    def __init__(self, model_config, train_config, layout, device="cpu"):
        check_library_layout(layout, train_config.grad_accum_steps)  # before any process talks
        super().__init__(model_config, train_config, layout, device)

    def _wrap_model(self, model):
        layout = self.layout
        self.mesh, module, self.schedule = parallelize_3d(
            model, layout.pp, layout.dp, layout.tp, self.train_config.grad_accum_steps,
            self.device.type)
        # A gradient norm over the blocks' (dp, tp) shards: one all-reduce over the flattened
        # pair instead of one per axis (TorchTitan flattens its meshes the same way).
        dp_tp = self.mesh["dp", "tp"]._flatten("dp_tp")
        # DeviceMesh creates its groups with the backend's default timeout (30 min for gloo):
        # a dead peer would hang the run for that long. The course's is one minute.
        for group in (*(self.mesh[axis].get_group() for axis in ("pp", "dp", "tp")),
                      dp_tp.get_group()):
            _set_pg_timeout(timedelta(seconds=DEFAULT_TIMEOUT_S), group)
        self.coords = {axis: self.mesh[axis].get_local_rank() for axis in ("dp", "pp", "tp")}
        self.coords["cp"] = 0
        self.chunks = {self.coords["pp"]: module}
        self.trace = SimpleNamespace(events=[])  # torch's schedule keeps no timeline to log
        self.raw_model = module  # the optimizer and the checkpoints see this rank's stage
        return module

    def parameters_here(self) -> int:
        return sum(param.to_local().numel() for param in self.model.parameters())
    # --8<-- [end:init]

    # --8<-- [start:forward-backward]
    def forward_backward(self, batch_iter) -> tuple[float, int]:
        """The step's micro-batches, stacked into this replica's batch: the schedule cuts it
        back into the same grad_accum_steps pieces, each loss divided by their number."""
        m, layout = self.train_config.grad_accum_steps, self.layout
        tokens = torch.cat([next(batch_iter) for _ in range(m)]).to(self.device)
        loss = torch_pipeline_train_step(self.model, self.schedule, tokens, self.coords["pp"],
                                         layout.pp, group=self.mesh["pp"].get_group())
        return self.mean_loss(loss), tokens.shape[0] * self.seq_len * layout.dp
    # --8<-- [end:forward-backward]

    # --8<-- [start:clip]
    def clip_gradients(self) -> float:
        """The global norm, as TorchTitan's clip_grad_norm_ with a pp_mesh computes it. A DTensor
        gradient's norm reduces over the mesh it lives on (TP and FSDP's DP shards); the blocks'
        matrices live on the (dp, tp) mesh, the rest on dp alone, so one norm per mesh. No mesh
        spans the stages: their squares are summed over the pp group. The last stage's output
        head is the tied embedding, counted on the first."""
        tied = self.config.tie_word_embeddings and self.layout.pp > 1
        by_mesh = {}  # mesh -> (parameters, the gradients counted in the norm)
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                params, grads = by_mesh.setdefault(param.grad.device_mesh, ([], []))
                params.append(param)
                if not (tied and name == "lm_head.weight"):
                    grads.append(param.grad)
        squares = torch.zeros((), device=self.device)
        for _, grads in by_mesh.values():
            squares += get_total_norm(grads).full_tensor() ** 2
        dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        norm = squares.sqrt()
        if self.train_config.grad_clip > 0:  # the same rule as ParallelTrainer's
            for params, _ in by_mesh.values():  # DTensors of one mesh at a time
                clip_grads_with_norm_(params, self.train_config.grad_clip, norm)
        return norm.item()
    # --8<-- [end:clip]

    # --8<-- [start:checkpoint]
    def full_state(self) -> dict | None:
        """ParallelTrainer.full_state's result, from the library: every rank of a stage gathers
        the stage's whole weights and moments (collectives over its dp and tp groups); one rank
        per stage sends them to rank 0, which merges the stages (None elsewhere)."""
        weights = get_model_state_dict(self.model, options=FULL)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        mine = {}
        if self.coords["dp"] == 0 and self.coords["tp"] == 0:
            moments = optimizer["state"]  # AdamW's, by name; none under another optimizer
            mine = {"param": {name: t.cpu() for name, t in weights.items()},
                    **{key: {name: entry[key].cpu() for name, entry in moments.items()
                             if key in entry} for key in ("exp_avg", "exp_avg_sq")},
                    "adam_step": next((entry["step"].cpu() for entry in moments.values()
                                       if "step" in entry), None)}
        every = [None] * self.world_size if self.is_main else None
        dist.gather_object(mine, every, dst=0)
        if not self.is_main:
            return None
        state = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}, "adam_step": None}
        for stage in filter(None, every):
            for key in ("param", "exp_avg", "exp_avg_sq"):
                state[key].update(stage[key])
            if state["adam_step"] is None:
                state["adam_step"] = stage["adam_step"]
        if self.config.tie_word_embeddings:  # one tensor, both names, as GPT.state_dict()
            state["param"].setdefault("lm_head.weight", state["param"]["embed_tokens.weight"])
        return state

    def load_checkpoint(self, path) -> dict:
        """A file from any layout, scratch or library, or from DistributedTrainer: this stage's
        entries, cut into this rank's shards by the library."""
        state = load_verified(path, map_location="cpu")
        if diff := config_diff(state["model_config"], self.config.to_dict()):
            raise CheckpointError(f"{path} holds a different model (checkpoint -> now: {diff}); "
                                  "use the --model-size it was trained with")
        mine = self.model.state_dict().keys()
        set_model_state_dict(self.model, {name: state["model"][name] for name in mine},
                             options=FULL)
        order, _ = self.one_process_order()
        moments = {order[i]: entry for i, entry in state["optimizer"]["state"].items()}
        names = {id(param): name for name, param in self.model.named_parameters()}
        groups = [{**saved, "params": [names[id(param)] for param in group["params"]]}
                  for saved, group in zip(state["optimizer"]["param_groups"],
                                          self.optimizer.param_groups)]
        # the output head of a later stage is the tied embedding: its moments are those
        owner = {name: "embed_tokens.weight" if name not in order else name
                 for name in names.values()}
        set_optimizer_state_dict(self.model, self.optimizer, options=FULL, optim_state_dict={
            "state": {name: moments[owner[name]] for name in names.values()
                      if owner[name] in moments},
            "param_groups": groups})
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        self.step = state["step"]
        return state
    # --8<-- [end:checkpoint]
