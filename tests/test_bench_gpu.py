"""`make bench-gpu` (snippets/bench/gpu.py) and `make test-gpu`'s check (snippets/tools/gpu_env.py).

The device-agnostic parts run everywhere: the refusal without CUDA, the peak table, the MFU
arithmetic, the fp8 rule, the TF32 setting's restoration, the merge into bench.json, the pages'
GPU tables. The measurements themselves are `cuda` tests: skipped here with the reason, run by
`make test-gpu`, failed there without a GPU.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from snippets.bench import gpu
from snippets.bench import __main__ as bench_main
from snippets.bench.gpu_tables import NO_GPU_RUN, gpu_table
from snippets.tools import gpu_env
from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("tables, arithmetic, files and messages")

SECTION = {"date": "2026-01-01T00:00:00+00:00",
           "device": {"name": "NVIDIA H200", "driver": "570.1", "torch": "2.11.0+cu130",
                      "cuda": "13.0", "capability": [9, 0]},
           "matmul": {"size": 8192, "clock": "CUDA events", "fp32_tflops": 50.5,
                      "tf32_tflops": 400.0, "bf16_tflops": 700.25,
                      "fp8_skipped": "compute capability 8.0 has no fp8 tensor cores"}}


def test_without_cuda_the_benchmark_refuses_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides any GPU from a CUDA build too
    proc = subprocess.run([sys.executable, "-m", "snippets.bench.gpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no CUDA device" in proc.stderr and "make bench-gpu" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
    ("Tesla T4", None)])
def test_peak_table_finds_the_device_by_name(name, peak):
    assert gpu.peak_bf16_tflops(name) == peak


def test_mfu_is_model_flops_over_the_peak_and_none_without_a_peak():
    # 500,000 tokens/s x 600 MFLOP a token = 300 TFLOP/s, on a 1,000 TFLOP/s peak: 0.3.
    assert gpu.mfu(500_000, 600e6, 1000.0) == pytest.approx(0.3, rel=1e-12)
    assert gpu.mfu(500_000, 600e6, None) is None


@pytest.mark.parametrize("capability, supported", [
    ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)])
def test_fp8_needs_compute_capability_8_9(capability, supported):
    reason = gpu.fp8_unsupported_reason(capability)
    assert (reason is None) == supported
    if reason:
        assert f"{capability[0]}.{capability[1]}" in reason


def test_tf32_setting_is_restored_even_after_an_error():
    before = torch.backends.cuda.matmul.allow_tf32
    with pytest.raises(RuntimeError):
        with gpu.tf32_matmuls(not before):
            assert torch.backends.cuda.matmul.allow_tf32 == (not before)
            raise RuntimeError("a failed measurement")
    assert torch.backends.cuda.matmul.allow_tf32 == before


def fake_gpu_run(monkeypatch):
    monkeypatch.setattr(gpu, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu, "run", lambda *args: SECTION)


def test_gpu_section_merges_into_bench_json_and_a_cpu_run_keeps_it(tmp_path, monkeypatch):
    fake_gpu_run(monkeypatch)
    out = tmp_path / "bench.json"
    before = {"date": "then", "machine": {"cpu": "here"}, "results": {"matmul": {"cpu": 1}}}
    out.write_text(json.dumps(before))
    with pytest.raises(SystemExit, match="without --merge would drop matmul"):
        gpu.main(["--out", str(out)])  # refused before anything runs: the file is unchanged
    assert json.loads(out.read_text()) == before
    gpu.main(["--merge", "--out", str(out)])
    after = json.loads(out.read_text())
    assert after["results"] == {"matmul": {"cpu": 1}, "gpu": SECTION}
    assert (after["date"], after["machine"]) == ("then", {"cpu": "here"})
    assert [m["result"] for m in after["merged"]] == ["gpu"]

    # A full CPU run (no --merge) writes a new file, but keeps the section it cannot measure.
    (tmp_path / "quick_bench.py").write_text("def run():\n    return {'ran': True}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench_main, "BENCHMARKS", ["quick_bench"])
    bench_main.main(["--out", str(out)])
    cpu = json.loads(out.read_text())
    assert cpu["results"] == {"quick_bench": {"ran": True}, "gpu": SECTION}
    assert [m["result"] for m in cpu["merged"]] == ["gpu"] and cpu["date"] != "then"


def test_pages_show_gpu_rows_only_from_a_run():
    assert gpu_table(None, "matmul") == NO_GPU_RUN + "\n"
    table = gpu_table(SECTION, "matmul")
    assert "**NVIDIA H200** (driver 570.1, torch 2.11.0+cu130, CUDA 13.0)" in table
    assert "| bf16 | 700.2 |" in table or "| bf16 | 700.3 |" in table
    assert "| fp8 | not run: compute capability 8.0" in table
    assert "did not measure throughput" in gpu_table(SECTION, "throughput")
    with pytest.raises(KeyError, match="unknown GPU table"):
        gpu_table(SECTION, "speed")


def test_the_hook_renders_the_table_line_indented_where_it_stands(monkeypatch):
    from tests.test_measured_numbers import hook

    monkeypatch.setattr(hook, "record", lambda name: {"results": {"gpu": SECTION}})
    text, errors = hook.substitute("!!! note\n\n    {{ gpu-table:matmul }}\n", "page.md")
    assert not errors
    assert "\n    Measured on one **NVIDIA H200**" in text and "\n    | fp32 | 50.5 |" in text
    _, errors = hook.substitute("{{ gpu-table:nope }}\n```text\n{{ gpu-table:matmul }}\n```\n",
                                "page.md")
    assert len(errors) == 2 and "unknown GPU table" in errors[0] and "code block" in errors[1]


def test_gpu_env_finds_what_the_test_run_imports():
    found = gpu_env.test_imports()
    # -p tests.codeblocks: pytest-codeblocks' parser, and the includes expanded with the site's
    # Markdown extensions; tests/conftest.py: filelock.
    assert {"pytest", "pytest_codeblocks", "markdown", "mkdocs", "pymdownx", "yaml",
            "filelock", "torch"} <= found
    assert not found & set(sys.stdlib_module_names) and not found & {"snippets", "tests"}


def test_gpu_env_names_each_missing_package_in_one_line(monkeypatch, capsys):
    real = gpu_env.importlib.util.find_spec
    gone = {"pytest_codeblocks", "pymdownx"}
    monkeypatch.setattr(gpu_env.importlib.util, "find_spec",
                        lambda name, *a: None if name in gone else real(name, *a))
    assert gpu_env.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "lacks pymdownx, pytest_codeblocks" in err
    assert "pytest-codeblocks==0.18.0" in err and "pymdown-extensions==12.3" in err
    assert "--no-index" in err


# --------------------------------------------------------------- on the GPU (make test-gpu)

cuda = pytest.mark.cuda(reason="measures on an NVIDIA GPU (make bench-gpu's parts)")


@cuda
def test_matmul_measures_every_precision_and_restores_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    out = gpu.matmul(2048, repeats=2)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    assert out["fp32_tflops"] > 0 and out["bf16_tflops"] > out["fp32_tflops"]
    assert out["tf32_tflops"] > 0
    assert ("fp8_tflops" in out) == (gpu.fp8_unsupported_reason(
        torch.cuda.get_device_capability()) is None)


@cuda
def test_throughput_times_every_model_at_equal_flops():
    out = gpu.throughput(batch_size=2, seq_len=256, repeats=2, compile=False,
                         peak=gpu.peak_bf16_tflops(torch.cuda.get_device_name()))
    assert set(out["models"]) == {"readable", "fused", "nanogpt", "fused_layernorm_no_rope"}
    assert out["training_flops_per_token"]["course_gpt"] == \
        out["training_flops_per_token"]["nanogpt"]
    assert all(m["tokens_per_s"] > 0 for m in out["models"].values())


@cuda
def test_memory_follows_the_planner_and_checkpointing_saves():
    runs = gpu.memory((("medium", 16),))["medium"]["runs"]
    # The planner counts the fp32 model's saved tensors within 2% on the CPU (test_planner.py);
    # here the allocator's view also holds the loss and rounds each block up: a loose band.
    assert 0.8 < runs["fp32"]["activations_over_planner"] < 1.25, runs["fp32"]
    for recipe in ("fp32", "bf16"):
        checkpointed = runs[f"{recipe}_checkpointed"]["measured_bytes"]["activations"]
        assert checkpointed < runs[recipe]["measured_bytes"]["activations"] / 2


@cuda
def test_scratch_fsdp_state_is_the_lessons_sixteen_bytes_a_parameter():
    out = gpu.fsdp("small", batch_size=4)
    assert 0.7 < out["state_over_formula"] < 1.3, out


@cuda
def test_bench_gpu_writes_its_section_with_the_device(tmp_path):
    out = tmp_path / "bench.json"
    gpu.main(["--parts", "matmul", "--matmul-size", "1024", "--repeats", "1", "--out", str(out)])
    section = json.loads(out.read_text())["results"]["gpu"]
    assert section["device"]["name"] == torch.cuda.get_device_name(0)
    assert section["device"]["torch"] == torch.__version__


def test_autocast_weight_copies_count_each_matmul_weight_once():
    # Every matrix of the small GPT is read by a matmul (the tied embedding as the head, once);
    # only the norms' gains are not. With checkpointed blocks, only the head's copy is held.
    from snippets.bench.gpu import autocast_weight_copies
    from snippets.models.gpt import GPT, get_config

    model = GPT(get_config("small"))
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert autocast_weight_copies(model, checkpointed=False) == 2 * matrices
    assert autocast_weight_copies(model, checkpointed=True) == 2 * model.lm_head.weight.numel()
