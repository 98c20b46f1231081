"""Facts the pages state, checked against the library that defines them, and against each other.

Two kinds of test:

* **Stated defaults.** A page that says "30 minutes for gloo" is read with a regex anchored on
  that sentence, and the number is compared with the value torch (or DeepSpeed, or the course's
  own code) exposes. A torch upgrade that changes a default fails here, naming the page. If a
  page is reworded so that the sentence is gone, the test fails too: update the pattern, and
  keep the fact checked.
* **Consistency.** The same quantity (a default timeout, the bubble formula, bytes per
  parameter, the "node 3 of 4" convention, fraction arithmetic) is scanned for in every page
  under docs/, and every statement that disagrees is reported as page:line.

Plus one measurement: FSDP2's SHARD_GRAD_OP keeps only the weights unsharded after forward
(docs/course/week-2/fsdp.md), counted on the tiny model over 2 gloo ranks.
"""

import inspect
import math
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.kernel_independent("the pages' statements against library constants and formulas")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TORCH_DIR = Path(torch.__file__).parent


# ---------------------------------------------------------------- helpers

def page_text(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def stated(page: str, pattern: str) -> list[tuple[int, tuple[str, ...]]]:
    """Every (line, groups) where `pattern` matches the page; whitespace in the pattern matches
    any run of whitespace (sentences wrap). Fails if the page no longer says it at all."""
    text = page_text(page)
    regex = re.compile(re.sub(r"(?:\\ |\s)+", r"\\s+", pattern))
    found = [(line_of(text, m.start()), m.groups()) for m in regex.finditer(text)]
    assert found, (f"docs/{page} no longer states what this test checks (pattern {pattern!r}); "
                   "if the sentence moved or was reworded, update the pattern, keep the check")
    return found


def all_pages():
    return sorted(p for p in DOCS.rglob("*.md") if "assets" not in p.parts)


def header_constant(header: str, name: str) -> int:
    """An integer constant such as `std::chrono::milliseconds(10 * 60 * 1000)` from torch's
    shipped C++ headers (the CPU wheel has no NCCL, but ships the header that defines it)."""
    text = (TORCH_DIR / "include/torch/csrc/distributed/c10d" / header).read_text()
    m = re.search(name + r"\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)", text)
    assert m, f"{name} not found in {header}"
    return math.prod(int(x) for x in m.group(1).split("*"))


def gloo_default_timeout() -> timedelta:
    from torch.distributed import constants
    return constants.default_pg_timeout


def nccl_default_timeout() -> timedelta:
    from torch.distributed import constants
    if constants.default_pg_nccl_timeout is not None:  # a CUDA build
        return constants.default_pg_nccl_timeout
    # A CPU build has no NCCL, so `default_pg_nccl_timeout` is None there; the value it would
    # have comes from this constant (torch/distributed/constants.py imports it from C++).
    ms = header_constant("ProcessGroupNCCL.hpp", "kProcessGroupNCCLDefaultTimeout")
    return timedelta(milliseconds=ms)


def minutes(td: timedelta) -> int:
    return round(td.total_seconds() / 60)


def rendezvous_join_timeout_s() -> int:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
    return round(RendezvousTimeout().join.total_seconds())


def static_rendezvous_timeout_s() -> int:
    """The static backend's own fallback, for a launcher that passes no timeout (torchrun passes one)."""
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    return static_tcp_rendezvous._default_timeout_seconds


def torchrun_static_rendezvous_timeout_s(log_dir) -> int:
    """The timeout a static rendezvous gets under `torchrun --nnodes=2 --node_rank=0 --master_addr=...`
    with no --rdzv_conf: the handler built, as launch_agent builds it, from the LaunchConfig
    torchrun makes (its __post_init__ fills in rdzv_configs["timeout"]). Nothing is connected."""
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    config, _, _ = run.config_from_args(run.parse_args(
        [f"--log-dir={log_dir}", "--nnodes=2", "--node_rank=0", "--master_addr=127.0.0.1",
         "--master_port=29500", "train.py"]))
    assert config.rdzv_backend == "static", config.rdzv_backend
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    return round(create_rdzv_handler(params).timeout.total_seconds())


def course_timeout_s() -> int:
    from snippets.dist import DEFAULT_TIMEOUT_S
    return round(DEFAULT_TIMEOUT_S)


# ---------------------------------------------------------------- stated defaults, per page

def test_library_defaults_themselves():
    # The values the pages are checked against, read two ways where torch offers two.
    assert gloo_default_timeout() == timedelta(
        milliseconds=header_constant("Backend.hpp", "kBackendDefaultTimeout"))
    from torch.distributed.distributed_c10d import Backend, _get_default_timeout
    assert _get_default_timeout(Backend.GLOO) == gloo_default_timeout()


@pytest.mark.parametrize("page, pattern", [
    ("workshop/session-c/demo.md", r"by default (\d+) minutes for gloo and (\d+) minutes for NCCL"),
    ("workshop/session-c/demo.md", r"default timeout, (\d+) minutes for gloo and (\d+) for NCCL"),
    ("reference/debugging.md", r"PyTorch's default timeouts are long: (\d+) minutes for gloo, (\d+) for NCCL"),
])
def test_gloo_and_nccl_default_timeouts(page, pattern):
    expected = (minutes(gloo_default_timeout()), minutes(nccl_default_timeout()))
    for line, groups in stated(page, pattern):
        assert tuple(map(int, groups)) == expected, (
            f"docs/{page}:{line} says gloo {groups[0]} min, NCCL {groups[1]} min; torch "
            f"{torch.__version__} has {expected[0]} and {expected[1]} "
            "(torch.distributed.constants.default_pg_timeout, default_pg_nccl_timeout)")


@pytest.mark.parametrize("page, pattern", [
    ("workshop/session-c/gpu-operations.md", r"process group's timeout \((\d+) minutes by default for NCCL\)"),
    ("workshop/session-c/gpu-operations.md", r"With the default (\d+)-minute timeout"),
])
def test_nccl_default_timeout(page, pattern):
    for line, (value,) in stated(page, pattern):
        assert int(value) == minutes(nccl_default_timeout()), f"docs/{page}:{line}"


def test_rendezvous_timeout_on_kubernetes_page(tmp_path, monkeypatch):
    page = "workshop/session-c/kubernetes.md"
    for name in ("PET_RDZV_CONF", "PET_RDZV_BACKEND", "PET_NNODES", "PET_NODE_RANK"):
        monkeypatch.delenv(name, raising=False)  # torchrun's flag defaults
    # The Job's static rendezvous: torchrun's own timeout, not the backend's fallback.
    [(line, (static, fallback))] = stated(
        page, r"sits in the\s+rendezvous and gives up, by default, after (\d+) s with this Job's static rendezvous"
              r" \(`--master_addr`\): torchrun passes `timeout=\1` itself \(`LaunchConfig` in"
              r" `torch/distributed/launcher/api\.py`\), which replaces the static backend's"
              r" own (\d+)\.")
    assert int(static) == torchrun_static_rendezvous_timeout_s(tmp_path), f"docs/{page}:{line} (static rendezvous)"
    assert int(fallback) == static_rendezvous_timeout_s(), f"docs/{page}:{line} (static fallback)"
    [(line, (join,))] = stated(page, r"A `c10d` rendezvous ignores that key and gives up after its\s+`join_timeout`,"
                                     r" (\d+) s")
    assert int(join) == rendezvous_join_timeout_s(), f"docs/{page}:{line} (c10d join_timeout)"
    stated(page, r"--rdzv_conf timeout=\d+")       # the static backend's key ...
    stated(page, r"--rdzv_conf join_timeout=\d+")  # ... and c10d's, both real parameter names
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    assert '"timeout" in params.config' in inspect.getsource(static_tcp_rendezvous.create_rdzv_handler)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    assert '_get_timeout(params, "join")' in inspect.getsource(dynamic_rendezvous.create_handler)


def test_course_timeout():
    for line, (value,) in stated("workshop/session-c/demo.md", r"(\d+) s in this course"):
        assert int(value) == course_timeout_s(), f"docs/workshop/session-c/demo.md:{line}"


def test_exercise_15_check_timeout():
    # exercises/phase-3.md: a rank that skips get_state_dict is reported after the check's own
    # collective timeout, the timeout_s that check_fsdp_checkpoint passes to snippets.dist.spawn.
    page = "exercises/phase-3.md"
    [(line, (value,))] = stated(page, r"the check reports that after (\d+) seconds")
    from snippets.exercises.checks import ex15_fsdp_checkpoint as checks
    src = inspect.getsource(checks.check_fsdp_checkpoint)
    [passed] = re.findall(r"spawn\(_fsdp_checkpoint_worker, .*timeout_s=(\d+)\)", src)
    assert int(value) == int(passed), f"docs/{page}:{line}: the check passes timeout_s={passed}"
    assert f"a rank waited {passed} s for the other" in src, "the check's own message disagrees"


def test_youngs_checkpoint_interval_in_lab_2():
    # workshop/session-b/lab-2.md, challenge 2: Young's interval sqrt(2 x save x MTBF).
    page = "workshop/session-b/lab-2.md"
    [(line, (save, hours, interval))] = stated(
        page, r"with a (\d+)-minute\s+save and a failure every (\d+) hours, about every (\d+) minutes")
    assert round(math.sqrt(2 * int(save) * 60 * int(hours))) == int(interval), f"docs/{page}:{line}"


def test_nccl_async_error_handling_defaults():
    page = "reference/environment-variables.md"
    [(line, (default, torchrun))] = stated(
        page, r"`(\d)` end the process without aborting \(PyTorch's current default\); torchrun sets `(\d)`")
    header = (TORCH_DIR / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp").read_text()
    assert re.search(rf"the default value \({default} - SkipCleanUp\)", header), f"docs/{page}:{line}"
    from torch.distributed.elastic.agent.server import local_elastic_agent
    src = inspect.getsource(local_elastic_agent)
    assert re.search(r'"TORCH_NCCL_ASYNC_ERROR_HANDLING", str\((\d)\)', src).group(1) == torchrun, \
        f"docs/{page}:{line}"
    stated("workshop/session-c/gpu-operations.md",
           rf"torchrun's default; without torchrun PyTorch's default is `{default}`")


def test_flight_recorder_default_buffer():
    header = (TORCH_DIR / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp").read_text()
    m = re.search(r'\{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"\}, (\d+)\)', header)
    assert m, "FlightRecorder.hpp no longer reads TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE"
    for page, pattern in [
            ("workshop/session-c/gpu-operations.md", r"\((\d+) entries is already torch 2.13's default buffer; `TORCH_FR_BUFFER_SIZE`"),
            ("reference/environment-variables.md", r"newer name `TORCH_FR_BUFFER_SIZE`; default (\d+) entries")]:
        for line, (value,) in stated(page, pattern):
            assert value == m.group(1), f"docs/{page}:{line}"


def test_nccl_communicators_are_created_lazily_unless_device_id():
    # Session C's slides: NCCL bootstraps at the first collective, unless device_id= is given.
    stated("workshop/session-c/slides.md", r"PyTorch creates NCCL communicators \*lazily\*")
    stated("workshop/session-c/slides.md", r"Passing `device_id=torch.device\(\"cuda\", local_rank\)`")
    doc = re.sub(r"\s+", " ", inspect.getdoc(dist.init_process_group))
    assert "the communicator is immediately formed" in doc and "normal lazy call" in doc


def test_torchrun_workers_are_store_clients():
    # Session C: under torchrun node 0's agent hosts the store; with plain env:// rank 0 does.
    stated("workshop/session-c/demo.md", r"every worker, rank 0 included, is only a client")
    import importlib
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    assert '"TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store)' in inspect.getsource(local_elastic_agent)
    assert StaticTCPRendezvous.use_agent_store.fget(None) is True
    src = inspect.getsource(rendezvous._create_c10d_store)
    assert "is_master=False" in src and "start_daemon = rank == 0" in src


def test_deepspeed_persistence_threshold():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    default = DeepSpeedZeroConfig.model_fields["param_persistence_threshold"].default
    for page, pattern in [("workshop/session-c/deepspeed.md", r"The default \((\d+) (\d+) elements\)"),
                          ("workshop/session-c/deepspeed.md", r"default threshold of (\d+) (\d+)")]:
        for line, groups in stated(page, pattern):
            assert int("".join(groups)) == default, f"docs/{page}:{line}"


def test_deepspeed_counts_18_bytes_per_sharded_parameter():
    page = "workshop/session-c/deepspeed.md"
    [(line, (ds, paper2, paper3))] = stated(
        page, r"DeepSpeed counts (\d+) bytes per sharded parameter, the paper (\d+) \(stage 2\) or (\d+) \(stage 3\)")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    psi, n = 10**9, 8
    _, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, cpu_offload=False)  # (cpu, gpu)
    assert gpu == 2 * psi + int(ds) * psi // n, f"docs/{page}:{line}"
    # The ZeRO paper (Rajbhandari et al. 2020, section 5): Pos+g keeps 2 + (2 + 12)/N bytes,
    # Pos+g+p (2 + 2 + 12)/N: the sharded parts are 14 and 16 bytes per parameter.
    assert (int(paper2), int(paper3)) == (2 + 12, 2 + 2 + 12), f"docs/{page}:{line}"


def test_collective_names():
    # Current names in torch 2.13, and the old ones deprecated (distributed_c10d.py).
    for current, old in [("all_gather_single", "all_gather_into_tensor"),
                         ("reduce_scatter_single", "reduce_scatter_tensor")]:
        assert not hasattr(getattr(dist, current), "__deprecated__"), current
        assert current in getattr(dist, old).__deprecated__, old
    from torch.distributed import _functional_collectives as funcol
    for current, old in [("all_gather_single", "all_gather_tensor"),
                         ("reduce_scatter_single", "reduce_scatter_tensor")]:
        assert hasattr(funcol, current)
        assert f"Please use `torch.distributed._functional_collectives.{current}`" in \
            inspect.getsource(getattr(funcol, old))
    stated("course/week-4/tensor-parallel-torch.md",
           r"`all_reduce`, `all_gather_single`, `reduce_scatter_single` of")


def test_ddp_bucket_sizes():
    from torch.nn.parallel import distributed as ddp_module
    page = "workshop/session-b/slides.md"
    [(line, (cap,))] = stated(page, r"DDP's default `bucket_cap_mb` is (\d+) MiB")
    assert inspect.signature(ddp_module.DistributedDataParallel).parameters["bucket_cap_mb"].default is None
    assert int(cap) == ddp_module._DEFAULT_BUCKET_CAP_MB, f"docs/{page}:{line}"
    [(line, (first,))] = stated(page, r"DDP also makes its \*\*first\*\* bucket \(the last layers' gradients\) only (\d+) MiB")
    assert int(first) * 2**20 == dist._DEFAULT_FIRST_BUCKET_BYTES, f"docs/{page}:{line}"


def _default(obj, name):
    return inspect.signature(obj).parameters[name].default


@pytest.mark.parametrize("page, pattern, obj, name", [
    ("course/week-3/pipeline-torch.md", r"By default \(`scale_grads=(True|False)`\)",
     "torch.distributed.pipelining.schedules.Schedule1F1B", "scale_grads"),
    ("workshop/session-b/lab-2.md", r"With the default `drop_last=(True|False)`",
     "torch.utils.data.DistributedSampler", "drop_last"),
    ("course/week-4/tensor-parallel-torch.md", r"its `use_local_output` defaults to `(True|False)`",
     "torch.distributed.tensor.parallel.PrepareModuleInput", "use_local_output"),
    ("course/week-1/ddp-from-scratch.md", r"DDP makes the same two copies by default and skips them with\s+`gradient_as_bucket_view=(True|False)`",
     "torch.nn.parallel.DistributedDataParallel", "gradient_as_bucket_view"),
])
def test_boolean_defaults(page, pattern, obj, name):
    import importlib
    module, _, attr = obj.rpartition(".")
    default = _default(getattr(importlib.import_module(module), attr), name)
    for line, (value,) in stated(page, pattern):
        if name == "gradient_as_bucket_view":  # the page names the flag that turns copies off
            assert value == str(not default), f"docs/{page}:{line}"
        else:
            assert value == str(default), f"docs/{page}:{line}: {obj}({name}={default})"


def test_monitored_barrier_is_gloo_only():
    stated("workshop/session-c/demo.md", r"`monitored_barrier` \(gloo only\)")
    doc = re.sub(r"\s+", " ", inspect.getdoc(dist.monitored_barrier))
    assert "this collective is only supported with the GLOO backend" in doc


def test_accelerate_batch_size_is_per_process_by_default():
    stated("course/week-1/accelerate.md", r"\*\*The batch size is per process\*\* by default")
    from accelerate.utils import DataLoaderConfiguration
    assert DataLoaderConfiguration().split_batches is False
    assert DataLoaderConfiguration().even_batches is True  # the page's "`even_batches=False` gives uneven shares"


def test_optimizer_default_implementation_on_cuda_is_foreach():
    stated("reference/profiling.md", r"On CUDA, the default is the \*foreach\* implementation")
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices
    assert _default(torch.optim.AdamW, "fused") is None and _default(torch.optim.AdamW, "foreach") is None
    assert "cuda" in _get_foreach_kernels_supported_devices()


def test_fully_shard_root_not_resharded_by_default():
    stated("course/week-2/fsdp.md", r"\(`reshard_after_forward=None`\) makes the same choice for the root")
    from torch.distributed.fsdp import fully_shard
    doc = re.sub(r"\s+", " ", inspect.getdoc(fully_shard))
    assert "If ``None``, it is set to ``True`` for non-root modules and ``False`` for root modules" in doc


FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}


def _number(cell: str) -> float:
    cell = cell.replace(" ", "").replace("×10^", "e").replace("^", "e")
    return float(cell)


def test_float_formats_table_matches_finfo():
    page = "reference/cheat-sheets.md"
    rows = stated(page, r"\n\| (fp32|bf16|fp16|fp8 e4m3|fp8 e5m2) \| 1, (\d+), (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|")
    assert len(rows) == 5
    for line, (name, exp_bits, man_bits, largest, smallest, eps) in rows:
        fi = torch.finfo(FORMATS[name])
        assert fi.bits == 1 + int(exp_bits) + int(man_bits), f"docs/{page}:{line + 1}"
        for stated_value, true in [(largest, fi.max), (smallest, fi.smallest_normal), (eps, fi.eps)]:
            # The table rounds to 2 significant digits.
            assert math.isclose(_number(stated_value), true, rel_tol=0.05), \
                f"docs/{page}:{line + 1}: {name} {stated_value.strip()} vs torch.finfo {true}"


def test_fsdp_page_dtype_table_matches_finfo():
    page = "course/week-2/fsdp.md"
    rows = stated(page, r"\n\| (fp32|bf16|fp16) \| (\d+) \| (\d+) \| ([\d.e-]+) \| ([\d.e]+) \|")
    for line, (name, exp_bits, man_bits, smallest, largest) in rows:
        fi = torch.finfo(FORMATS[name])
        assert fi.bits == 1 + int(exp_bits) + int(man_bits), f"docs/{page}:{line + 1}"
        assert math.isclose(float(smallest), fi.smallest_normal, rel_tol=0.05), f"docs/{page}:{line + 1}"
        assert math.isclose(float(largest), fi.max, rel_tol=0.05), f"docs/{page}:{line + 1}"


def _bench(*keys):
    import json
    value = json.loads((ROOT / "bench.json").read_text(encoding="utf-8"))["results"]
    for key in keys:
        value = value[key]
    return value


BUBBLE_RATIO = r"\{\{ bench:pipeline_bubble\.bubble\.(\d+)\.(1f1b|gpipe)_ratio:\.2f \}\}×"


def test_interview_bubble_claim_matches_the_measured_table():
    # reference/interview.md quotes the worst 1F1B ratio; week 3's table is the run it came from.
    # Both render it from bench.json, from the same row, which must be the p=2, m=8 one.
    rows = _bench("pipeline_bubble", "bubble")
    quoted = {}
    for page, pattern in [
            ("reference/interview.md", BUBBLE_RATIO + r" the formula at 2\s+stages and 8 micro-batches"),
            ("course/week-3/pipeline-from-scratch.md", r"1F1B measured\s+" + BUBBLE_RATIO + " the formula there")]:
        [(line, (index, schedule))] = stated(page, pattern)
        row = rows[int(index)]
        assert (schedule, row["stages"], row["micro_batches"]) == ("1f1b", 2, 8), f"docs/{page}:{line}"
        quoted[page] = index
        # A ratio typed by hand beside the formula would drift from the run: none may remain.
        hand = re.findall(r"(?<![{\w.])\d\.\d+ ?× the formula", page_text(page))
        assert not hand, f"docs/{page}: {hand}: render it from bench.json"
    assert len(set(quoted.values())) == 1, quoted


def test_pipeline_bubble_observations_hold_in_bench_json():
    """What pipeline-from-scratch.md's "What to observe" says about the run in bench.json."""
    page = "course/week-3/pipeline-from-scratch.md"
    rows = _bench("pipeline_bubble", "bubble")
    cell = {(r["stages"], r["micro_batches"]): r for r in rows}
    stated(page, r"The formula predicts the ranking everywhere")
    for schedule in ("1f1b", "gpipe"):
        for (p, m), r in cell.items():
            if (p, 2 * m) in cell:  # more micro-batches, smaller bubble
                assert cell[(p, 2 * m)][schedule] < r[schedule], (schedule, p, m)
            if (2 * p, m) in cell:  # more stages, larger
                assert cell[(2 * p, m)][schedule] > r[schedule], (schedule, p, m)
    [(line, (index,))] = stated(page, r"the\s+measured 1F1B bubble is \{\{ bench:pipeline_bubble\.bubble\.(\d)\.1f1b_ratio")
    assert (rows[int(index)]["stages"], rows[int(index)]["micro_batches"]) == (4, 2), f"docs/{page}:{line}"
    stated("reference/interview.md", r"comes close where\s+the bubble is large \(4 stages, 2 micro-batches\)")
    assert rows[int(index)]["1f1b_ratio"] < 1.10, "the bubble is no longer close to the formula at p=4, m=2"
    # The largest ratio of both schedules sits at the smallest theoretical bubble.
    stated(page, r'The target of "within 20% of theory" is hardest to meet where the theory is small')
    smallest = min(rows, key=lambda r: r["theory"])
    for schedule in ("1f1b", "gpipe"):
        assert max(rows, key=lambda r: r[f"{schedule}_ratio"]) is smallest, schedule
    stated(page, r"GPipe's measured bubble is larger than 1F1B's in every cell")
    assert all(r["gpipe"] > r["1f1b"] for r in rows)
    # The GPT rows: two stages short of the ideal, the bubble's excess growing with m.
    stated(page, r"two stages fall well short of the ideal speedup")
    gpt = [r for r in _bench("pipeline_bubble", "gpt", "pipelines") if r["stages"] == 2]
    assert all(r["speedup_vs_one_process"] < 0.9 * r["ideal_speedup"] for r in gpt)
    stated(page, r"its measured bubble stays above the formula, and the gap\s+widens as \$m\$ grows")
    for p in {r["stages"] for r in _bench("pipeline_bubble", "gpt", "pipelines")}:
        rows_p = sorted((r for r in _bench("pipeline_bubble", "gpt", "pipelines") if r["stages"] == p),
                        key=lambda r: r["micro_batches"])
        gaps = [r["1f1b"] - r["theory"] for r in rows_p]
        assert all(g > 0 for g in gaps) and gaps == sorted(gaps), (p, gaps)


def test_calculator_table_planner_bytes_are_the_planners():
    # reference/calculator.md labels bench.json's state_formula_bytes "planner bytes".
    from snippets.planner import cost_model as cm
    stated("reference/calculator.md", r"the planner's bytes are the formula the benchmark\s+records")
    from snippets.models.gpt import GPT, get_config
    zero = _bench("zero_memory")
    tensors = len(list(GPT(get_config(zero["config"])).parameters()))
    stages = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3}
    for n, rows in zero["by_world_size"].items():
        for name, row in rows.items():
            planner = cm.sharded_state_bytes(zero["parameters"], "fp32", stages[name], int(n))["total"]
            assert row["state_formula_bytes"]["total"] == planner, (n, name)
            # The gap the page explains: AdamW's 4-byte step counters, never more than one per
            # parameter tensor of the model.
            gap = row["state_bytes"]["total"] - planner
            assert 0 <= gap <= 4 * tensors and gap % 4 == 0, (n, name, gap)


