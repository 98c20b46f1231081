"""Library behaviour that the reference pages, the SLURM and Kubernetes pages state, read from the
pinned library itself (torch 2.13), next to the sentence that states it.

The same two-part pattern as tests/test_facts.py, whose helpers this file uses: `stated` finds
the sentence on its page (and fails if the page no longer says it, so a reworded page keeps its
check), and the assertion reads the value from torch. A torch upgrade that changes one of these
fails here, naming the page. Everything is in-process and cheap: no process is started.
"""

import dataclasses
import inspect
import math
import os
import re
import tomllib

import torch
import torch.distributed as dist

import pytest

from tests.conftest import ROOT
from tests.test_facts import stated

pytestmark = pytest.mark.kernel_independent("library behaviour read from the pinned source: constants and messages")

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


# ---------------------------------------------------------------- the course, Weeks 1-4

def _source_of(package: str, file: str) -> str:
    """A file of an installed package, read as text (importing it would cost more)."""
    import importlib.util
    from pathlib import Path
    return (Path(importlib.util.find_spec(package).origin).parent / file).read_text(encoding="utf-8")


def test_nbdistributed_start_pause_cell_timeout_and_reset():
    # nbdistributed.md: %dist_init sleeps a fixed 2 s, a cell waits 30 s for the workers, and
    # %dist_reset runs exactly the pkill commands the page lists (nbdistributed 0.1.0's source).
    import ast
    page = "course/week-1/nbdistributed.md"
    stated(page, r"`%dist_init` returns after a fixed\s+two-second pause")
    assert "time.sleep(2)" in _source_of("nbdistributed", "process_manager.py")
    [(line, (seconds,))] = stated(page, r"the first cell then hangs for (\d+) seconds")
    tree = ast.parse(_source_of("nbdistributed", "communication.py"))
    [send_to_all] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "send_to_all"]
    assert ast.literal_eval(send_to_all.args.defaults[-1]) == int(seconds), f"docs/{page}:{line}"
    [(line, (bullet,))] = stated(page, r"Its \"nuclear\" shutdown runs\s+((?:`pkill[^`]*`[,\s]*(?:and\s+)?)+)")
    on_page = sorted(c.replace('"', "") for c in re.findall(r"`(pkill[^`]*)`", bullet))
    tree = ast.parse(_source_of("nbdistributed", "magic.py"))
    [nuclear] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_nuclear_shutdown"]
    in_source = sorted(" ".join(ast.literal_eval(call.args[0])) for call in ast.walk(nuclear)
                       if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.List)
                       and ast.literal_eval(call.args[0])[:1] == ["pkill"])
    assert on_page == in_source, f"docs/{page}:{line}: the page lists {on_page}, the source runs {in_source}"


def test_ddp_from_scratch_buckets_default_to_torch_ddps_cap():
    # ddp-from-scratch.md: our BucketedDDP/OverlappedDDP and torch's DDP share the default cap
    # (both count it in MiB: 2**20 bytes per "MB").
    page = "course/week-1/ddp-from-scratch.md"
    [(line, (mb,))] = stated(page, r"Both\s+PyTorch's DDP and ours default to (\d+) MB")
    from torch.nn.parallel import distributed as ddp_module

    from snippets.scratch.ddp import BucketedDDP, OverlappedDDP
    ours = {inspect.signature(c).parameters["bucket_cap_mb"].default for c in (BucketedDDP, OverlappedDDP)}
    assert ours == {int(mb)} == {ddp_module._DEFAULT_BUCKET_CAP_MB}, f"docs/{page}:{line}: ours {ours}"


def test_fsdp2_reduce_dtype_and_offload_defaults():
    # fsdp.md: left unset, reduce_dtype is None and the reduction runs in param_dtype;
    # CPUOffloadPolicy pins host memory unless told not to.
    page = "course/week-2/fsdp.md"
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    [(line, (value,))] = stated(page, r"`MixedPrecisionPolicy`'s default is `reduce_dtype=(\w+)`, and then the"
                                      r" reduction runs in\s+`param_dtype`")
    assert str(MixedPrecisionPolicy().reduce_dtype) == value, f"docs/{page}:{line}"
    doc = re.sub(r"\s+", " ", inspect.getdoc(MixedPrecisionPolicy))
    assert "If this is ``None`` but ``param_dtype`` is not ``None``, then the reduction uses the compute dtype" in doc
    [(line, (pin,))] = stated(page, r"`pin_memory=(True|False)` \(page-locked host memory, the policy's default\)")
    assert str(CPUOffloadPolicy().pin_memory) == pin, f"docs/{page}:{line}"


def test_interleaved_1f1b_warmup_and_rounds():
    # interleaved-pipeline.md: torch's interleaved warm-up is Megatron's, two forwards per rank
    # downstream, and m need only be a multiple of the number of rounds, max(1, m // p).
    from torch.distributed.pipelining import schedules
    page = "course/week-3/interleaved-pipeline.md"
    [(line, (factor,))] = stated(page, r"`multiply_factor=(\d+)` in `_get_warmup_ops`")
    assert inspect.signature(schedules._get_warmup_ops).parameters["multiply_factor"].default == int(factor), \
        f"docs/{page}:{line}"
    stated(page, r"a round is \$p\$ micro-batches when \$p\$ divides \$m\$, which gives \$\(v-1\)p \+ 2\(p-1-r\)\$")
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9)]:
        for r in range(p):  # microbatches_per_round = p when p divides m
            assert schedules._get_warmup_ops(r, v, p, p, m) == min((v - 1) * p + 2 * (p - 1 - r), v * m)
    stated(page, r"it needs \$m\$ to be a multiple of\s+\$\\max\(1, \\lfloor m/p \\rfloor\)\$ \(its `ValueError`"
                 r" \"Interleaved 1F1B requires the number of\s+microbatches to be a multiple of the number"
                 r" of rounds\"\)")
    src = inspect.getsource(schedules.ScheduleInterleaved1F1B.__init__)
    assert "self.number_of_rounds = max(1, n_microbatches // self.pp_group_size)" in src
    assert "if n_microbatches % self.number_of_rounds != 0:" in src


def test_interleaved_first_backward_comes_one_forward_after_the_warmup():
    # interleaved-pipeline.md: after the (v-1)p + 2(p-1-r) warm-up forwards the steady state
    # opens with a forward, so one more forward runs before the first backward; the page's own
    # printed schedule (5 on rank 0, 3 on rank 1) shows it. torch's warm-up count, plus one.
    from torch.distributed.pipelining import schedules

    from snippets.scratch.pipeline_interleaved import interleaved_schedule
    page = "course/week-3/interleaved-pipeline.md"
    stated(page, r"\$\(v-1\)p \+ 2\(p-1-r\) \+ 1\$\s+forwards \(at most \$vm\$\) come before rank \$r\$'s first backward")
    [(line, shown)] = stated(page, r"shows (\d+) on rank 0 and (\d+) on rank 1 for \$p = v = 2\$")
    from tests.test_facts import page_text
    printed = dict(re.findall(r"(?m)^rank (\d): ((?:[FB]\d\.\d ?)+)$", page_text(page)))  # the expected output
    assert len(printed) == 2, printed
    for r in (0, 1):
        actions = printed[str(r)].split()
        before = next(i for i, a in enumerate(actions) if a.startswith("B"))
        assert before == int(shown[r]) == schedules._get_warmup_ops(r, 2, 2, 2, 4) + 1, f"docs/{page}:{line}: rank {r}"
    for p, v, m in [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9), (4, 4, 8)]:
        for r in range(p):
            kinds = [a[0] for a in interleaved_schedule(m, r, p, v)]
            assert kinds.index("B") == min(schedules._get_warmup_ops(r, v, p, p, m) + 1, v * m), (p, v, m, r)


