"""The learning guide's trainer, fully sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`).

    torchrun --nproc_per_node=2 snippets/training/fsdp_trainer.py --model-size medium --max-steps 50
    torchrun --nproc_per_node=4 snippets/training/fsdp_trainer.py --sharding-strategy HYBRID_SHARD \
        --shard-group-size 2 --model-size tiny --max-steps 20

`FSDPTrainer` is ddp_trainer's `DistributedTrainer` with a different answer to one question: how
is the model spread over the processes? The optimizer groups, the learning-rate schedule, the
training step with accumulation and clipping, and the data all come from ddp_trainer unchanged;
this file only replaces the DDP seams. Its four exercises:

* `_get_sharding_strategy()`      (exercise 12): FULL_SHARD / SHARD_GRAD_OP / NO_SHARD /
  HYBRID_SHARD as FSDP2 expresses them, a device mesh and `reshard_after_forward`.
* `_get_mixed_precision_policy()` (exercise 13): bf16 / fp16 / fp32 compute, gradients reduced
  in fp32.
* `_get_fsdp_policy()`            (exercise 14): one FSDP unit per transformer block, then the root.
* `save_checkpoint()`             (exercise 15): gather the shards into one full state dict on
  rank 0 and write it atomically. `save_sharded_checkpoint()` writes the shards as they are,
  with torch.distributed.checkpoint (DCP).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from snippets.data.corpus import DataError
from snippets.dist import init_mesh
from snippets.machine import DeviceError
from snippets.models.gpt import Block, ConfigError, GPTConfig, get_config
from snippets.training.checkpoint import (CheckpointError, CheckpointManager,
                                          CorruptCheckpointError, capture_rng_state,
                                          config_diff, restore_rng_state)
from snippets.training.checkpoint import fsync_dir
from snippets.training.checkpoint import load_checkpoint as load_verified
from snippets.training.checkpoint import save_checkpoint as save_atomic
from snippets.training.ddp_trainer import (DistributedTrainer, TrainConfig, build_parser,
                                          check_args, pick_trainer_device, resume_or_start,
                                          save_step, train, train_config_from_args)
from snippets.flags import error_exit, int_at_least

# --8<-- [start:fsdp-config]
SHARDING_STRATEGIES = {
    # name (FSDP1's, used by the guide and by most configs you will read): what it keeps whole
    "FULL_SHARD": "ZeRO-3: parameters, gradients and optimizer states sharded over all ranks",
    "SHARD_GRAD_OP": "ZeRO-2: gradients and optimizer states sharded; parameters stay "
                     "gathered from forward to backward",
    "NO_SHARD": "DDP: every rank holds everything; gradients are all-reduced",
    "HYBRID_SHARD": "HSDP: FULL_SHARD inside each group of shard_group_size ranks (a node), "
                    "replicated across the groups",
}
MIXED_PRECISION = ("bf16", "fp16", "fp32")


@dataclass
class FSDPConfig:
    """How to shard; what to train and how long lives in TrainConfig."""

    sharding_strategy: str = "FULL_SHARD"
    mixed_precision: str = "fp32"         # the dtype forward and backward compute in
    cpu_offload: bool = False             # keep shards, gradients and the AdamW step on the CPU
    shard_group_size: int | None = None   # HYBRID_SHARD: ranks per shard group; None = a node
                                          # (torchrun's LOCAL_WORLD_SIZE)

    def __post_init__(self):
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ConfigError(f"sharding_strategy={self.sharding_strategy!r} is not one of "
                              f"{', '.join(SHARDING_STRATEGIES)}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(f"mixed_precision={self.mixed_precision!r} is not one of "
                              f"{', '.join(MIXED_PRECISION)}")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise ConfigError(f"shard_group_size={self.shard_group_size} must be at least 1")
# --8<-- [end:fsdp-config]


class FSDPTrainer(DistributedTrainer):
    """DistributedTrainer whose model is sharded with FSDP2 instead of replicated with DDP."""

    # --8<-- [start:trainer-init]
    def __init__(self, model_config: GPTConfig, train_config: TrainConfig,
                 fsdp_config: FSDPConfig | None = None, device: str | torch.device = "cpu"):
        self.fsdp_config = fsdp_config or FSDPConfig()
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ConfigError(f"FSDP runs on cpu (gloo) or cuda (nccl), not {device}: "
                              "use --device cpu")
        if self.fsdp_config.mixed_precision == "fp16":
            # fp16 gradients below 6e-8 round to 0: it needs a loss scaler (GradScaler), and
            # DistributedTrainer.train_step has none. bf16 has fp32's exponent range: no scaler.
            raise ConfigError("mixed_precision='fp16' needs loss scaling, which this trainer "
                              "does not do; use bf16 (same range as fp32) or fp32")
        # The parent builds the model on every rank, calls _wrap_model (here: fully_shard),
        # then builds AdamW over the now-sharded parameters: each rank's optimizer holds
        # moments for its own shards only. That is ZeRO's optimizer-state sharding, for free.
        super().__init__(model_config, train_config, device)
    # --8<-- [end:trainer-init]

    @property
    def shard_group_size(self) -> int:
        """Ranks that split one copy of the model between them (HYBRID_SHARD)."""
        if self.fsdp_config.shard_group_size is not None:
            return self.fsdp_config.shard_group_size
        # torchrun sets LOCAL_WORLD_SIZE to the processes on this machine: shard within a node.
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def _device_mesh(self, replicas: int, shards: int) -> DeviceMesh:
        """A 1-D mesh over all ranks, or a 2-D (replicate, shard) mesh: ranks r*shards ...
        (r+1)*shards - 1 shard one copy, and the same position in every group holds the same
        shard (its replicas)."""
        if replicas == 1:
            return init_mesh(self.device.type, (shards,), ("shard",))
        return init_mesh(self.device.type, (replicas, shards), ("replicate", "shard"))

    # --8<-- [start:sharding-strategy]
    def _get_sharding_strategy(self) -> dict:
        """fully_shard's `mesh` and `reshard_after_forward` for the configured strategy."""
        # --8<-- [start:exercise-12]
        ranks, group = self.world_size, self.shard_group_size
        # name -> (replicas, ranks sharing one replica, free the gathered parameters after
        # forward and gather them again in backward?)
        layouts = {
            "FULL_SHARD": (1, ranks, True),               # ZeRO-3: least memory
            "SHARD_GRAD_OP": (1, ranks, False),           # ZeRO-2: no second all-gather
            "NO_SHARD": (ranks, 1, False),                # DDP: all-reduce, nothing sharded
            "HYBRID_SHARD": (ranks // group, group, True),  # ZeRO-3 in a node, DDP across
        }
        replicas, shards, reshard = layouts[self.fsdp_config.sharding_strategy]
        return {"mesh": self._device_mesh(replicas, shards), "reshard_after_forward": reshard}
        # --8<-- [end:exercise-12]
    # --8<-- [end:sharding-strategy]

    # --8<-- [start:mixed-precision]
    def _get_mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """fully_shard's mp_policy for the configured compute dtype (bf16, fp16 or fp32): fp32
        shards, gradients reduced in fp32, the loss handed back in fp32."""
        # --8<-- [start:exercise-13]
        name = self.fsdp_config.mixed_precision
        compute = {
            # fp32's 8 exponent bits, 7 mantissa bits: small gradients do not underflow, and
            # no loss scaling is needed.
            "bf16": torch.bfloat16,
            # 10 mantissa bits but 5 exponent bits: gradients under 6e-8 flush to zero, so
            # fp16 training needs a loss scaler.
            "fp16": torch.float16,
            "fp32": torch.float32,
        }
        if name not in compute:
            raise ConfigError(f"mixed_precision={name!r} is not one of "
                              f"{', '.join(MIXED_PRECISION)}")
        return MixedPrecisionPolicy(
            # What each unit's all-gather produces and its forward and backward compute in.
            # The shards the optimizer updates stay fp32 whatever it is: a bf16 weight cannot
            # absorb an update 1000x smaller than itself (8 significant bits).
            param_dtype=compute[name],
            # What gradients are reduce-scattered (averaged over ranks) in. Left out, it is
            # param_dtype, and every partial sum of N ranks' gradients is rounded to 16 bits.
            reduce_dtype=torch.float32,
            # None: a unit's outputs keep the dtype it computed in. A dtype here casts the
            # outputs of EVERY unit, each block's too, not only the model's: fp32 would hand
            # lm_head fp32 activations for its bf16 weights. The GPT computes its loss in fp32
            # itself (logits.float()), so the loss the training loop sees is fp32 already.
            output_dtype=None,
            # Cast each unit's floating-point inputs to param_dtype, so that activations
            # arriving in fp32 meet weights of their own dtype in the unit's matmuls.
            cast_forward_inputs=True,
        )
        # --8<-- [end:exercise-13]
    # --8<-- [end:mixed-precision]

    # --8<-- [start:fsdp-policy]
    def _get_fsdp_policy(self, model: nn.Module) -> list[nn.Module]:
        """The FSDP units, in the order fully_shard must be applied: innermost first."""
        # --8<-- [start:exercise-14]
        # One unit per transformer block: a block's parameters are gathered just before it
        # runs and freed right after, so at most a block or two is ever whole, and gathering
        # block i+1 overlaps computing block i. The root comes last: fully_shard(model) takes
        # every parameter no earlier unit claimed (embedding/lm_head, final norm).
        blocks = [module for module in model.modules() if isinstance(module, Block)]
        return [*blocks, model]
        # --8<-- [end:exercise-14]

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        # DDP seam, FSDP edition: shard in place. `model` keeps its class and code; fully_shard
        # swaps each parameter for a DTensor holding this rank's shard and adds hooks that
        # all-gather before a unit's forward/backward and reduce-scatter its gradients after.
        group = self.shard_group_size
        if self.fsdp_config.sharding_strategy == "HYBRID_SHARD" and self.world_size % group:
            raise ConfigError(f"HYBRID_SHARD splits the {self.world_size} ranks into groups of "
                              f"shard_group_size={group}, which does not divide "
                              f"{self.world_size}: pick a divisor of the world size (usually "
                              "the GPUs per node)")
        if not dist.is_initialized():
            # One process still needs a process group (of one) for the mesh; nothing is split.
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=self.device if backend == "nccl" else None)
        strategy = self._get_sharding_strategy()
        options = {"mesh": strategy["mesh"], "mp_policy": self._get_mixed_precision_policy()}
        if self.fsdp_config.cpu_offload:
            # Page-locked memory makes host<->GPU copies asynchronous; CPU-only has no GPU.
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        for unit in self._get_fsdp_policy(model):
            # The root's parameters (embedding and lm_head, tied; the final norm) are the
            # first ones backward needs: keep them gathered, as fully_shard's default does.
            reshard = strategy["reshard_after_forward"] and unit is not model
            fully_shard(unit, reshard_after_forward=reshard, **options)
        return model

    def _grad_sync(self, last_micro_step: bool):
        # DDP seam. DDP skips the all-reduce on all but the last micro-batch; here that would
        # keep a whole, unsharded gradient per parameter between micro-batches, the memory
        # FSDP exists to save. So every micro-batch reduce-scatters its gradients into the
        # sharded .grad, where they add up: more communication, memory stays 1/N.
        return contextlib.nullcontext()
    # --8<-- [end:fsdp-policy]

    # --8<-- [start:local-parameters]
    def local_parameter_count(self) -> int:
        """Parameter elements stored on this rank: the local pieces of the DTensor shards."""
        return sum(p.to_local().numel() for p in self.model.parameters())
    # --8<-- [end:local-parameters]

    # --8<-- [start:full-checkpoint]
    def save_checkpoint(self, path: str | Path) -> Path | None:
        """Gather the shards into one ordinary checkpoint, written by rank 0; every rank must
        call this (the gathering is a collective). Returns the path on rank 0, else None."""
        # --8<-- [start:exercise-15]
        # Each rank holds 1/N of every parameter and of AdamW's moments. get_state_dict
        # all-gathers them into plain tensors keyed by parameter name, exactly the keys of
        # an unsharded GPT. cpu_offload=True moves each gathered tensor to the CPU as it
        # arrives and keeps it on rank 0 only, so no rank ever holds the whole model on the
        # GPU, and the others get empty dicts.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer,
                                                      options=options)
        if not self.is_main:
            return None
        state = {
            "model": model_state,          # loads into a plain GPT, any sharding, any world size
            "optimizer": optimizer_state,  # AdamW's moments, keyed by parameter name
            "step": self.step,
            "sampler": self.sampler.state_dict(),  # the same on every rank (see _setup_data)
            "rng": capture_rng_state(),
            "model_config": self.config.to_dict(),
            "train_config": asdict(self.train_config),
            "fsdp_config": asdict(self.fsdp_config),
        }
        return save_atomic(path, state)  # temp file + fsync + rename, with a checksum
        # --8<-- [end:exercise-15]

    def load_checkpoint(self, path: str | Path) -> dict:
        """Load a full checkpoint into the sharded model: each rank keeps its own slices.
        Every rank reads the file (one filesystem); the sharding may differ from the run that
        wrote it, and so may the number of processes."""
        state = load_verified(path, map_location="cpu")
        if diff := config_diff(state["model_config"], self.config.to_dict()):
            raise CheckpointError(f"{path} holds a different model (checkpoint -> now: {diff}); "
                                  "use the --model-size it was trained with")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        self.step = state["step"]
        return state

    def save_checkpoint_once(self, path: str | Path) -> None:
        """DDP seam: under DDP rank 0 alone writes; here every rank takes part in gathering."""
        self.save_checkpoint(path)
        dist.barrier()
    # --8<-- [end:full-checkpoint]

    # --8<-- [start:sharded-checkpoint]
    def save_sharded_checkpoint(self, directory: str | Path) -> Path:
        """Every rank writes its own shards, in parallel, with torch.distributed.checkpoint
        (DCP): nothing is gathered, so it scales to models no single host could hold."""
        directory = Path(directory)
        # Sharded state dicts: DTensors, which DCP writes as each rank's slice plus a
        # .metadata file saying which slice of which tensor lives in which file.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "trainer": self._trainer_state()}
        # DCP writes files one by one: write into a fresh directory, then rename it to its
        # step-numbered name, so a crash mid-save leaves no partial checkpoint under that name
        # and the previous one whole. (The directory's files are fsynced by DCP's writer.)
        token = self._shared_token()
        tmp = directory.with_name(f".{directory.name}.{token}.tmp")
        dcp.save(state, checkpoint_id=tmp)
        dist.barrier()  # every rank's files are written before rank 0 renames the directory
        if self.is_main:
            if directory.exists():  # a step redone after resuming from an older checkpoint
                directory.rename(directory.with_name(f".{directory.name}.{token}.old.tmp"))
            os.replace(tmp, directory)
            fsync_dir(directory.parent)
            for old in directory.parent.glob(f".{directory.name}.*.old.tmp"):
                shutil.rmtree(old)
        dist.barrier()
        return directory

    def load_sharded_checkpoint(self, directory: str | Path) -> dict:
        """Read back this rank's slices (DCP reshards if the layout or world size changed).
        Returns the trainer's state (step, sampler, rng, configs)."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state,
                 "trainer": self._trainer_state()}
        try:
            dcp.load(state, checkpoint_id=Path(directory))  # fills the tensors in place
        except (Exception, CheckpointException) as err:  # DCP raises it on every rank
            first_line = (str(err).splitlines() or [""])[0]
            raise CorruptCheckpointError(f"{directory} cannot be read by "
                                         f"torch.distributed.checkpoint: {type(err).__name__}: "
                                         f"{first_line}") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        trainer = state["trainer"]
        if diff := config_diff(trainer["model_config"], self.config.to_dict()):
            raise CheckpointError(f"{directory} holds a different model (checkpoint -> now: "
                                  f"{diff}); use the --model-size it was trained with")
        self.sampler.load_state_dict(trainer["sampler"])
        restore_rng_state(trainer["rng"])
        self.step = trainer["step"]
        return trainer

    def _trainer_state(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(),
                "rng": capture_rng_state(), "model_config": self.config.to_dict(),
                "train_config": asdict(self.train_config)}

    def _shared_token(self) -> str:
        """A random name chosen by rank 0 and known to every rank."""
        token = [uuid.uuid4().hex[:8]]
        dist.broadcast_object_list(token, src=0)
        return token[0]
    # --8<-- [end:sharded-checkpoint]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    fsdp = FSDPConfig()
    p = build_parser("Train a GPT sharded with FSDP2; start it with torchrun.",
                     "runs/fsdp_trainer")
    p.add_flag("sharding-strategy", default=fsdp.sharding_strategy,
               choices=list(SHARDING_STRATEGIES))
    p.add_flag("shard-group-size", type=int_at_least(1), default=None,
               help="HYBRID_SHARD: ranks per shard group (default: processes per node)")
    p.add_flag("mixed-precision", default=fsdp.mixed_precision, choices=MIXED_PRECISION)
    p.add_flag("cpu-offload", action="store_true",
               help="keep parameter shards, gradients and the optimizer step on the CPU")
    p.add_argument("--checkpoint", default="full", choices=["full", "sharded"],
                   help="full: one file gathered on rank 0; sharded: DCP, one file per rank")
    p.set_defaults(ckpt_every=0)
    return check_args(p, p.parse_args(argv))


# --8<-- [start:main]
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        device, device_note = pick_trainer_device(args.device)
        train_config = train_config_from_args(args)
        fsdp_config = FSDPConfig(args.sharding_strategy, args.mixed_precision, args.cpu_offload,
                                 args.shard_group_size)
        trainer = FSDPTrainer(get_config(args.model_size), train_config, fsdp_config, device)
        # Step-numbered files or, for DCP, directories, with a `latest` pointer (checkpoint.py).
        sharded = args.checkpoint == "sharded"
        manager = CheckpointManager(out, keep_last=args.keep_last,
                                    suffix=".dcp" if sharded else ".pt")
        load = trainer.load_sharded_checkpoint if sharded else trainer.load_checkpoint
        resume_or_start(trainer, manager, args, load)
    except (ConfigError, DataError, CheckpointError, DeviceError) as err:
        return error_exit(err)

    def save():
        if not sharded:
            return save_step(trainer, manager)
        path = trainer.save_sharded_checkpoint(manager.path_for(trainer.step))
        if trainer.is_main:
            manager.commit(path)

    if device_note:
        trainer.log(device_note)
    weight = trainer.model.embed_tokens.weight  # a DTensor now: this rank's piece + layout
    trainer.log(f"{fsdp_config.sharding_strategy} on mesh {tuple(weight.device_mesh.shape)} "
                f"{weight.device_mesh.mesh_dim_names} | {fsdp_config.mixed_precision} compute | "
                f"model {args.model_size}: {trainer.raw_model.num_parameters():,} parameters, "
                f"rank 0 stores {trainer.local_parameter_count():,}")
    trainer.log(f"embed_tokens.weight: {type(weight).__name__} {tuple(weight.shape)}, "
                f"placements {weight.placements}, local piece {tuple(weight.to_local().shape)}")
    code = train(trainer, args, save)
    trainer.leave()
    return code
# --8<-- [end:main]


if __name__ == "__main__":
    from snippets.dist import run_main

    run_main(main)