def test_bf16_gain_on_this_cpu_holds_in_bench_json():
    # low-precision.md: a bf16 matmul about twice fp32; the whole small-GPT step gains a little,
    # far less than the matmuls.
    page = "course/week-3/low-precision.md"
    stated(page, r"bf16 autocast gains far less\s+for the small GPT than for its matmuls")
    stated(page, r"a small net gain for the small GPT, far from the\s+matmuls' 2×")
    matmul = min(v["bf16_over_fp32"] for v in _bench("matmul", "sizes").values())
    step = _bench("train_throughput", "bf16_over_fp32_tokens_per_s")
    assert matmul > 1.8, matmul
    assert 1.0 < step < 0.75 * matmul, (step, matmul)


def test_torchrun_signal_handling_on_the_slurm_page():
    # Session C's SLURM page: which signals torchrun handles, how long it gives its workers,
    # and that each worker runs in a session of its own.
    page = "workshop/session-c/slurm.md"
    from torch.distributed.elastic.multiprocessing import api
    [(line, signals)] = stated(page, r"torchrun handles only (SIGTERM), (SIGINT), (SIGHUP) and (SIGQUIT)")
    assert f'"TORCHELASTIC_SIGNALS_TO_HANDLE", "{",".join(signals)}"' in inspect.getsource(api.PContext.start), \
        f"docs/{page}:{line}"
    [(line, (seconds,))] = stated(page, r"gives them (\d+) s to exit before SIGKILL \(`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`")
    from torch.distributed.launcher.api import LaunchConfig
    saved = __import__("os").environ.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    try:
        assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == int(seconds), \
            f"docs/{page}:{line}"
    finally:
        if saved is not None:
            __import__("os").environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = saved
    stated(page, r"torchrun starts each\s+worker in a session of its own")
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    assert 'kwargs["start_new_session"] = True' in inspect.getsource(subprocess_handler.SubprocessHandler)