def test_fp8_casts_without_a_scale():
    # low-precision.md: unscaled, e5m2 overflows to infinity from halfway past its largest
    # number, and 1e-3 lands on e4m3's smallest subnormal but on a normal e5m2 number.
    page = "course/week-3/low-precision.md"
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    [(line, (start, largest))] = stated(page, r"e5m2 rounds up to \*\*infinity\*\* from ([\d,]+) \(halfway past its"
                                              r" largest number,\s+([\d,]+)\)")
    start, largest = int(start.replace(",", "")), int(largest.replace(",", ""))
    assert largest == torch.finfo(e5m2).max, f"docs/{page}:{line}"
    step = 2.0 ** math.floor(math.log2(largest)) * torch.finfo(e5m2).eps  # the spacing at the top
    assert start == largest + step / 2, f"docs/{page}:{line}"
    just_below = torch.nextafter(torch.tensor(float(start)), torch.tensor(0.0))
    assert torch.tensor(float(start)).to(e5m2).float().item() == math.inf
    assert just_below.to(e5m2).float().item() == largest
    stated(page, r"\$10\^\{-3\}\$ becomes e4m3's smallest subnormal, \$2\^\{-9\}\$")
    stated(page, r"in e5m2 it is a normal number and rounds to the nearest one,\s+\$2\^\{-10\}")
    thousandth = torch.tensor(1e-3)
    assert thousandth.to(e4m3).float().item() == 2.0 ** -9 == torch.finfo(e4m3).smallest_normal / 8
    assert thousandth.to(e5m2).float().item() == 2.0 ** -10 and 2.0 ** -10 >= torch.finfo(e5m2).smallest_normal


def test_function_returning_its_input_still_runs_backward():
    # tensor-parallel-from-scratch.md: returning x itself from a Function's forward would also
    # work; autograd makes the view on its own and records the node.
    stated("course/week-4/tensor-parallel-from-scratch.md",
           r"Returning `x` itself would work as well in torch 2.13: autograd notices that a\s+`Function`"
           r" handed back one of its inputs unmodified and makes that view on its own")

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    x = torch.ones(3, requires_grad=True)
    y = Double.apply(x)
    assert y is not x and y._base is x and type(y.grad_fn).__name__ == "DoubleBackward"
    y.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_colwise_and_rowwise_parallel_defaults():
    # tensor-parallel-torch.md's table of styles and their use_local_output default.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    page = "course/week-4/tensor-parallel-torch.md"
    [(line, (value,))] = stated(page, r"`ColwiseParallel` and `RowwiseParallel` default to\s+"
                                      r"`use_local_output=(True|False)`")
    stated(page, r"\| `ColwiseParallel\(\)` \| `Shard\(0\)`: rows of `W`, output features \| `Replicate`"
                 r" \| `Shard\(-1\)`")
    stated(page, r"\| `RowwiseParallel\(\)` \| `Shard\(1\)`: columns of `W`, input features \| `Shard\(-1\)`"
                 r" \| `Replicate`")
    col, row = ColwiseParallel(), RowwiseParallel()
    assert str(col.use_local_output) == str(row.use_local_output) == value, f"docs/{page}:{line}"
    assert (col.input_layouts, col.output_layouts) == ((Replicate(),), (Shard(-1),))
    assert (row.input_layouts, row.output_layouts) == ((Shard(-1),), (Replicate(),))
    assert "[Shard(0)]" in inspect.getsource(ColwiseParallel._partition_linear_fn)
    assert "[Shard(1)]" in inspect.getsource(RowwiseParallel._partition_linear_fn)


def test_context_parallel_defaults_layout_and_cited_lines():
    # context-parallel.md reads torch 2.13's context parallelism by line number; each cited line
    # still holds what the page says, the default rotation is an all-gather, and the head-tail
    # balancer gives rank r chunks r and 2N-1-r.
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer
    page = "course/week-4/context-parallel.md"
    [(line, (method,))] = stated(page, r"by default \(`_cp_options.rotate_method`, line \d+, `(\w+)`\)")
    assert _attention._ContextParallelOptions().rotate_method.name == method, f"docs/{page}:{line}"
    stated(page, r"`_HeadTailLoadBalancer`\s+in `_context_parallel/_load_balancer.py`: rank r gets chunks r and 2N-1-r")
    for n in (2, 4):  # a sequence of 2N tokens: chunks of one token each
        chunks = _load_balancer._HeadTailLoadBalancer(2 * n, n, "cpu")._generate_indices().view(n, 2)
        assert chunks.tolist() == [[r, 2 * n - 1 - r] for r in range(n)]
    attention = _source_of("torch", "distributed/tensor/experimental/_context_parallel/_attention.py").splitlines()
    sharding = _source_of("torch", "distributed/tensor/_sharding_prop.py").splitlines()
    for pattern, lines, expected in [
        (r"lines (\d+)-\d+ \(`custom_ops`\)", attention, "custom_ops = {"),
        (r"_sharding_prop.py` line (\d+)", sharding, "raise NotImplementedError("),
        (r"`_templated_ring_attention` \(line (\d+)\)", attention, "def _templated_ring_attention("),
        (r"`_templated_ring_attention_backward` \(line (\d+)\)", attention, "def _templated_ring_attention_backward("),
        (r"`_cp_options.rotate_method`, line (\d+)", attention,
         "rotate_method: _RotateMethod = _RotateMethod.ALL_GATHER"),
        (r"`_AllToAllRotater` \(chosen at line (\d+)\)", attention, "method=_RotateMethod.ALL_TO_ALL"),
    ]:
        [(line, (number,))] = stated(page, pattern)
        assert expected in lines[int(number) - 1], f"docs/{page}:{line}: line {number} is {lines[int(number) - 1]!r}"
    [(line, (last,))] = stated(page, r"lines \d+-(\d+) \(`custom_ops`\)")
    assert attention[int(last) - 1] == "}", f"docs/{page}:{line}"


def test_new_group_is_entered_by_every_rank():
    # three-d.md: every rank creates every group, its own or not, in the same order.
    stated("course/week-4/three-d.md", r"`dist.new_group` is itself a collective over the \*whole world\*:\s+every rank"
                                       r" creates every group, its own or not, in the same order")
    doc = re.sub(r"\s+", " ", inspect.getdoc(dist.new_group))
    assert ("requires that all processes in the main group (i.e. all processes that are part of the distributed job)"
            " enter this function, even if they are not going to be members of the group") in doc
    assert "groups should be created in the same order in all processes" in doc
    assert inspect.signature(dist.new_group).parameters["use_local_synchronization"].default is False


def test_ddp_unused_parameters_and_static_graph():
    # ddp-from-scratch.md: find_unused_parameters searches the graph after every forward;
    # static_graph is for a graph that never changes, and lets DDP skip that search.
    stated("course/week-1/ddp-from-scratch.md",
           r"`find_unused_parameters=True` for models whose forward\s+leaves some parameters unused \(DDP then"
           r" searches the autograd graph after every forward\), and\s+`static_graph=True` for models whose"
           r" graph is the same every step, which lets DDP skip that search\s+and support reentrant activation"
           r" checkpointing")
    doc = re.sub(r"\s+", " ", inspect.getdoc(torch.nn.parallel.DistributedDataParallel))
    assert "find_unused_parameters (bool): Traverse the autograd graph from all tensors contained in the return" \
           " value of the wrapped module's ``forward`` function" in doc
    assert "The set of used and unused parameters will not change during the whole training loop" in doc
    assert "1) Reentrant backwards." in doc
    assert "DDP will not search graph in each iteration to detect unused parameters when static_graph is set" in doc


