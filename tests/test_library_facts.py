"""Library behaviour that the reference pages, the SLURM and Kubernetes pages state, read from the
pinned library itself (torch 2.13), next to the sentence that states it.

The same two-part pattern as tests/test_facts.py, whose helpers this file uses: `stated` finds
the sentence on its page (and fails if the page no longer says it, so a reworded page keeps its
check), and the assertion reads the value from torch. A torch upgrade that changes one of these
fails here, naming the page. Everything is in-process and cheap: no process is started.
"""

import dataclasses
import inspect
import os
import re

import torch
import torch.distributed as dist

from tests.test_facts import stated

SLURM = "workshop/session-c/slurm.md"
KUBERNETES = "workshop/session-c/kubernetes.md"


# ---------------------------------------------------------------- torchrun (SLURM page)

def torchrun_config(log_dir, *flags):
    """The LaunchConfig torchrun builds from these flags, as `torchrun ... train.py` would (with
    its log directory under the test's tmp_path: torchrun would make a new one in /tmp)."""
    from torch.distributed import run
    config, _, _ = run.config_from_args(run.parse_args([f"--log-dir={log_dir}", *flags, "train.py"]))
    return config


def test_torchrun_handles_only_four_signals_by_default(monkeypatch, tmp_path):
    # slurm.md: USR1 sent to torchrun kills it, because by default torchrun installs handlers for
    # these four only; its --signals-to-handle flag can add SIGUSR1.
    [(line, names)] = stated(SLURM, r"By default torchrun handles only (SIG\w+), (SIG\w+), (SIG\w+) and (SIG\w+)")
    stated(SLURM, r"torchrun takes `--signals-to-handle`: with `SIGUSR1` added to its list")
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    monkeypatch.delenv("PET_SIGNALS_TO_HANDLE", raising=False)
    from torch.distributed.elastic.multiprocessing.api import PContext
    m = re.search(r'"TORCHELASTIC_SIGNALS_TO_HANDLE", "([A-Z,]+)"', inspect.getsource(PContext.start))
    assert m, "PContext.start no longer reads TORCHELASTIC_SIGNALS_TO_HANDLE with a default"
    for where, value in [("torchrun", torchrun_config(tmp_path).signals_to_handle),  # passed on in that variable
                         ("PContext.start", m.group(1))]:
        assert sorted(value.split(",")) == sorted(names), f"docs/{SLURM}:{line}: {where} has {value}"


def test_torchrun_waits_30_s_for_workers_after_sigterm(monkeypatch, tmp_path):
    [(line, (seconds,))] = stated(
        SLURM, r"gives them (\d+) s to exit before SIGKILL \(`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it, and say so
    assert torchrun_config(tmp_path, "--nproc_per_node=2").shutdown_timeout == int(seconds), f"docs/{SLURM}:{line}"


def test_torchrun_sets_one_omp_thread_per_worker(monkeypatch, tmp_path):
    # slurm.md, "What changes on a real cluster": torchrun sets OMP_NUM_THREADS=1 itself when it
    # starts more than one process and the variable is unset; with one process it leaves it.
    stated(SLURM, r"when it starts more than one process per node and `OMP_NUM_THREADS` is unset,"
                  r" it sets 1")
    for nproc, expected in [("2", "1"), ("1", None)]:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torchrun_config(tmp_path, f"--nproc_per_node={nproc}")
        assert os.environ.get("OMP_NUM_THREADS") == expected, nproc


def test_c10d_rendezvous_numbers_nodes_by_host_then_pid():
    # slurm.md: node ranks come from sorting the agents by host name, then process id.
    stated(SLURM, r"sorting the `torchrun` agents by\s+host name and then process id")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    fields = [f.name for f in dataclasses.fields(dr._NodeDesc)]
    assert fields[:2] == ["addr", "pid"], fields
    nodes = [dr._NodeDesc("node2", 10, 0), dr._NodeDesc("node1", 99, 0), dr._NodeDesc("node1", 7, 0)]
    assert [(n.addr, n.pid) for n in sorted(nodes)] == [("node1", 7), ("node1", 99), ("node2", 10)]
    assert "for rank, node in enumerate(sorted(state.participants)):" in inspect.getsource(
        dr._DistributedRendezvousOpExecutor._mark_rendezvous_complete)


def test_workers_get_group_rank():
    # slurm.md and the glossary: use GROUP_RANK, the node rank torchrun gives its workers.
    stated(SLURM, r"Use the `GROUP_RANK` torchrun gives its workers")
    stated("reference/glossary.md", r"counted from 0 \(`GROUP_RANK` under torchrun")
    from torch.distributed.elastic.agent.server import local_elastic_agent
    assert '"GROUP_RANK": str(worker_group.group_rank)' in inspect.getsource(local_elastic_agent)


# ---------------------------------------------------------------- torchrun (Kubernetes page)

def test_torchrun_reads_its_flags_from_pet_variables(monkeypatch):
    # kubernetes.md: the Kubeflow operator's PET_* variables are torchrun's flag defaults.
    [(line, names)] = stated(KUBERNETES, r"`(PET_NNODES)`, `(PET_NPROC_PER_NODE)` \(from\s+`nprocPerNode`\),"
                                         r" `(PET_NODE_RANK)`, `(PET_MASTER_ADDR)`, `(PET_MASTER_PORT)`")
    values = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "train-gpt-master-0", "PET_MASTER_PORT": "23456"}
    assert set(names) == set(values)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    from torch.distributed import run
    args = run.get_args_parser().parse_args(["train.py"])  # no flags on the command line
    for name, value in values.items():
        dest = name.removeprefix("PET_").lower()
        assert str(getattr(args, dest)) == value, f"docs/{KUBERNETES}:{line}: {name} -> --{dest}"