def test_c10d_rendezvous_orders_nodes_by_host_then_pid():
    stated("workshop/session-c/slurm.md",
           r"sorting the `torchrun` agents by\s+host name and then process id")
    import dataclasses
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    assert [f.name for f in dataclasses.fields(dr._NodeDesc)] == ["addr", "pid", "local_id"]
    assert dr._NodeDesc.__dataclass_params__.order
    assert "enumerate(sorted(state.participants))" in inspect.getsource(dr)


def _man_page(section: str, name: str) -> str:
    import gzip
    path = Path(f"/usr/share/man/man{section}/{name}.{section}.gz")
    if not path.exists():
        pytest.skip(f"{path} is not installed (slurm-client / slurm-wlm); .ci/run installs it")
    text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
    text = text.replace("\\-", "-")  # roff's escaped hyphen
    return re.sub(r"\s+", " ", re.sub(r"\\&|\\f[BIRP]|^\.[A-Z]+ ?", "", text, flags=re.M))


def test_slurm_defaults_on_the_slurm_page():
    """SLURM is not a Python library: its installed manual pages are the pinned reference."""
    page = "workshop/session-c/slurm.md"
    [(line, (kill_wait,))] = stated(page, r"`KillWait` seconds later \((\d+)\s+by default\)")
    conf = _man_page("5", "slurm.conf")
    assert re.search(rf"KillWait The interval, in seconds, given to a job's processes between the "
                     rf"SIGTERM and SIGKILL .*? The default value is {kill_wait} sec", conf), f"docs/{page}:{line}"
    stated(page, r"\(`--export=ALL` by\s+default\)")
    sbatch = _man_page("1", "sbatch")
    assert "--export=ALL Default mode if --export is not specified" in sbatch
    stated(page, r'"may be sent up to 60 seconds earlier\s+than specified"')
    assert "the signal may be sent up to 60 seconds earlier than specified" in sbatch
    assert "By default all job steps will be signaled, but not the batch shell itself" in sbatch
    stated(page, r"by default `scancel` signals only the steps")
    scancel = _man_page("1", "scancel")
    assert "By default, signals other than SIGKILL are not sent to the batch step" in scancel