def test_zero_redundancy_optimizer_broadcasts_whole_parameters():
    # zero-from-scratch.md: PyTorch's ZeRO-1 owns whole parameters and, by default, broadcasts
    # each one from its owner after the step.
    stated("course/week-2/zero-from-scratch.md",
           r"`ZeroRedundancyOptimizer` shards AdamW's\s+state by whole parameters rather than by a flat buffer,"
           r" and broadcasts each parameter from its\s+owner instead of all-gathering")
    import ast  # read, not imported: importing torch.distributed.optim warns about torch.jit
    text = _source_of("torch", "distributed/optim/zero_redundancy_optimizer.py")
    [cls] = [c for c in ast.parse(text).body if isinstance(c, ast.ClassDef) and c.name == "ZeroRedundancyOptimizer"]
    functions = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    init = functions["__init__"]
    defaults = dict(zip([a.arg for a in init.args.kwonlyargs], init.args.kw_defaults))
    defaults.update(zip([a.arg for a in init.args.args][-len(init.args.defaults):], init.args.defaults))
    assert ast.literal_eval(defaults["parameters_as_bucket_view"]) is False
    src = ast.get_source_segment(text, functions["_broadcast_params_from_rank"])
    assert "tensor=param.data," in src and "src=global_rank," in src
    assert "all_gather" not in ast.get_source_segment(text, functions["_sync_params"])


def test_pipeline_stage_infers_shapes_unless_given():
    # pipeline-torch.md: without example tensors PipelineStage infers shapes on the first
    # micro-batch; with input_args and output_args it needs no exchange.
    stated("course/week-3/pipeline-torch.md",
           r"`PipelineStage` without `input_args` finds\s+out on the first `step\(\)`")
    from torch.distributed.pipelining import PipelineStage
    doc = re.sub(r"\s+", " ", inspect.getdoc(PipelineStage))
    assert "Dynamic mode: Metadata is inferred from the first microbatch at runtime" in doc
    assert "Static mode: All of ``input_args``, ``output_args``" in doc


def test_ddp_small_first_bucket_only_by_default():
    # ddp-from-scratch.md: the 1 MiB first bucket belongs to the default; an explicit
    # bucket_cap_mb (25 included) makes every bucket, the first too, that size.
    page = "course/week-1/ddp-from-scratch.md"
    [(line, (mib,))] = stated(page, r"Left at its default, PyTorch's DDP also caps its first\s+bucket, the first"
                                    r" gradients backward produces, at (\d+) MiB, so that communication starts"
                                    r" early; any\s+explicit"
                                    r" `bucket_cap_mb`, 25 included, turns that off")
    from torch.nn.parallel import distributed as ddp_module
    create = ddp_module._BucketCapacityConfig.create
    default = create(None, None, use_python_reducer=False)
    assert default.first_bucket_bytes_cap == int(mib) * 2**20 == dist._DEFAULT_FIRST_BUCKET_BYTES, f"docs/{page}:{line}"
    assert default.bucket_bytes_cap == 25 * 2**20
    explicit = create(25, None, use_python_reducer=False)
    assert explicit.first_bucket_bytes_cap == explicit.bucket_bytes_cap == 25 * 2**20


def test_torchrun_gives_each_node_consecutive_ranks():
    # three-d.md: a node's workers get a block of consecutive global ranks, so TP innermost
    # keeps a TP group on one node.
    stated("course/week-4/three-d.md", r"torchrun gives each node a block of consecutive ranks"
                                       r" \(`_assign_worker_ranks` in\s+"
                                       r"`torch/distributed/elastic/agent/server/api.py`\)")
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    doc = re.sub(r"\s+", " ", inspect.getdoc(SimpleElasticAgent._assign_worker_ranks))
    assert ("each worker is assigned a base global rank such that its workers are in the range"
            " [base_global_rank, base_global_rank + local_world_size)") in doc


# ---------------------------------------------------------------- the workshop sessions

def test_gpt2_small_ddp_buckets_at_25_mib():
    # Session B: with bucket_cap_mb=25, GPT-2 small's gradients make 13 buckets, the last the
    # 147 MiB embedding beside one 3 KB norm gain. DDP rebuilds its buckets after the first step
    # in the order gradients became ready, reverse registration order for this model (checked
    # once with DDP itself on 2 gloo ranks: reducer._get_zeros_like_grad_buckets() after step 3).
    page = "workshop/session-b/slides.md"
    from snippets.models.gpt import GPT, get_config
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(get_config("gpt2-small")).parameters()]
    grads = [torch.empty(s, device="meta") for s in reversed(shapes)]  # sizes only, no memory
    buckets, _ = dist._compute_bucket_assignment_by_size(grads, [25 * 2**20], [False] * len(grads))
    sizes = [sum(grads[i].numel() * 4 for i in b) for b in buckets]
    for line, (count,) in stated(page, r"GPT-2 small's (?:471 MiB of fp32\s+)?gradients make (\d+) buckets"):
        assert int(count) == len(buckets), f"docs/{page}:{line}: torch makes {len(buckets)}"
    [(line, (per_layer, emb, norm))] = stated(
        page, r"one (\d+) MiB bucket per layer \([^)]*\) and, last, the (\d+) MiB token embedding with only"
              r" layer 0's (\d) KB norm gain\s+beside it")
    assert {round(s / 2**20) for s in sizes[:-1]} == {int(per_layer)}, f"docs/{page}:{line}"
    last = sorted(grads[i].numel() * 4 for i in buckets[-1])
    assert [last[0] // 2**10, last[1] // 2**20] == [int(norm), int(emb)], f"docs/{page}:{line}: {last}"
    # Exercise 2's solution: one bucket for the first step, then rebuilt in backward's order.
    stated(page, r"With the default `find_unused_parameters=False`, DDP's first step puts every gradient in one\s+"
                 r"bucket; after it, DDP rebuilds the buckets in the order the gradients became ready")
    import sys
    from torch.nn.parallel import distributed as ddp_module
    assert inspect.signature(ddp_module.DistributedDataParallel).parameters["find_unused_parameters"].default is False
    config = ddp_module._BucketCapacityConfig.create(25, None, use_python_reducer=False)
    assert config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=False)[0] == [sys.maxsize]
    assert '"bucket rebuild" bucketizes parameters based on its real execution order in backward graph' in \
        inspect.getsource(ddp_module.DistributedDataParallel._ddp_init_helper)


def test_gradscaler_starts_at_2_to_the_16():
    # Session B: "With the loss scaled by 2^16 (GradScaler's default start)".
    page = "workshop/session-b/slides.md"
    [(line, (power,))] = stated(page, r"With the loss scaled by \\\(2\^\{(\d+)\}\\\) \(GradScaler's default start\)")
    init_scale = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
    assert init_scale == 2.0 ** int(power), f"docs/{page}:{line}: GradScaler(init_scale={init_scale})"


