"""The parallel trainer: the DDP trainer's loop, with the GPT laid out over DP x PP x CP x TP.

    torchrun --nproc_per_node=8 snippets/training/parallel_trainer.py --dp 2 --tp 2 --pp 2 \\
        --model-size tiny --max-steps 20 --out runs/parallel
    ... --sp                  sequence parallelism inside each TP group
    ... --cp 2                context parallelism: ring attention over the sequence
    ... --virtual-stages 2    interleaved 1F1B: two model chunks per pipeline rank
    ... --zero 1              ZeRO-1: AdamW's state sharded over the DP replicas

Everything about the run is DistributedTrainer's (ddp_trainer.py): the flags, the data, AdamW,
the lr schedule, train_step, the checkpoint manager and the run protocol (resume, refuse to
overwrite). This file overrides the seams where a layout differs:

* `_wrap_model`: apply the layout (scratch/parallelize.py) and keep this rank's stage(s);
* `forward_backward`: the pipeline schedule over the step's micro-batches (one stage, 1F1B, is
  the degenerate pipeline: dp-only and tp-only runs take the same path), then the gradients
  averaged over DP and CP;
* `clip_gradients`: one global norm, every number counted once;
* checkpoints: the plain model's full state, gathered and written by rank 0, so a run saved at
  one layout resumes at another.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from snippets.data.corpus import DataError
from snippets.dist import run_main
from snippets.machine import DeviceError
from snippets.flags import error_exit, int_at_least
from snippets.library.parallel_trainer import LibraryParts
from snippets.models.gpt import GPT, ConfigError, get_config, shift_for_next_token
from snippets.scratch.ddp import make_buckets
from snippets.scratch.parallelize import (Layout, counted_in_norm, gradient_groups,
                                          local_parameters, local_tokens, loss_function,
                                          parallelize, shard_dims)
from snippets.scratch.pipeline import one_f_one_b_schedule, run_schedule, sync_tied_embedding_grads
from snippets.scratch.pipeline_interleaved import interleaved_schedule, run_interleaved
from snippets.scratch.three_d import average_gradients, build_groups
from snippets.scratch.zero import ShardedOptimizer
from snippets.training.checkpoint import (CheckpointError, CheckpointManager, capture_rng_state,
                                          config_diff, restore_rng_state)
from snippets.training.checkpoint import load_checkpoint as load_verified
from snippets.training.checkpoint import save_checkpoint as save_atomic
from snippets.training.ddp_trainer import (DistributedTrainer, TrainConfig, build_parser,
                                           check_args, pick_trainer_device, resume_or_start,
                                           save_step, train, train_config_from_args)


class ParallelTrainer(DistributedTrainer):
    """DistributedTrainer on one rank of a DP x PP x CP x TP layout, from scratch parts."""

    # --8<-- [start:init]
    def __init__(self, model_config, train_config: TrainConfig, layout: Layout,
                 device: str | torch.device = "cpu"):
        self.layout = layout  # read by _wrap_model, which the base __init__ calls
        self.rank_log = None  # a file for this rank's per-step records (main sets it)
        seq_len = train_config.seq_len or model_config.max_position_embeddings
        layout.check(model_config, seq_len, int(os.environ.get("WORLD_SIZE", 1)))
        if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
            # `python parallel_trainer.py`, no launcher: a group of one, so that the same code
            # (groups, collectives) runs; every collective over one rank returns at once.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        super().__init__(model_config, train_config, device)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        mesh = self.layout.mesh()
        self.coords = mesh.coords(self.rank)
        self.groups = build_groups(mesh)  # every rank creates every group, in the same order
        self.chunks = parallelize(model, self.layout, self.groups, self.coords)
        self.shard_dims = shard_dims(self.chunks)
        self.grad_groups = gradient_groups(self.layout, self.groups)
        self.loss_fn = loss_function(self.layout, self.groups["tp"])
        local = nn.ModuleDict({str(c): stage for c, stage in self.chunks.items()})
        self.raw_model = local  # what the optimizer and the checkpoints see: this rank's part
        self.buckets = make_buckets(local, bucket_cap_mb=25)
        return local

    def _setup_optimizer(self):
        """DistributedTrainer's AdamW over this rank's parameters; with --zero 1 the same
        AdamW, its state sharded over the DP replicas (scratch/zero.py)."""
        optimizer = super()._setup_optimizer()
        if self.layout.zero == 1:
            return ShardedOptimizer(optimizer, self.groups["dp"])
        return optimizer

    @property
    def replicas(self) -> int:  # each DP replica takes its own rows of the global batch
        return self.layout.dp

    @property
    def replica(self) -> int:
        return self.coords["dp"]
    # --8<-- [end:init]

    # --8<-- [start:forward-backward]
    def forward_backward(self, batch_iter) -> tuple[float, int]:
        """The step's grad_accum_steps micro-batches, as pipeline micro-batches, through this
        rank's stage(s); then the gradients averaged over DP and CP."""
        layout, m, p = self.layout, self.train_config.grad_accum_steps, self.coords["pp"]
        pairs = [local_tokens(*shift_for_next_token(next(batch_iter).to(self.device)),
                              layout, self.coords) for _ in range(m)]
        inputs, targets = [list(t) for t in zip(*pairs)]
        shape = (*inputs[0].shape, self.config.hidden_size)  # what travels between stages
        if layout.virtual_stages == 1:
            actions = one_f_one_b_schedule(m, p, layout.pp)
            loss, self.trace = run_schedule(self.chunks[p], actions, p, layout.pp, inputs,
                                            targets, self.loss_fn, shape,
                                            group=self.groups["pp"])
            sync_tied_embedding_grads(self.chunks[p], p, layout.pp, group=self.groups["pp"])
        else:
            actions = interleaved_schedule(m, p, layout.pp, layout.virtual_stages)
            loss, self.trace = run_interleaved(self.chunks, actions, p, layout.pp, inputs,
                                               targets, self.loss_fn, shape,
                                               group=self.groups["pp"])
            tied_holder = self.chunks[min(self.chunks) if p == 0 else max(self.chunks)]
            sync_tied_embedding_grads(tied_holder, p, layout.pp, group=self.groups["pp"])
        for group in self.grad_groups:
            average_gradients(self.buckets, group)
        return self.mean_loss(loss), m * inputs[0].shape[0] * self.seq_len * layout.dp

    def mean_loss(self, loss: float | None) -> float:
        """The global batch's loss, on every rank: the last stage's, averaged over DP and CP.
        All tp ranks of a last stage hold the same value, so the world's sum counts it tp
        times."""
        total = torch.tensor(0.0 if loss is None else loss, dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(total)
        return total.item() / (self.layout.dp * self.layout.cp * self.layout.tp)
    # --8<-- [end:forward-backward]

    # --8<-- [start:clip]
    def clip_gradients(self) -> float:
        """clip_grad_norm_ over the whole model: this rank's share of the squared norm, summed
        over the TP and PP groups (DP and CP replicas hold the same averaged gradients)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, param in local_parameters(self.chunks):
            if param.grad is not None and counted_in_norm(
                    name, self.shard_dims, self.chunks, self.coords,
                    self.config.tie_word_embeddings):
                squares += param.grad.float().pow(2).sum()
        for axis in ("tp", "pp"):
            dist.all_reduce(squares, group=self.groups[axis])
        norm = squares.sqrt()
        max_norm = self.train_config.grad_clip
        if max_norm > 0:  # the same rule as torch.nn.utils.clip_grad_norm_
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for _, param in local_parameters(self.chunks):
                if param.grad is not None:
                    param.grad.mul_(scale)
        return norm.item()
    # --8<-- [end:clip]

    # --8<-- [start:checkpoint]
    def full_state(self) -> dict | None:
        """The plain model's state_dict and AdamW's moments under the same names, rebuilt on
        rank 0 from replica 0's shards (None elsewhere): TP shards concatenated along the
        dimension they were cut, the stages merged."""
        mine, states = {}, self.optimizer_state()
        if self.coords["dp"] == 0 and self.coords["cp"] == 0:
            for name, param in local_parameters(self.chunks):
                moments = states.get(param, {})
                mine[name] = {"param": param.detach().cpu(), "tp": self.coords["tp"],
                              "dim": self.shard_dims.get(name),
                              **{k: v.cpu() for k, v in moments.items()}}
        every = [None] * self.world_size if self.is_main else None
        dist.gather_object(mine, every, dst=0)
        if not self.is_main:
            return None
        full = {}
        for rank_state in every:
            for name, entry in rank_state.items():
                full.setdefault(name, {})[entry.pop("tp")] = entry
        state = {}
        for key in ("param", "exp_avg", "exp_avg_sq"):
            state[key] = {}
            for name, shards in full.items():
                if key not in shards[0]:
                    continue
                parts = [shards[t][key] for t in sorted(shards)]
                dim = shards[0]["dim"]  # known to the rank that holds it
                state[key][name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
        if self.config.tie_word_embeddings:  # one tensor, both names, as GPT.state_dict()
            for key in state:
                if "embed_tokens.weight" in state[key]:
                    state[key].setdefault("lm_head.weight", state[key]["embed_tokens.weight"])
        steps = [shards[0]["step"] for shards in full.values() if "step" in shards[0]]
        state["adam_step"] = steps[0] if steps else None
        return state

    def optimizer_state(self) -> dict:
        """{parameter: its optimizer state}: AdamW's own, or with --zero 1 the DP shards'
        gathered (a collective over the DP group)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.full_state()
        return self.optimizer.state

    def one_process_order(self) -> tuple[list[str], list[dict]]:
        """The plain model's parameter names in the order a one-process DistributedTrainer's
        AdamW lists them (the indices of its state_dict()), and its param_groups. Written in
        that layout, a checkpoint loads in either trainer: train on one process, continue on
        eight, and back. The order comes from the same _setup_optimizer, run on a model with
        no storage (the meta device)."""
        with torch.device("meta"):
            plain = GPT(self.config)
        one_process = SimpleNamespace(raw_model=plain, train_config=self.train_config,
                                      log=lambda message: None)
        optimizer = DistributedTrainer._setup_optimizer(one_process)
        names = {id(param): name for name, param in plain.named_parameters()}
        order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
        return order, optimizer.state_dict()["param_groups"]

    def save_checkpoint_once(self, path: str | Path) -> None:
        """Every rank sends its shards (a collective); rank 0 writes one file, in the layout of
        DistributedTrainer.save_checkpoint; all wait."""
        full = self.full_state()
        if self.is_main:
            order, param_groups = self.one_process_order()
            moments = {i: {"step": full["adam_step"].clone(), "exp_avg": full["exp_avg"][name],
                           "exp_avg_sq": full["exp_avg_sq"][name]}
                       for i, name in enumerate(order) if name in full["exp_avg"]}
            save_atomic(path, {
                "model": full["param"],
                "optimizer": {"state": moments, "param_groups": param_groups},
                "step": self.step, "sampler": self.sampler.state_dict(),
                "rng": capture_rng_state(), "model_config": self.config.to_dict(),
                "train_config": asdict(self.train_config), "layout": asdict(self.layout)})
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> dict:
        """Take this rank's slices of the full state: a file from any layout, or from
        DistributedTrainer, loads at any layout."""
        state = load_verified(path, map_location="cpu")
        if diff := config_diff(state["model_config"], self.config.to_dict()):
            raise CheckpointError(f"{path} holds a different model (checkpoint -> now: {diff}); "
                                  "use the --model-size it was trained with")
        order, _ = self.one_process_order()
        moments = {order[i]: entry for i, entry in state["optimizer"]["state"].items()}
        states = {}
        for name, param in local_parameters(self.chunks):
            param.data.copy_(self.my_slice(name, state["model"][name]))
            # the output head of a later stage is the tied embedding: its moments are those
            owner = "embed_tokens.weight" if name not in order else name
            if owner in moments:
                states[param] = {
                    "step": moments[owner]["step"].clone(),
                    "exp_avg": self.my_slice(name, moments[owner]["exp_avg"]).clone(),
                    "exp_avg_sq": self.my_slice(name, moments[owner]["exp_avg_sq"]).clone()}
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.load_full_state(states)  # this DP rank's slices of them
        else:
            self.optimizer.state.update(states)
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        self.step = state["step"]
        return state

    def my_slice(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = self.shard_dims.get(name)
        part = full if dim is None else full.chunk(self.layout.tp, dim=dim)[self.coords["tp"]]
        return part.to(self.device)
    # --8<-- [end:checkpoint]

    # --8<-- [start:logs]
    def train_step(self, batch_iter) -> dict:
        """DistributedTrainer.train_step, and this rank's line in its own log: the step's time,
        its peak memory and what its stage did when (the pipeline's F and B, in seconds from
        the step's start; perf_counter is one clock for every process on a machine)."""
        start = time.perf_counter()
        stats = super().train_step(batch_iter)
        if self.rank_log is not None:
            record = {"step": self.step, "loss": stats["loss"], "coords": self.coords,
                      "seconds": time.perf_counter() - start, "start": start,
                      "peak_mib": round(self.peak_memory_mib(), 1),
                      "events": [(kind, micro, t0 - start, t1 - start)
                                 for kind, micro, t0, t1 in self.trace.events]}
            with open(self.rank_log, "a") as f:  # appended: a resumed run adds its steps
                f.write(json.dumps(record) + "\n")
        return stats

    def peak_memory_mib(self) -> float:
        """This rank's peak memory: allocated on a GPU, resident on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, B on macOS
        return rss / (2**20 if sys.platform == "darwin" else 2**10)

    def parameters_here(self) -> int:
        return sum(p.numel() for _, p in local_parameters(self.chunks))

    def optimizer_values_here(self) -> int:
        """How many numbers this rank's optimizer keeps: AdamW's two moments for every value
        it steps; with --zero 1, for this DP rank's shard only."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # ShardedOptimizer's
        tensors = [t for state in inner.state.values() for t in state.values() if t.dim() > 0]
        # --library: FSDP2's moments are DTensors, whose numel() is the whole tensor's
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)

    def per_rank(self, value) -> list:
        every = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every
    # --8<-- [end:logs]


class LibraryParallelTrainer(LibraryParts, ParallelTrainer):
    """ParallelTrainer with PyTorch's parts at the same seams (library/parallel_trainer.py):
    DeviceMesh, DTensor TP, FSDP2 and torch.distributed.pipelining."""


def parse_args(argv: list[str] | None = None):
    p = build_parser("Train a GPT over DP x PP x CP x TP with the course's scratch parts.",
                     "runs/parallel_trainer")
    for axis, what in (("dp", "data-parallel replicas"), ("tp", "tensor-parallel ranks"),
                       ("pp", "pipeline stages"), ("cp", "context-parallel ranks (ring)")):
        p.add_flag(axis, type=int_at_least(1), default=1, help=what)
    p.add_flag("sp", action="store_true", help="sequence parallelism in the TP groups")
    p.add_flag("virtual-stages", type=int_at_least(1), default=1,
               help="model chunks per pipeline rank (interleaved 1F1B when > 1)")
    p.add_flag("zero", type=int_at_least(0), default=0,
               help="1: shard AdamW's state over the DP replicas (ZeRO-1); ZeRO-3 is "
                    "--library's FSDP2")
    p.add_flag("library", action="store_true",
               help="PyTorch's parts (DeviceMesh, DTensor TP, FSDP2, pipelining) instead of "
                    "the scratch ones; dp, tp and pp only")
    return check_args(p, p.parse_args(argv))


# --8<-- [start:main]
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    manager = CheckpointManager(args.out, keep_last=args.keep_last)
    try:
        device, device_note = pick_trainer_device(args.device)
        layout = Layout(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, sp=args.sp,
                        virtual_stages=args.virtual_stages, zero=args.zero)
        trainer_class = LibraryParallelTrainer if args.library else ParallelTrainer
        trainer = trainer_class(get_config(args.model_size), train_config_from_args(args),
                                layout, device)
        resume_or_start(trainer, manager, args, load=trainer.load_checkpoint)
    except (ConfigError, DataError, CheckpointError, DeviceError) as err:
        return error_exit(err)
    tc, c = trainer.train_config, trainer.coords
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    trainer.rank_log = logs / f"rank-{trainer.rank}.jsonl"
    if args.overwrite:  # the run it replaces was this one's: its logs go with its checkpoints
        trainer.rank_log.write_text("")
    if device_note:
        trainer.log(device_note)
    print(f"rank {trainer.rank}: dp {c['dp']} pp {c['pp']} cp {c['cp']} tp {c['tp']} | "
          f"{trainer.parameters_here():,} parameters here",
          flush=True)
    trainer.log(f"layout dp {layout.dp} x pp {layout.pp} x cp {layout.cp} x tp {layout.tp}"
                f"{' + sp' if layout.sp else ''}, {layout.virtual_stages} chunk(s) per stage"
                f"{', ZeRO-1 over dp' if layout.zero else ''} | "
                f"{trainer.tokens_per_step:,} tokens per step ({tc.grad_accum_steps} "
                f"micro-batches of {tc.batch_size} per replica; "
                f"{'library' if args.library else 'scratch'} parts)")
    status = train(trainer, args, save=lambda: save_step(trainer, manager))
    memory = trainer.per_rank(round(trainer.peak_memory_mib(), 1))
    values = trainer.per_rank(trainer.optimizer_values_here())
    trainer.log(f"optimizer state per rank (values): {' | '.join(f'{v:,}' for v in values)}")
    trainer.log(f"peak memory per rank (MiB): {memory} | per-rank logs in {logs}")
    trainer.leave()
    return status
# --8<-- [end:main]


if __name__ == "__main__":
    run_main(main)