def test_where_next_facts():
    page = "reference/where-next.md"
    stated(page, r"torch maps the `mps` device to `gloo`")
    assert dist.Backend.default_device_backend_map["mps"] == "gloo"
    assert "mps" not in dist.Backend.backend_list
    stated(page, r"\(`threads_per_rank=1`,\s+the default of `snippets.dist.spawn`\)")
    from snippets.dist import spawn
    assert _default(spawn, "threads_per_rank") == 1


# ---------------------------------------------------------------- consistency across pages

def _in_temporary_dir(function):
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        return function(directory)


def _plain(text: str) -> str:
    return text.replace("−", "-").replace("\u2009", " ")


# (what, regex over every page, expected value, where the value comes from). The regex's
# groups are joined and compared with str(expected).
CONSISTENCY = [
    ("gloo default timeout (min)", r"(\d+)[ -]minutes?(?: by default)?\s+for gloo",
     lambda: minutes(gloo_default_timeout()), "torch.distributed.constants.default_pg_timeout"),
    ("NCCL default timeout (min)", r"(\d+)(?:[ -]minutes?)?(?:\s+by default)?\s+for\s+NCCL",
     lambda: minutes(nccl_default_timeout()), "kProcessGroupNCCLDefaultTimeout"),
    ("NCCL default timeout (min)", r"default (\d+)-minute timeout",
     lambda: minutes(nccl_default_timeout()), "kProcessGroupNCCLDefaultTimeout"),
    ("rendezvous timeout (s)",
     r"(?:rendezvous|join)[ _-]timeout (?:is |of )?(\d+) ?s\b|rendezvous\s+and\s+gives\s+up\s+after\s+(\d+) s"
     r"|`join_timeout`,\s+`?(\d+)`? s",
     rendezvous_join_timeout_s, "RendezvousTimeout._DEFAULT_TIMEOUTS['join']"),
    ("torchrun's static rendezvous timeout (s)", r"torchrun passes `timeout=(\d+)`",
     lambda: _in_temporary_dir(torchrun_static_rendezvous_timeout_s), "LaunchConfig.__post_init__'s default_timeout"),
    ("course timeout (s)", r"(\d+) s in this course|course's default (\d+) s",
     course_timeout_s, "snippets.dist.DEFAULT_TIMEOUT_S"),
    ("model state with Adam (bytes/param)",
     r"(?<![+\d] )(?<!\d)(\d+) bytes per parameter(?= with Adam| in mixed precision| for the model state)",
     lambda: 16, "4 + 4 + 8 (fp32, autocast) = 2 + 2 + 4 + 8 (master copy)"),
    ("node 3 of 4 (NODE_RANK)", r"[Nn]ode 3 of 4\"?\s+(?:is|as\s+the\s+third\s+node,)\s+`NODE_RANK=(\d)`",
     lambda: 2, "Lab 3's convention: node ranks count from 0"),
    ("node 3 of 4 (ranks)", r"node 3 of 4 with\s+8 GPUs each holds ranks (\d+)-(\d+)",
     lambda: "1623", "2 * 8 + LOCAL_RANK"),
]