def test_non_reentrant_checkpoint_stops_recomputing_early():
    # Session A slides: the recomputed block stops before its last projection, because torch's
    # (non-reentrant) checkpoint stops as soon as it has every tensor backward needs.
    stated("workshop/session-a/slides.md", r"torch's checkpoint stops\s+recomputing as soon as it has every tensor"
                                           r" backward needs")
    from torch.utils import checkpoint
    doc = re.sub(r"\s+", " ", inspect.getdoc(checkpoint.set_checkpoint_early_stop))
    assert "By default, non-reentrant checkpoint stops recomputation as soon as it has computed all needed" in doc
    assert checkpoint._enable_checkpoint_early_stop is None  # unset: the default, early stop on
    assert "use_reentrant=False" in inspect.getsource(__import__("snippets.models.gpt", fromlist=["GPT"]).GPT.forward)


def test_wandb_sync_marker_and_clean_default():
    # data-and-logging.md: `wandb sync` skips a run with a .wandb.synced marker (beta_sync.py),
    # and `wandb clean` deletes synced runs older than a day by default (wandb 0.31.0).
    import ast
    page = "workshop/session-a/data-and-logging.md"
    stated(page, r"`wandb sync` skips a run file that has a `\.wandb\.synced` marker beside it \(see\s+"
                 r"`wandb/cli/beta_sync\.py` in the installed package\)")
    beta_sync = _source_of("wandb", "cli/beta_sync.py")
    assert ".wandb.synced marker file" in beta_sync and "if skip_synced and _is_synced(file):" in beta_sync
    [(line, (days,))] = stated(page, r"`wandb clean` deletes the local copies\s+of synced runs \(those older than"
                                     r" (a day), by default\)")
    tree = ast.parse(_source_of("wandb", "cli/clean.py"))
    options = {ast.literal_eval(call.args[0]): {k.arg: ast.literal_eval(k.value) for k in call.keywords
                                                if isinstance(k.value, ast.Constant)}
               for call in ast.walk(tree) if isinstance(call, ast.Call) and call.args
               and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("--")}
    hours = options["--min-hours"]["default"]
    assert {"a day": 24}[days] == hours, f"docs/{page}:{line}: wandb clean --min-hours defaults to {hours}"
    assert options["--include-unsynced"]["default"] is False, f"docs/{page}:{line}"
    # The reader the course writes itself: the pinned wandb ships the messages, not a reader.
    [(line, (version,))] = stated(page, r"The pinned wandb \(([\d.]+)\) ships the message definitions,\s+"
                                        r"`wandb\.proto\.wandb_internal_pb2`, but no longer a Python reader")
    import importlib.metadata
    assert importlib.metadata.version("wandb") == version, f"docs/{page}:{line}"
    assert "from wandb.proto.v6.wandb_internal_pb2 import *" in _source_of("wandb", "proto/wandb_internal_pb2.py")
    assert "_globals['_RECORD']" in _source_of("wandb", "proto/v6/wandb_internal_pb2.py")  # the Record message
    try:  # read, not imported: importing wandb costs seconds
        _source_of("wandb", "sdk/internal/datastore.py")  # the Python reader of older releases
    except FileNotFoundError:
        pass
    else:
        raise AssertionError(f"docs/{page}:{line}: wandb ships sdk/internal/datastore.py again")


def test_accelerator_prefers_mps_then_cuda_then_cpu():
    # profiling-and-accelerate.md: Accelerator() picks MPS when it is there, then CUDA, then the CPU.
    stated("workshop/session-b/profiling-and-accelerate.md",
           r"picks the device: Apple's MPS when it is there, then CUDA, then the CPU")
    from accelerate.state import PartialState
    src = inspect.getsource(PartialState.default_device.fget)
    code = src[src.index("if is_mps_available():"):]  # after the docstring, which lists them too
    order = [code.index(s) for s in ('return torch.device("mps")', "elif torch.cuda.is_available():",
                                     'else:\n            return torch.device("cpu")')]
    assert order == sorted(order) and order[0] == code.index("return torch.device("), \
        "accelerate's PartialState.default_device changed its order"


def test_torchrun_error_file_and_record_decorator():
    # lab-2.md, challenge 3: torchrun gives each worker TORCHELASTIC_ERROR_FILE; @record writes
    # the traceback there and re-raises.
    stated("workshop/session-b/lab-2.md", r"torchrun sets `TORCHELASTIC_ERROR_FILE` in each worker's environment")
    stated("workshop/session-b/lab-2.md", r"`@record`\s+from `torch\.distributed\.elastic\.multiprocessing\.errors`,"
                                          r" does the same and re-raises")
    from torch.distributed.elastic.multiprocessing import api, errors
    assert 'envs[local_rank]["TORCHELASTIC_ERROR_FILE"] = error_file' in inspect.getsource(api)
    calls = []

    class Handler(errors.ErrorHandler):
        def record_exception(self, e):
            calls.append(e)

    def fails():
        raise ValueError("boom")

    try:
        errors.record(fails, error_handler=Handler())()
    except ValueError:
        pass
    else:
        raise AssertionError("@record swallowed the exception")
    assert [str(e) for e in calls] == ["boom"]


def test_rendezvous_defaults_stated_in_the_demo(tmp_path, monkeypatch):
    # demo.md: torchrun passes timeout=900 to the static rendezvous, which uses it in place of its
    # own _default_timeout_seconds = 600; c10d's join_timeout is 600 s and ignores that key.
    from tests.test_facts import static_rendezvous_timeout_s, torchrun_static_rendezvous_timeout_s
    page = "workshop/session-c/demo.md"
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
    for name in ("PET_RDZV_CONF", "PET_RDZV_BACKEND", "PET_NNODES", "PET_NODE_RANK"):
        monkeypatch.delenv(name, raising=False)  # torchrun's flag defaults
    [(line, (passed, set_to, own))] = stated(
        page, r"Without it torchrun passes `timeout=(\d+)` itself: `LaunchConfig\.__post_init__` in"
              r" `torch/distributed/launcher/api\.py` sets `rdzv_configs\[\"timeout\"\] = (\d+)` when the command"
              r" names none, and the static rendezvous uses that in place of its own `_default_timeout_seconds = (\d+)`")
    torchrun = torchrun_static_rendezvous_timeout_s(tmp_path)
    assert int(passed) == int(set_to) == torchrun, f"docs/{page}:{line}: torchrun gives the static rendezvous {torchrun} s"
    assert int(own) == static_rendezvous_timeout_s() != torchrun, f"docs/{page}:{line}"
    stated(page, r"c10d does not read the\s+`timeout` key that torchrun fills in")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    assert 'get_as_int(key + "_timeout")' in inspect.getsource(dynamic_rendezvous._get_timeout)
    [(line, (join,))] = stated(page, r"Here the bound is `join_timeout`, `(\d+)` seconds unless `--rdzv_conf`")
    assert int(join) == RendezvousTimeout().join.total_seconds(), f"docs/{page}:{line}"


