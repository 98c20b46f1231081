"""TorchTitan 0.3.0 on the CPU with gloo: its own trainer, seven small patches applied in memory.

    torchrun --nproc-per-node 2 -m snippets.library.torchtitan_cpu \\
        --module snippets.library.torchtitan_cpu --config llama3_debugmodel_cpu_seeded \\
        --parallelism.data-parallel-shard-degree 2

Every argument goes to `torchtitan.train.main` unchanged; the two config functions below are
TorchTitan's debug config with the CPU settings. Nothing in the installed package is edited: each
patch replaces one name in one module before the trainer is built, and says which upstream line
it works around. On a GPU the first five are not needed: TorchTitan finds CUDA, reads CUDA's
memory statistics, imports Triton, runs FlexAttention's compiled backward, and reduces with NCCL,
which takes PREMUL_SUM. The last two (timeouts, pipeline step) come from pairing TorchTitan
0.3.0 with torch 2.13, on any device. This is a workaround written for the versions in SUPPORTED
only; on any other version it refuses to start rather than patch code it has not read.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

SUPPORTED = {"torchtitan": "0.3.0", "torch": "2.13.0"}
ASSETS = "runs/torchtitan/assets"  # python -m snippets.library.torchtitan_assets --out ASSETS
SEED = "runs/torchtitan/seed/checkpoint/step-0"  # the initial weights every layout loads


def check_versions() -> str | None:
    """None if the installed versions are the ones this file was written for, else why not."""
    for package, wanted in SUPPORTED.items():
        try:
            found = version(package)
        except PackageNotFoundError:
            return (f"{package} is not installed (run `make torchtitan-env`, then use "
                    ".venv-torchtitan)")
        if found.split("+")[0] != wanted:  # torch's CPU wheel is "2.13.0+cpu"
            return (f"{package} {found} is installed, but this launcher's patches were written "
                    f"against {package} {wanted}; refusing to run (see SUPPORTED)")
    return None


def patch_device_type() -> None:
    # torchtitan/tools/utils.py:55 `_get_available_device_type() or "cuda"`: with no accelerator
    # TorchTitan picks torch.cuda and fails in set_device. Answer "cpu" instead, before that
    # module is imported (it stores device_type and device_module at import, utils.py:60).
    import torch._utils

    found = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: found() or "cpu"


def stub_triton_kernels() -> None:
    # torchtitan/distributed/minimal_async_ep/kernels.py:10 imports triton unconditionally, and
    # the dense Llama imports it (models/common/moe.py -> token_dispatcher.py:17). The kernels
    # serve only expert parallelism's GPU path; a stand-in module makes any use of them fail
    # with the reason.
    import types

    name = "torchtitan.distributed.minimal_async_ep.kernels"
    stub = types.ModuleType(name)

    def kernel(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr} is a Triton GPU kernel: not available on the CPU")
        return unavailable
    stub.__getattr__ = kernel
    sys.modules[name] = stub


def patch_memory_monitor() -> None:
    # torchtitan/components/metrics.py:42-49 asks device_module (here torch.cpu) for a device
    # name, capacity and peak allocator statistics; torch.cpu has none of these. Report the
    # machine's memory as capacity and the process's peak resident size as the peak.
    import os
    import resource

    import torchtitan.components.metrics as metrics

    class CPUMemoryMonitor(metrics.DeviceMemoryMonitor):
        def __init__(self):  # the parent's __init__ calls the CUDA-only API: not called
            self.device_name = "cpu"
            self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            self.device_capacity_gib = self._to_gib(self.device_capacity)

        def get_peak_stats(self):
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            gib, pct = self._to_gib(peak), self._to_pct(peak)
            return metrics.DeviceMemStats(gib, pct, gib, pct, 0, 0)

        def reset_peak_stats(self):
            pass  # a process's peak resident size cannot be reset

    metrics.build_device_memory_monitor = CPUMemoryMonitor


def patch_flex_attention() -> None:
    # torchtitan/models/common/attention.py:310 runs torch.compile'd flex_attention, whose
    # backward raises "FlexAttention does not support backward on CPU" in torch 2.13. Run SDPA
    # instead, with the very mask FlexAttention would use: the BlockMask's mask_mod (causal and
    # within one document) evaluated densely. Same attention, without the sparse-block kernel.
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    def sdpa_with_block_mask(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                             kernel_options):
        if score_mod is not None or return_aux.lse:
            raise NotImplementedError("the CPU attention stand-in takes a mask only (no "
                                      "score_mod, no log-sum-exp output)")
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=enable_gqa)
        return out, None
    FlexAttention.compiled_flex_attn = staticmethod(sdpa_with_block_mask)


def patch_gloo_reductions() -> None:
    # torchtitan/distributed/fsdp.py:41 sets each FSDP unit's gradient divide factor to 1 (the
    # loss is already divided by the global token count); FSDP2 then reduce-scatters with
    # ReduceOp.PREMUL_SUM(1.0) (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:850),
    # which gloo rejects. FSDP2's own switch set_force_sum_reduction_for_comms makes it a plain
    # SUM followed by a division by 1, which is skipped: the same numbers.
    import torchtitan.distributed.fsdp as fsdp
    from torch.distributed.fsdp import FSDPModule

    disable_division = fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model):
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def patch_timeouts() -> None:
    # torchtitan/distributed/utils.py:586 calls
    # barrier(device_ids=[device_module.current_device()]), and torch.cpu.current_device() is
    # the string "cpu", which BarrierOptions refuses; line 595
    # calls torch.distributed.set_timeout, which torch 2.13 does not have (its private
    # _set_pg_timeout does the same). Same steps: a barrier, then every group's new timeout.
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.distributed_c10d import _set_pg_timeout

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()
        meshes = parallel_dims.get_all_one_dimensional_meshes().values()
        for group in [mesh.get_group() for mesh in meshes] + [None]:
            _set_pg_timeout(timeout, group)
    dist_utils.set_pg_timeouts = set_pg_timeouts


def patch_pipeline_step() -> None:
    # torchtitan/trainer.py:856 calls pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=) with
    # inputs already split into micro-batches (each with its own document mask); torch 2.13's
    # step (torch/distributed/pipelining/schedules.py:740 and :1934) takes a whole batch and
    # splits it itself, so the three names arrive as model kwargs. Run the schedule's own step
    # with its splitting bypassed: the given micro-batches go to _step_microbatches unchanged.
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        def step(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, _step=cls.step,
                 **kwargs):
            if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
                return _step(self, *args, **kwargs)
            run = self._step_microbatches
            self._step_microbatches = lambda _args, _kwargs, _targets, *rest, **kw: run(
                arg_mbs, kwarg_mbs, target_mbs, *rest, **kw)
            try:
                return _step(self, *args, **kwargs)
            finally:
                del self._step_microbatches  # the class's method again
        cls.step = step


# --8<-- [start:cpu-config]
def llama3_debugmodel_cpu():
    """TorchTitan's own debug config (torchtitan/models/llama3/config_registry.py:34), made small
    and CPU-ready. Selected like any TorchTitan config, by a Python function:
    `--module snippets.library.torchtitan_cpu --config llama3_debugmodel_cpu`."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.hf_assets_path = f"{ASSETS}/tokenizer"           # made by torchtitan_assets.py
    config.dataloader.dataset_path = f"{ASSETS}/c4_test"
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 256, 4, 5
    config.training.mixed_precision_param = "float32"     # bf16: slow with AVX2-pinned kernels
    config.training.disable_cuda_graphs = True            # refused with pipeline parallelism
    config.parallelism.spmd_backend = "partial_dtensor"   # the default fails in fully_shard
    config.debug.seed = 42
    config.metrics.disable_color_printing = True
    return config


def llama3_debugmodel_cpu_seeded():
    """The same, starting from the weights in SEED instead of a fresh initialisation, so that
    every layout starts from the same model: a model sharded by TP or FSDP draws its initial
    values shard by shard, which are not the values one process draws."""
    from pathlib import Path

    seed = Path(SEED).resolve()  # TorchTitan requires an absolute initial_load_path
    if not (seed / ".metadata").is_file():
        raise FileNotFoundError(f"no seed checkpoint at {SEED}: make it first (one process, "
                                "--checkpoint.enable --checkpoint.create-seed-checkpoint)")
    config = llama3_debugmodel_cpu()
    config.checkpoint.enable, config.checkpoint.load_only = True, True  # load it, save nothing
    config.checkpoint.initial_load_path = str(seed)
    return config
# --8<-- [end:cpu-config]


def main() -> int:
    problem = check_versions()
    if problem:
        print(f"torchtitan_cpu: {problem}", file=sys.stderr)
        return 2
    patch_device_type()
    stub_triton_kernels()
    patch_memory_monitor()
    patch_flex_attention()
    patch_gloo_reductions()
    patch_timeouts()
    patch_pipeline_step()
    from torchtitan.train import main as train

    sys.argv[0] = "torchtitan.train"
    train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