def _scan(pattern: str):
    regex = re.compile(pattern)
    for page in all_pages():
        text = _plain(page.read_text(encoding="utf-8"))
        for m in regex.finditer(text):
            yield page.relative_to(ROOT), line_of(text, m.start()), "".join(g for g in m.groups() if g)


@pytest.mark.parametrize("what, pattern, expected, source", CONSISTENCY,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(CONSISTENCY)])
def test_same_quantity_same_value_everywhere(what, pattern, expected, source):
    want = str(expected())
    seen, wrong = 0, []
    for page, line, value in _scan(pattern):
        seen += 1
        if value != want:
            wrong.append(f"{page}:{line}: {what} = {value}, expected {want} ({source})")
    assert seen, f"no page states {what} any more: drop or update this row"
    assert not wrong, "\n".join(wrong)


def _normalised_formula(text: str) -> str:
    text = _plain(text).replace("\\,", "")
    text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    return re.sub(r"\s+", "", text)


def test_bubble_formula_everywhere():
    """Every fraction over an expression in p on any page is the 1F1B/GPipe bubble
    (p-1)/(m+p-1), or that formula with m = k·p substituted where the paragraph sets m = kp."""
    wrong, seen = [], 0
    for page in all_pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            # a formula may wrap onto the next line: look at each line joined with the next
            flat = _normalised_formula(line + " " + (lines[i + 1] if i + 1 < len(lines) else ""))
            head = len(_normalised_formula(line))
            paragraph = _plain(" ".join(lines[max(0, i - 3):i + 3]))
            for m in re.finditer(r"(\(p-1\)|p-1|\d+)/\(([^()]*p[^()]*)\)", flat):
                if m.start() >= head:  # belongs to the next line; it gets its own turn
                    continue
                seen += 1
                num, den = m.groups()
                ok = num in ("(p-1)", "p-1") and den == "m+p-1"
                k = re.search(r"m\s*(?:=|≥|>=)\s*(\d+)\s*p", paragraph)
                if num in ("(p-1)", "p-1") and k and den == f"{int(k.group(1)) + 1}p-1":
                    ok = True
                if not ok:
                    wrong.append(f"{page.relative_to(ROOT)}:{i + 1}: bubble {m.group(0)}, "
                                 "expected (p-1)/(m+p-1)")
    assert seen >= 5
    assert not wrong, "\n".join(wrong)