def test_flight_recorder_dump_on_timeout_is_on_by_default():
    # gpu-operations.md and environment-variables.md: TORCH_NCCL_DUMP_ON_TIMEOUT need not be set.
    # Its default is compiled into ProcessGroupNCCL.cpp, which the CPU wheel does not ship
    # (upstream: `dumpOnTimeoutOrEx_ = getCvarBool(TORCH_NCCL_DUMP_ON_TIMEOUT, true)` in
    # HeartbeatMonitor's constructor). What the wheel does ship: the header that declares the
    # variable and the HeartbeatMonitor's flag, and torch's own test that must switch the dump
    # off, which it would not need to if the default were off. (The buffer's default, 2000, is
    # checked by tests/test_facts.py::test_flight_recorder_default_buffer.)
    from tests.test_facts import TORCH_DIR, all_pages
    stated("workshop/session-c/gpu-operations.md",
           r"Both are on by default, so there is nothing to set .* the dump's default is `true` in"
           r" `ProcessGroupNCCL\.cpp`\); `TORCH_NCCL_DUMP_ON_TIMEOUT=0` switches the dump off")
    stated("workshop/session-c/gpu-operations.md", r"`TORCH_NCCL_DUMP_ON_TIMEOUT` is on unless set to `0`")
    stated("reference/environment-variables.md", r"`TORCH_NCCL_DUMP_ON_TIMEOUT`\s+\(default on\)")
    stated("reference/environment-variables.md", r"torch's own `testing/_internal/distributed/distributed_test\.py`"
                                                 r" has to set it to `0`")
    header = (TORCH_DIR / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp").read_text()
    assert 'static std::vector<std::string> TORCH_NCCL_DUMP_ON_TIMEOUT = {\n    "TORCH_NCCL_DUMP_ON_TIMEOUT"};' in header
    assert "class HeartbeatMonitor {" in header and "bool dumpOnTimeoutOrEx_;" in header
    tests = _source_of("torch", "testing/_internal/distributed/distributed_test.py")
    assert "# Need to disable TORCH_NCCL_DUMP_ON_TIMEOUT otherwise this test times out" in tests
    assert 'os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"' in tests
    # No page presents setting it to 1 as a step: it is already on.
    told = [f"{page.relative_to(ROOT)}:{n}"
            for page in all_pages() for n, text in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in text]
    assert not told, f"pages that tell readers to set TORCH_NCCL_DUMP_ON_TIMEOUT=1, its default: {told}"


def test_monitored_barrier_stops_at_the_first_missing_rank_by_default():
    stated("workshop/session-c/demo.md", r"Without `wait_all_ranks=True` it would stop at the first, rank 1")
    assert inspect.signature(dist.monitored_barrier).parameters["wait_all_ranks"].default is False
    doc = re.sub(r"\s+", " ", inspect.getdoc(dist.monitored_barrier))
    assert "will throw on the first failed rank it encounters in order to fail fast" in doc


def test_deepspeed_optimizer_choice_shm_and_buffer_factor():
    # deepspeed.md: torch_adam picks torch.optim.AdamW; the launcher's LOCAL_SIZE equal to the world
    # size switches on the CPU accelerator's shared-memory collectives; the estimators' CPU margin.
    page = "workshop/session-c/deepspeed.md"
    stated(page, r"`torch_adam: true` picks `torch\.optim\.AdamW`")
    engine = _source_of("deepspeed", "runtime/engine.py")
    assert "return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)" in engine
    stated(page, r"it sets `LOCAL_SIZE` in each process's environment, and\s+when `LOCAL_SIZE` equals the world"
                 r" size DeepSpeed's CPU accelerator switches on its shared-memory\s+collectives")
    assert 'current_env["LOCAL_SIZE"] = str(num_local_procs)' in _source_of("deepspeed", "launcher/launch.py")
    assert "if (size >= 1 && size == ls) { all_ranks_local_p = true; }" in _source_of(
        "deepspeed", "ops/csrc/cpu/comm/shm_interface.cpp")
    [(line, (factor,))] = stated(page, r"The `additional_buffer_factor` of ([\d.]+) in the CPU column")
    from deepspeed.runtime.zero import stage3, stage_1_and_2
    for fn in (stage_1_and_2.estimate_zero2_model_states_mem_needs,
               stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold,
               stage3.estimate_zero3_model_states_mem_needs,
               stage3.estimate_zero3_model_states_mem_needs_all_cold):
        assert inspect.signature(fn).parameters["additional_buffer_factor"].default == float(factor), \
            f"docs/{page}:{line}: {fn.__name__}"


def test_deepspeed_cuda_check_compares_major_and_minor(monkeypatch, capsys):
    # gpu-operations.md (and the Dockerfile's comment): DeepSpeed's op builder compares nvcc's
    # major.minor with torch.version.cuda, forgives a minor mismatch only within its table (CUDA
    # 10-12), and DS_SKIP_CUDA_CHECK=1 skips it. Run on faked versions: no nvcc is needed.
    import importlib.metadata
    page = "workshop/session-c/gpu-operations.md"
    [(line, (version,))] = stated(page, r"DeepSpeed\s+compares major \*and\* minor \(`assert_no_cuda_mismatch` in"
                                        r" `deepspeed/ops/op_builder/builder\.py`,\s+DeepSpeed ([\d.]+)\)")
    assert importlib.metadata.version("deepspeed") == version, f"docs/{page}:{line}"
    from deepspeed.ops.op_builder import builder
    [(line, tables)] = stated(page, r"`cuda_minor_mismatch_ok`, which lists CUDA (\d+), (\d+) and (\d+)")
    assert sorted(builder.cuda_minor_mismatch_ok) == [int(v) for v in tables], f"docs/{page}:{line}"

    def accepts(nvcc: str, torch_cuda: str, skip: bool = False) -> bool:
        monkeypatch.setattr(builder, "installed_cuda_version", lambda name="": tuple(map(int, nvcc.split("."))))
        monkeypatch.setattr(builder.torch.version, "cuda", torch_cuda)
        monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1" if skip else "0")
        try:
            return builder.assert_no_cuda_mismatch("test")
        except builder.CUDAMismatchException:
            return False

    [(line, (nvcc, built))] = stated(page, r"nvcc (\d+\.\d+) with a PyTorch built for (\d+\.\d+) is accepted")
    assert nvcc != built and accepts(nvcc, built), f"docs/{page}:{line}"
    [(line, (major, exact))] = stated(page, r"CUDA (\d+) is not in the table, so a\s+`cu130` PyTorch needs nvcc"
                                            r" (\d+\.\d+) exactly, or `DS_SKIP_CUDA_CHECK=1`")
    assert int(major) not in builder.cuda_minor_mismatch_ok and exact == "13.0", f"docs/{page}:{line}"
    assert accepts(exact, "13.0") and not accepts("13.1", "13.0") and not accepts("12.9", "13.0"), \
        f"docs/{page}:{line}: the same major with another minor is refused"
    assert accepts("13.1", "13.0", skip=True), f"docs/{page}:{line}: DS_SKIP_CUDA_CHECK=1"
    capsys.readouterr()  # the check's own messages
    stated(page, r"DeepSpeed compares major\.minor, and forgives a\s+minor difference only for CUDA 10-12")
    stated(page, r"DeepSpeed's check\s+compares both, and allows no minor mismatch for CUDA 13")
    dockerfile = (ROOT / "snippets/cluster/Dockerfile").read_text()
    assert "tolerates a minor mismatch only for CUDA 10-12, so torch's cu130 needs 13.0 here" in dockerfile
    assert "ARG CUDA_IMAGE=nvidia/cuda:13.0." in dockerfile  # the image's nvcc: 13.0, as the check needs


def test_zero_checkpoint_at_another_dp_size_needs_universal_checkpointing():
    # deepspeed.md and checkpoints-and-logs.md: engine.load_checkpoint refuses optimizer states at
    # another DP size (though the stage-1/2 loader's docstring allows it); ds_to_universal and
    # "load_universal" are the way to change the layout. Read from DeepSpeed 0.19.8's source; the
    # whole path (save on 2 ranks, refused on 1 and 4, converted, loaded on 1 and 4 with the same
    # weights and Adam moments) was run once by hand for the ZeRO-2 tiny GPT.
    import ast
    import importlib.metadata
    page = "workshop/session-c/deepspeed.md"
    [(line, (message, version))] = stated(
        page, r"at another it raises `ZeRORuntimeException` \(\"(Automatic\s+adjustment of ZeRO's optimizer state"
              r" partitioning with a new world size is not currently\s+supported)\", `_load_zero_checkpoint` in"
              r" `deepspeed/runtime/engine\.py`, DeepSpeed ([\d.]+)\)")
    assert importlib.metadata.version("deepspeed") == version, f"docs/{page}:{line}"
    tree = ast.parse(engine := _source_of("deepspeed", "runtime/engine.py"))
    [load] = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_load_zero_checkpoint"]
    load = ast.get_source_segment(engine, load)
    refusal = re.sub(r'"\s*\\?\s*f?"', "", load)  # the message's pieces, joined
    assert "if load_optimizer_states and self.seq_dp_world_size != self.loaded_checkpoint_dp_world_size:" in load
    assert "raise ZeRORuntimeException" in load and " ".join(message.split()) in refusal, f"docs/{page}:{line}"
    assert load.index("if self.load_universal_checkpoint():") < load.index("raise ZeRORuntimeException")
    stated(page, r"The\s+stage-1/2 optimizer's own loader is written for a changed DP size \(the docstring of\s+"
                 r"`_load_legacy_checkpoint` in `deepspeed/runtime/zero/stage_1_and_2\.py`\)")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    doc = re.sub(r"\s+", " ", inspect.getdoc(DeepSpeedZeroOptimizer._load_legacy_checkpoint))
    assert "to support changing GPU count, specifically DP world size, between saving and loading" in doc
    [(line, (flag,))] = stated(page, r"`python -m deepspeed\.checkpoint\.ds_to_universal --input_folder \S+"
                                     r" --output_folder \S+ (--\w+)`")
    to_universal = _source_of("deepspeed", "checkpoint/ds_to_universal.py")
    assert f"parser.add_argument('{flag}'" in to_universal, f"docs/{page}:{line}"
    assert "Required {UNIVERSAL_CHECKPOINT_INFO} state is missing in checkpoint" in to_universal
    [(line, (key,))] = stated(page, r'`"checkpoint": \{"(\w+)": true\}` in the new job\'s config loads it')
    from deepspeed.runtime import constants
    assert (constants.CHECKPOINT, constants.LOAD_UNIVERSAL_CHECKPOINT) == ("checkpoint", key), f"docs/{page}:{line}"
    stated("workshop/session-c/checkpoints-and-logs.md",
           r"DeepSpeed's `engine\.load_checkpoint` refuses\s+the same way when the data-parallel size has changed")


def test_torch_default_inits_of_embedding_and_linear():
    # phase-1.md: nn.Embedding starts at N(0, 1), 50 times GPT-2's 0.02; nn.Linear is uniform,
    # scaled by its input size.
    page = "exercises/phase-1.md"
    [(line, (times, std))] = stated(page, r"`nn\.Embedding` starts at \\\(\\mathcal\{N\}\(0, 1\)\\\), (\w+) times"
                                          r" larger than the ([\d.]+) GPT-2")
    assert {"fifty": 50}[times] * float(std) == 1.0, f"docs/{page}:{line}"
    assert "init.normal_(self.weight)" in inspect.getsource(torch.nn.Embedding.reset_parameters)
    torch.manual_seed(0)
    assert abs(torch.nn.Embedding(1000, 100).weight.std().item() - 1.0) < 0.01
    stated(page, r"`nn\.Linear` uses a uniform distribution scaled by its input size")
    torch.manual_seed(0)
    w = torch.nn.Linear(400, 300).weight
    assert w.abs().max().item() <= 1 / math.sqrt(400) and w.abs().max().item() > 0.99 / math.sqrt(400)


def test_adamw_refuses_a_parameter_in_two_groups():
    # phase-2.md: a tied weight listed in both groups is refused; twice in one group, a warning.
    import warnings
    stated("exercises/phase-2.md", r"listed in both groups, AdamW refuses it \(and within\s+one group,"
                                   r" PyTorch warns about the duplicate\)")
    p = torch.nn.Parameter(torch.ones(2, 2))
    try:
        torch.optim.AdamW([{"params": [p]}, {"params": [p]}])
    except ValueError as e:
        assert "some parameters appear in more than one parameter group" in str(e)
    else:
        raise AssertionError("AdamW accepted one parameter in two groups")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.optim.AdamW([p, p])
    assert any("duplicate parameters" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_clip_grad_norm_returns_the_norm_before_clipping():
    stated("exercises/phase-2.md", r"`clip_grad_norm_` returns the norm \*before\* clipping")
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert torch.nn.utils.clip_grad_norm_([p], max_norm=1.0).item() == 5.0
    assert torch.allclose(p.grad.norm(), torch.tensor(1.0))


def test_fsdp2_policy_defaults_and_gathered_checkpoints():
    # phase-3.md: reduce_dtype's default; get_state_dict with full_state_dict and cpu_offload
    # leaves the result on rank 0 only; DTensors load with weights_only only once
    # torch.distributed.tensor is imported; a root unit's reshard_after_forward default.
    page = "exercises/phase-3.md"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    [(line, (value,))] = stated(page, r"`reduce_dtype`: .* Its\s+default is `(\w+)`, and then the reduction runs in"
                                      r" `param_dtype`")
    assert str(MixedPrecisionPolicy().reduce_dtype) == value, f"docs/{page}:{line}"
    stated(page, r"with `cpu_offload=True` only rank 0 keeps the result\s+\(on the CPU\), and the other ranks get"
                 r" empty dicts")
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    doc = re.sub(r"\s+", " ", inspect.getdoc(StateDictOptions))
    assert ("if ``full_state_dict`` is also true, then only the rank0 will get the state_dict and all other ranks"
            " will get empty state_dict") in doc
    stated(page, r"refuses them in a process that has not imported\s+`torch\.distributed\.tensor` \(whose import"
                 r" registers DTensor with `torch\.serialization\.add_safe_globals`\)")
    from torch.distributed.tensor import DTensor
    assert DTensor in torch.serialization.get_safe_globals()
    assert "must be imported to load DTensors" in _source_of("torch", "_weights_only_unpickler.py")
    stated(page, r"which is what FSDP2's default, `None`, picks for a\s+root")
    assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
    doc = re.sub(r"\s+", " ", inspect.getdoc(fully_shard))
    assert "If ``None``, it is set to ``True`` for non-root modules and ``False`` for root modules." in doc


def test_new_group_does_not_inherit_the_world_timeout():
    # phase-4.md, exercise 26: a group created without timeout= gets the backend's default.
    stated("exercises/phase-4.md", r"a group does not inherit the world's timeout")
    from torch.distributed import distributed_c10d
    assert inspect.signature(dist.new_group).parameters["timeout"].default is None
    src = inspect.getsource(distributed_c10d._new_group_with_tag)
    assert "if timeout is None:\n        timeout = _get_default_timeout(backend)" in src


def test_fp16_smallest_number_and_what_rounds_to_zero():
    # Session B: fp16's smallest normal number is about 6e-5; its smallest number is 2^-24, and
    # values below half of that round to zero.
    page = "workshop/session-b/slides.md"
    [(line, (normal, power))] = stated(
        page, r"fp16's smallest normal number is \\\((\d) \\times 10\^\{-5\}\\\)\. Below it precision drops bit by"
              r" bit, down\s+to its smallest number, \\\(2\^\{-(\d+)\}")
    fp16 = torch.float16
    assert round(torch.finfo(fp16).smallest_normal * 1e5) == int(normal), f"docs/{page}:{line}"
    smallest = 2.0 ** -int(power)
    assert torch.tensor(smallest).to(fp16).item() == smallest, f"docs/{page}:{line}"
    assert torch.tensor(smallest / 2 * 1.01).to(fp16).item() == smallest  # just above half: kept
    assert torch.tensor(smallest / 2).to(fp16).item() == 0.0  # half (a tie, to even): zero
    assert torch.tensor(smallest / 2 * 0.99).to(fp16).item() == 0.0


# ------------------------------------------------- the Python that the pinned packages need

def pinned_packages() -> dict[str, str]:
    """The packages `make` installs, name -> pinned version: the dependencies and the site, test
    and wandb extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = project["dependencies"] + extras["site"] + extras["test"] + extras["wandb"]
    return dict(pin.split("==") for pin in pins)


def test_the_stated_python_is_the_oldest_every_pin_installs_on():
    """README, the home page and pyproject's requires-python name the oldest Python on which
    every pinned package installs, from each one's Requires-Python. They said 3.10 while numpy
    2.4.6 needs 3.11, and pymdown-extensions 13.1 needed 3.11.5: `make` failed on Debian 12's
    Python 3.11.2."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    pins = pinned_packages()
    installed = {name: metadata.version(name).split("+")[0] for name in pins}  # 2.13.0+cpu
    assert installed == pins  # the metadata read below is the pinned versions'
    needs = {name: SpecifierSet(metadata.metadata(name).get("Requires-Python") or "")
             for name in pins}
    candidates = [f"3.{minor}.{patch}" for minor in range(8, 20) for patch in range(30)]
    oldest = next(v for v in candidates if all(spec.contains(v) for spec in needs.values()))
    minor = oldest.rsplit(".", 1)[0]
    patch_needed = {name: str(spec) for name, spec in needs.items()
                    if not spec.contains(minor + ".0")}
    assert oldest == minor + ".0", (
        f"{patch_needed} need Python {oldest}, a patch release that Linux distributions may not "
        f"ship (Debian 12 has 3.11.2): pin a version that installs on {minor}.0")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={minor}", (project["requires-python"], minor)
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"You need Python (3\.\d+)\+", readme) == [minor]
    assert [groups for _, groups in stated("index.md", r"You need Python (3\.\d+) or newer")] == [
        (minor,)]


def test_flight_recorder_dump_location_and_reader():
    """gpu-operations.md: where the dumps go, and what torchfrtrace's options do. The writer is
    C++ (DebugInfoWriter::getWriter, not shipped as source): the pinned library holds the names
    of the variables it reads and the default file name; the reader is Python."""
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from tests.test_facts import TORCH_DIR

    page = "workshop/session-c/gpu-operations.md"
    stated(page, r"The prefix comes from `TORCH_FR_DUMP_TEMP_FILE` \(the older name `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`"
                 r" still works\); left unset, it is `comm_lib_trace_rank_` under `\$XDG_CACHE_HOME/torch`, else"
                 r" `~/.cache/torch`")
    library = (TORCH_DIR / "lib" / "libtorch_cpu.so").read_bytes()
    for name in (b"TORCH_FR_DUMP_TEMP_FILE\0", b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE\0", b"XDG_CACHE_HOME\0",
                 b"/.cache\0", b"/torch\0", b"comm_lib_trace_r"):
        assert name in library, name
    entry_points = next(TORCH_DIR.parent.glob("torch-*.dist-info")) / "entry_points.txt"
    assert "torchfrtrace = torch.distributed.flight_recorder.fr_trace:main" in entry_points.read_text()
    stated(page, r"\(`--mismatch_cap`, 10 by default\)")
    stated(page, r"`--selected-ranks` works only\s+with `-j`")
    parser = JobConfig()
    args = parser.parse_args(["dumps", "--prefix", "rank_", "-j", "--selected-ranks", "3", "5"])
    assert (args.prefix, args.just_print_entries, args.selected_ranks, args.mismatch_cap) == ("rank_", True, [3, 5], 10)
    assert args.allow_incomplete_ranks is False
    with pytest.raises(AssertionError, match="Not support selecting ranks without printing entries"):
        parser.parse_args(["dumps", "--selected-ranks", "3"])


# ------------------------------------------- the second audit (issue 34): one claim, one source

def test_distributed_debug_levels_and_unused_parameter_names():
    # environment-variables.md: OFF is the default, and INFO already makes DDP's unused-parameter
    # error name the parameters (the message is compiled into the reducer; the wheel ships it).
    from tests.test_facts import TORCH_DIR
    page = "reference/environment-variables.md"
    [(line, (default, first, second, named_a, named_b))] = stated(
        page, r"\| `TORCH_DISTRIBUTED_DEBUG` \| `(\w+)` \(default\), `(\w+)`, `(\w+)`\. With `(\w+)` or `(\w+)`,"
              r" DDP's unused-parameter errors name the parameters")
    library = (TORCH_DIR / "lib" / "libtorch_cpu.so").read_bytes()
    levels = f"The value of TORCH_DISTRIBUTED_DEBUG must be {default}, {first}, or {second}.".encode()
    assert levels in library, f"docs/{page}:{line}"
    names = (f"TORCH_DISTRIBUTED_DEBUG to either {named_a} or {named_b} to print out information about which"
             " particular parameters did not receive gradient").encode()
    assert names in library, f"docs/{page}:{line}"
    before = dist.get_debug_level()
    saved = os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    try:
        dist.set_debug_level_from_env()  # unset: the default
        assert dist.get_debug_level().name == default, f"docs/{page}:{line}"
    finally:
        if saved is not None:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = saved
        dist.set_debug_level(before)


def test_gradscaler_skips_an_overflowing_step_and_halves_the_scale():
    # cheat-sheets.md and the glossary: dynamic loss scaling skips the step and halves the scale.
    [(line, (verb,))] = stated("reference/cheat-sheets.md",
                               r"which skips steps whose gradients overflow and (\w+) the scale")
    stated("reference/glossary.md", r"skip steps that overflow and halve \$S\$ \(dynamic scaling\)")
    factor = {"halves": 0.5}[verb]
    assert inspect.signature(torch.amp.GradScaler).parameters["backoff_factor"].default == factor, \
        f"docs/reference/cheat-sheets.md:{line}"
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))  # starts the scaler, as scaler.scale(loss) would
    p.grad = torch.tensor([math.inf, 1.0])
    scaler.step(opt)
    scaler.update()
    assert p.tolist() == [1.0, 1.0] and scaler.get_scale() == 4.0 * factor