# ---------------------------------------------------------------- backends (where-next, glossary)

def test_mps_maps_to_gloo_which_carries_cpu_and_cuda_tensors():
    stated("reference/where-next.md", r"torch maps the `mps` device to `gloo`\s+\(`Backend.default_device_backend_map`\)")
    stated("reference/where-next.md", r"gloo carries CPU and CUDA tensors only\s+\(`Backend.backend_capability`\)")
    stated("reference/glossary.md", r"gloo lists only CPU and CUDA\s+tensors")
    assert dist.Backend.default_device_backend_map["mps"] == dist.Backend.GLOO
    assert sorted(dist.Backend.backend_capability[dist.Backend.GLOO]) == ["cpu", "cuda"]


def test_distributed_sampler_pads_by_repeating_indices():
    # glossary: the slices are disjoint only when the dataset divides by the ranks; by default
    # (drop_last=False) the first indices are repeated to fill the last slice.
    page = "reference/glossary.md"
    [(line, (value,))] = stated(page, r"`DistributedSampler`'s default \(`drop_last=(True|False)`\) repeats the first few")
    from torch.utils.data import DistributedSampler
    default = inspect.signature(DistributedSampler).parameters["drop_last"].default
    assert value == str(default), f"docs/{page}:{line}: torch's default is drop_last={default}"
    slices = [list(DistributedSampler(range(5), num_replicas=2, rank=r, shuffle=False)) for r in range(2)]
    assert slices == [[0, 2, 4], [1, 3, 0]]  # equal sizes; index 0 twice
    even = [list(DistributedSampler(range(6), num_replicas=2, rank=r, shuffle=False)) for r in range(2)]
    assert sorted(even[0] + even[1]) == list(range(6))  # divides: disjoint


# ---------------------------------------------------------------- debugging page

def test_detail_debug_wraps_each_group_with_a_gloo_helper():
    stated("reference/debugging.md", r"It wraps every process group in a\s+checker with a helper gloo group of its own"
                                     r" \(`_create_process_group_wrapper`")
    from torch.distributed import distributed_c10d
    src = inspect.getsource(distributed_c10d._create_process_group_wrapper)
    assert "helper_pg = ProcessGroupGloo(" in src and "_ProcessGroupWrapper(wrapped_pg, helper_pg)" in src


def test_fp16_overflow_arithmetic_and_sdpa():
    # debugging.md, "Attention overflows in fp16": 64 x 32 x 32 overflows fp16, the scaled
    # product does not, and PyTorch's fused attention stays finite on the same inputs.
    page = "reference/debugging.md"
    [(line, (largest, product))] = stated(
        page, r"fp16's largest number is (\d+)\. A dot product of two 64-dimensional vectors with"
              r" entries of 32 is\s+(\d+)")
    assert int(largest) == torch.finfo(torch.float16).max, f"docs/{page}:{line}"
    assert int(product) == 64 * 32 * 32 > int(largest), f"docs/{page}:{line}"
    assert torch.isinf(torch.tensor(64 * 32.0 * 32.0, dtype=torch.float16))
    [(line, (scaled,))] = stated(page, r"so the sum never gets large \((\d+) here\)")
    assert int(scaled) == 64 * (32 / 64 ** 0.5) * 32, f"docs/{page}:{line}"
    stated(page, r"PyTorch's `scaled_dot_product_attention` on fp16 inputs returned finite values")
    q = torch.full((1, 1, 4, 64), 32.0, dtype=torch.float16)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- cheat sheets

def test_ddp_bucket_size_on_cheat_sheet():
    from torch.nn.parallel import distributed as ddp_module
    [(line, (mib,))] = stated("reference/cheat-sheets.md", r"gradients are packed into ~(\d+) MiB buckets")
    assert int(mib) == ddp_module._DEFAULT_BUCKET_CAP_MB, f"docs/reference/cheat-sheets.md:{line}"


def test_master_weights_keep_updates_below_bf16_resolution():
    # glossary, "Master weights": a small update to a bf16 weight is lost, to an fp32 one kept.
    stated("reference/glossary.md", r"so that updates smaller than\s+bf16's resolution are not lost")
    weight, update = torch.tensor(1.0), torch.tensor(1e-3)
    assert update < torch.finfo(torch.bfloat16).eps / 2  # below half of bf16's step above 1.0
    assert (weight.bfloat16() + update.bfloat16()).item() == 1.0
    assert (weight + update).item() != 1.0


def test_fsdp2_hybrid_sharding_is_a_2d_mesh():
    stated("reference/cheat-sheets.md", r"a 2-D \(replicate, shard\) mesh for FSDP2's `fully_shard`")
    from torch.distributed.fsdp import fully_shard
    doc = re.sub(r"\s+", " ", inspect.getdoc(fully_shard))
    assert ("If 2D, then parameters are sharded across the 1st dim and replicated across the 0th dim"
            " (HSDP)") in doc