def test_fraction_arithmetic_everywhere():
    """'a/b = c%' statements in any page: c is a/b, rounded as written."""
    wrong, seen = [], 0
    for page in all_pages():
        text = _plain(page.read_text(encoding="utf-8"))
        for m in re.finditer(r"(?<![\d.])(\d+)/(\d+) = (\d+(?:\.(\d+))?) ?%", text):
            seen += 1
            a, b, c, decimals = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            if round(100 * a / b, len(decimals or "")) != float(c):
                wrong.append(f"{page.relative_to(ROOT)}:{line_of(text, m.start())}: "
                             f"{a}/{b} = {100 * a / b:.3f}%, not {c}%")
    assert seen
    assert not wrong, "\n".join(wrong)


def test_sums_of_bytes_everywhere():
    """'2 + 2 + 4 + 8 = 16'-style sums on any page add up."""
    wrong, seen = [], 0
    for page in all_pages():
        text = _plain(page.read_text(encoding="utf-8"))
        for m in re.finditer(r"(?<![\d.,\w}])((?:\d+ \+ )+\d+) = (\d+)(?!\d|[.,]\d|\{)", text):
            seen += 1
            if sum(int(x) for x in m.group(1).split(" + ")) != int(m.group(2)):
                wrong.append(f"{page.relative_to(ROOT)}:{line_of(text, m.start())}: {m.group(0)}")
    assert seen
    assert not wrong, "\n".join(wrong)