def test_ddp_broadcasts_rank_0s_weights_at_construction():
    # glossary and interview.md: DDP starts every replica from rank 0's weights.
    for page, pattern in [("reference/glossary.md", r"DDP broadcasts rank (\d)'s initial weights"),
                          ("reference/interview.md", r"\(rank (\d)'s\s+weights are broadcast once at the start\)")]:
        [(line, (rank,))] = stated(page, pattern)
        src = inspect.getsource(torch.nn.parallel.DistributedDataParallel.__init__)
        assert re.search(rf"_sync_module_states\([^)]*src={rank},", src), f"docs/{page}:{line}"
    assert inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters["init_sync"].default is True
    from torch.distributed import utils
    assert "dist._broadcast_coalesced(" in inspect.getsource(utils._sync_params_and_buffers)


def test_shard_grad_op_holds_the_weights_from_forward_to_the_end_of_backward():
    # zero-concept.md: FSDP's SHARD_GRAD_OP is ZeRO-2 during a step; cheat-sheets.md: FSDP2's
    # reshard_after_forward=False is the same choice (torch itself names the hybrid variant ZERO2).
    from torch.distributed.fsdp import ShardingStrategy, fully_shard
    stated("course/week-2/zero-concept.md",
           r"FSDP's \"shard grad op\" strategy is ZeRO-2 in what it sends and\s+what it holds during a step \(it"
           r" gathers the weights once, before forward, and keeps them whole\s+until backward ends; only between"
           r" steps are they sharded too\)")
    doc = re.sub(r"\s+", " ", inspect.getdoc(ShardingStrategy))
    assert ("``SHARD_GRAD_OP``: Gradients and optimizer states are sharded during computation, and additionally,"
            " parameters are sharded outside computation. For the parameters, this strategy unshards before the"
            " forward, does not reshard them after the forward, and only reshards them after the backward"
            " computation.") in doc
    assert "``_HYBRID_SHARD_ZERO2``: Apply ``SHARD_GRAD_OP`` within a node" in doc
    stated("reference/cheat-sheets.md", r"FSDP2 `fully_shard` \(ZeRO-3; `reshard_after_forward=False` is ZeRO-2\)")
    doc = re.sub(r"\s+", " ", inspect.getdoc(fully_shard))
    assert ("If ``False``, then this keeps the unsharded parameters in memory after forward and avoids the"
            " all-gather in backward.") in doc