def test_old_collective_names_only_as_old_names():
    """Pages use torch 2.13's names; the deprecated ones appear only in a paragraph that says
    they are the old names."""
    wrong = []
    for page in all_pages():
        text = page.read_text(encoding="utf-8")
        for paragraph_match in re.finditer(r"(?:[^\n]+\n?)+", text):
            paragraph = paragraph_match.group(0)
            if re.search(r"`(?:dist\.)?(?:all_gather_into_tensor|reduce_scatter_tensor|all_gather_tensor)\b",
                         paragraph) and not re.search(r"older|deprecat|formerly|old name", paragraph):
                wrong.append(f"{page.relative_to(ROOT)}:{line_of(text, paragraph_match.start())}")
    assert not wrong, "deprecated collective names used as current:\n" + "\n".join(wrong)


# Statements found false once (issue 14), with what is true; none may come back on any page.
FALSE_BEFORE = [
    (r"timestamps\s+do\s+not\s+lie",
     "merged logs are only as good as the nodes' clocks (checkpoints-and-logs.md, clock skew)"),
    (r"for\s+gloo\s+and\s+NCCL",
     "gloo's default timeout is 30 min, NCCL's 10 (torch/distributed/constants.py)"),
    (r"peak\s+memory\s+is\s+nearly\s+DDP's",
     "SHARD_GRAD_OP peaks at 4Psi + 16Psi/N: only the weights are whole (fsdp.md)"),
    (r"within\s+20%\s+of\s+that\s+formula\s+for\s+every",
     "the measured bubble missed 20% at small bubbles (pipeline-from-scratch.md)"),
    (r"15\s+sharded\s+checkpoints?",
     "exercise 15 writes one full checkpoint gathered from the shards"),
    (r"[Rr]ank\s+0\s+listens\s+on\s+`MASTER_ADDR",
     "under torchrun node 0's agent hosts the store; say which launcher you mean"),
]


@pytest.mark.parametrize("pattern, truth", FALSE_BEFORE, ids=[t[:40] for _, t in FALSE_BEFORE])
def test_corrected_statements_stay_corrected(pattern, truth):
    hits = [f"{page}:{line}" for page, line, _ in _scan(pattern)]
    assert not hits, f"{', '.join(hits)}: {truth}"


# ---------------------------------------------------------------- SHARD_GRAD_OP, counted

def _resident_after_forward(rank, world_size, reshard_after_forward):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    from snippets.models.gpt import GPT, Block, get_config

    torch.manual_seed(0)
    model = GPT(get_config("tiny", max_position_embeddings=16))
    total = sum(p.numel() for p in model.parameters())
    root_params = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for b in model.modules() if isinstance(b, Block) for p in b.parameters())
    mesh = init_device_mesh("cpu", (world_size,))
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # as fsdp_trainer does
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 17))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    # After forward, before backward: which parameters are whole tensors right now?
    unsharded = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
    loss.backward()
    optimizer.step()
    grads = sum(p.grad.to_local().numel() for p in model.parameters())
    moments = sum(s[k].to_local().numel() for s in optimizer.state.values()
                  for k in ("exp_avg", "exp_avg_sq"))
    return dict(total=total, root=root_params, unsharded=unsharded, grads=grads, moments=moments)


def test_shard_grad_op_keeps_only_weights_whole():
    from snippets.dist import spawn
    stated("course/week-2/fsdp.md", r"\| SHARD_GRAD_OP \| \\\(16\\Psi/N\\\) \| \\\(4\\Psi \+ 16\\Psi/N\\\)")
    n = 2
    for reshard, expect_whole in [(False, "total"), (True, "root")]:
        for r in spawn(_resident_after_forward, n, reshard, timeout_s=120):
            assert r["unsharded"] == r[expect_whole], (reshard, r)
            # Gradients and both AdamW moments stay sharded in both strategies: Psi/N each
            # (every first dimension of the tiny model is even, so the shards are exact).
            assert r["grads"] == r["total"] // n, r
            assert r["moments"] == 2 * r["total"] // n, r


# ---------------------------------------------------------------- Session B slides: arithmetic and the recorded run

SESSION_B = "workshop/session-b/slides.md"


def test_session_b_ring_latency_arithmetic():
    # The tree section's premise (5 µs per step, an assumption) and what follows from it.
    [(line, (n, steps, us, ms))] = stated(
        SESSION_B, r"At ([\d,]+) GPUs that is ([\d,]+) steps; at (\d+) µs each \(an optimistic latency"
                   r" across nodes\) an all-reduce costs (\d+) ms")
    n, steps = int(n.replace(",", "")), int(steps.replace(",", ""))
    assert steps == 2 * (n - 1), f"docs/{SESSION_B}:{line}"
    assert round(steps * int(us) / 1000) == int(ms), f"docs/{SESSION_B}:{line}"
    [(line, (tree, n_tree))] = stated(SESSION_B, r"\\\(2\\log_2 N\\\) steps, (\d+) at ([\d,]+) GPUs")
    assert int(tree) == 2 * math.log2(int(n_tree.replace(",", ""))), f"docs/{SESSION_B}:{line}"


def _gradient_bytes(config: str) -> tuple[int, int, int]:
    """(tensors, total fp32 gradient bytes, largest tensor's bytes) of the course GPT at `config`."""
    from snippets.models.gpt import GPT, get_config
    with torch.device("meta"):
        params = list(GPT(get_config(config)).parameters())
    return len(params), 4 * sum(p.numel() for p in params), 4 * max(p.numel() for p in params)


def test_session_b_gradient_sizes():
    # Formulas, not measurements: parameter counts times 4 bytes, from the models themselves.
    tensors, total, largest = _gradient_bytes("gpt2-small")
    [(line, (count, emb))] = stated(SESSION_B, r"GPT-2 small has (\d+) tensors,\s+from a 3 KB norm gain to a"
                                               r" (\d+) MiB embedding")
    assert (int(count), int(emb)) == (tensors, largest // 2**20), f"docs/{SESSION_B}:{line}"
    [(line, (mib,))] = stated(SESSION_B, r"GPT-2 small's (\d+) MiB of fp32 gradients")
    assert int(mib) == total // 2**20, f"docs/{SESSION_B}:{line}"
    [(line, (mb,))] = stated(SESSION_B, r"GPT-2 small's\s+fp32 gradients \((\d+) MB\)")
    assert int(mb) == round(total / 1e6), f"docs/{SESSION_B}:{line}"
    # The course's small GPT: one 25 MiB bucket, as the recorded DDP run counted.
    _, small, _ = _gradient_bytes("small")
    [(line, (small_mb,))] = stated(SESSION_B, r"the course's small GPT has ([\d.]+) MB of gradients, one bucket")
    assert float(small_mb) == round(small / 1e6, 1), f"docs/{SESSION_B}:{line}"
    assert small < 25 * 2**20
    assert _bench("ddp_step_time", "parameters") * 4 == small
    assert _bench("ddp_step_time", "all_reduces_per_step", "torch DDP 25MB") == 1


def test_session_b_exercise_1_arithmetic():
    # Exercise 1's premise (an algorithm bandwidth of 200 GB/s on 8 GPUs) and its solution.
    [(line, (gpus, algbw, mb))] = stated(
        SESSION_B, r"all-reduce of 1 GB on (\d+) GPUs at an algorithm bandwidth of (\d+) GB/s\."
                   r" What is its bus bandwidth, and how long does an all-reduce of GPT-2 small's"
                   r" fp32 gradients \((\d+) MB\)")
    n, algbw, mb = int(gpus), int(algbw), int(mb)
    [(line, (a, n_minus_1, n_again, busbw))] = stated(
        SESSION_B, r"\\\(\\text\{busbw\} = (\d+) \\times \\frac\{2 \\cdot (\d+)\}\{(\d+)\} = (\d+)\\\) GB/s")
    assert (int(a), int(n_minus_1), int(n_again)) == (algbw, n - 1, n), f"docs/{SESSION_B}:{line}"
    assert int(busbw) == algbw * 2 * (n - 1) / n, f"docs/{SESSION_B}:{line}"
    [(line, (gb, a, ms))] = stated(SESSION_B, r"\\\(([\d.]+) / (\d+)\\\) s \\\(\\approx\\\) ([\d.]+) ms")
    assert (float(gb), int(a)) == (mb / 1000, algbw), f"docs/{SESSION_B}:{line}"
    assert float(ms) == round(mb / 1000 / algbw * 1000, 1), f"docs/{SESSION_B}:{line}"


def test_session_b_allreduce_observations_hold_in_bench_json():
    """What Session B's slides say about the all-reduce run recorded in bench.json."""
    world = _bench("allreduce_bandwidth", "world_4")
    rows = world["sizes"]
    text = page_text(SESSION_B)
    # The placeholders name rows by index: they must be the sizes the prose names.
    used = {int(i) for i in re.findall(r"bench:allreduce_bandwidth\.world_4\.sizes\.(\d+)\.", text)}
    assert used == {2, 6}, used
    assert (rows[2]["bytes"], rows[6]["bytes"]) == (64 * 2**10, 16 * 2**20)
    stated(SESSION_B, r"Large messages: under a gigabyte per second, ring or gloo\.\*\* At 16 MB")
    assert rows[6]["ring"]["busbw_GBps"] < 1 and rows[6]["dist"]["busbw_GBps"] < 1, rows[6]
    # 64 KB: the bytes at the 16 MB row's bus bandwidth are "a few percent" of the ring's time.
    stated(SESSION_B, r"At the\s+16 MB row's bandwidth the bytes themselves would take a few percent of that")
    moved = 64 * 2**10 * world["ring_factor"]
    bytes_s = moved / (rows[6]["ring"]["busbw_GBps"] * 1e9)
    assert bytes_s < 0.05 * rows[2]["ring"]["us"] * 1e-6, (bytes_s, rows[2]["ring"]["us"])
    # NVLink's 450 GB/s per direction (H100 SXM) against gloo's 16 MB bus bandwidth.
    stated(SESSION_B, r"NCCL on NVLink is hundreds of times faster")
    assert 100 <= 450 / rows[6]["dist"]["busbw_GBps"] < 1000, rows[6]