def test_e4m3fn_has_no_infinity_and_one_nan_pattern():
    # low-precision.md: e4m3fn's all-ones exponent holds numbers, 256 to 448; only S.1111.111 is NaN.
    page = "course/week-3/low-precision.md"
    [(line, (low, high))] = stated(page, r"here holds (\d+) to (\d+), and only S\.1111\.111 is\s+NaN")
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert [i for i in range(256) if math.isnan(values[i])] == [0b0_1111_111, 0b1_1111_111]
    assert not torch.isinf(values).any()
    top_binade = values[0b0_1111_000:0b0_1111_111]  # exponent 1111, mantissa 000 to 110
    assert (top_binade.min().item(), top_binade.max().item()) == (int(low), int(high)), f"docs/{page}:{line}"


def test_pipeline_schedules_scale_grads_split_batches_and_multi_stage_classes():
    # pipeline-torch.md: the schedules divide the gradients by m unless scale_grads=False; the batch
    # is cut along dimension 0; the schedules named as holding several stages per rank do.
    from torch.distributed.pipelining import microbatch, schedules
    page = "course/week-3/pipeline-torch.md"
    [(line, (default,))] = stated(page, r"By default \(`scale_grads=(True|False)`\) the schedule divides the"
                                        r" accumulated\s+gradients by \$m\$ after the last backward")
    for cls in (schedules.ScheduleGPipe, schedules.Schedule1F1B):
        assert str(inspect.signature(cls).parameters["scale_grads"].default) == default, f"docs/{page}:{line}"
        assert "perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)" in \
            inspect.getsource(cls._step_microbatches), cls
    stated(page, r"cuts the batch into\s+`n_microbatches` along dimension 0 itself")
    assert microbatch.DEFAULT_CHUNK_DIM == 0
    [(line, (paragraph,))] = stated(page, r"Beyond GPipe and 1F1B, the library has the schedules that need more than"
                                          r" one stage per rank:([\s\S]*?)They take a list of `PipelineStage`s")
    named = re.findall(r"`(Schedule\w+)`", paragraph)
    assert len(named) == 5, named
    for name in named:
        assert issubclass(getattr(schedules, name), schedules.PipelineScheduleMulti), f"docs/{page}:{line}: {name}"


def test_prepare_module_input_hands_on_a_dtensor_by_default():
    # tensor-parallel-torch.md: q, k and v receive the same DTensor from PrepareModuleInput.
    from torch.distributed.tensor.parallel import PrepareModuleInput
    page = "course/week-4/tensor-parallel-torch.md"
    [(line, (value,))] = stated(page, r"turns the input into a DTensor once \(its `use_local_output` defaults to"
                                      r" `(True|False)`")
    assert str(inspect.signature(PrepareModuleInput).parameters["use_local_output"].default) == value, \
        f"docs/{page}:{line}"


def test_deepspeed_default_adam_launcher_checkpoint_names_and_zero_to_fp32():
    # deepspeed.md, read from DeepSpeed 0.19.8's source: without torch_adam, DeepSpeedCPUAdam when
    # the optimizer is offloaded, else FusedAdam; the launcher passes --local_rank; model states in
    # one file below stage 3, one per rank at stage 3; zero_to_fp32's output and shard size.
    import ast
    page = "workshop/session-c/deepspeed.md"
    stated(page, r"without it DeepSpeed picks its fused CUDA Adam on GPUs, or `DeepSpeedCPUAdam` when the"
                 r" optimizer is offloaded")
    engine = _source_of("deepspeed", "runtime/engine.py")
    [choose] = [f for f in ast.walk(ast.parse(engine))
                if isinstance(f, ast.FunctionDef) and f.name == "get_optimizer_configuration"]
    choose = ast.get_source_segment(engine, choose)
    order = ["if torch_adam:", "if self.zero_use_cpu_optimizer():", "DeepSpeedCPUAdam", "return FusedAdam"]
    assert [choose.index(s) for s in order] == sorted(choose.index(s) for s in order)
    stated(page, r"starts one process per GPU like `torchrun` and passes each\s+its `--local_rank`")
    assert 'cmd.append(f"--local_rank={local_rank}")' in _source_of("deepspeed", "launcher/launch.py")
    [(line, (single,))] = stated(page, r"With stage 2 there is a single `(\w+\.pt)` \(every rank has the whole\s+"
                                       r"model\); with stage 3 each rank writes its own model-states file")
    [name] = [f for f in ast.walk(ast.parse(engine)) if isinstance(f, ast.FunctionDef) and f.name == "_get_ckpt_name"]
    name = ast.get_source_segment(engine, name)
    assert name.index("if self.zero_optimization_partition_weights():") < name.index('"zero_pp_rank_{}"')
    assert single == "mp_rank_00_model_states.pt" and '"mp_rank_" + mp_rank_str + "_model_states.pt"' in name, \
        f"docs/{page}:{line}"
    [(line, (weights, shard))] = stated(page, r"writes `(\S+)` into `OUTPUT_DIR` \(safetensors\s+with"
                                              r" `--safe_serialization`; a model larger than `--max_shard_size`,"
                                              r" (\w+) by default")
    script = _source_of("deepspeed", "utils/zero_to_fp32.py")
    assert f'weights_name = "model.safetensors" if safe_serialization else "{weights}"' in script, f"docs/{page}:{line}"
    assert re.search(rf'"--max_shard_size",\s+type=str,\s+default="{shard}"', script), f"docs/{page}:{line}"


def test_torchrun_reads_node_rank_only_for_the_static_rendezvous():
    # environment-variables.md: NODE_RANK is the scripts' name; torchrun's --node_rank counts only
    # with the static rendezvous, and its workers get GROUP_RANK (tested above).
    page = "reference/environment-variables.md"
    [(line, (backend,))] = stated(page, r"torchrun takes it as `--node_rank` \((\w+) rendezvous only\) and gives"
                                        r" workers `GROUP_RANK`")
    from torch.distributed import run
    src = inspect.getsource(run.config_from_args)
    assert f'and args.rdzv_backend != "{backend}"' in src, f"docs/{page}:{line}"
    assert f"node_rank is only used for {backend} rdzv_backend. It will be ignored" in src, f"docs/{page}:{line}"
