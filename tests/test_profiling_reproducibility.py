"""profile_step.py reports what docs/reference/profiling.md shows, and the demos of
snippets/scripts/reproducibility.py return what docs/reference/reproducibility.md claims."""

import json
import platform

import pytest
import torch

from snippets.scripts import profile_step, reproducibility

# The tiny config, a small batch and two profiled steps: about a second on 2 CPU cores.
FAST = ["--config", "tiny", "--device", "cpu", "--batch-size", "4", "--steps", "2"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_profile_reports_every_phase_and_the_top_operators(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    summary = profile_step.run(profile_step.parse_args(FAST + ["--trace", str(trace)]))

    shares = summary["shares"]
    assert list(shares) == ["data", "forward", "backward", "optimizer", "other"]
    assert all(shares[phase] > 0 for phase in profile_step.PHASES), shares
    # "other" is the step time outside every label: never more than a sliver of the step.
    assert sum(shares.values()) == pytest.approx(1.0)
    assert -1e-9 <= shares["other"] < 0.2, shares
    assert summary["step_ms"] > 0
    ops = summary["top_ops"]
    assert len(ops) == 5 and all(op["name"] not in profile_step.PHASES for op in ops)
    assert [op["share"] for op in ops] == sorted((op["share"] for op in ops), reverse=True)

    out = capsys.readouterr().out
    assert "Self CPU %" in out and "share of step time: data" in out
    assert "top operators by self CPU time" in out and f"wrote {trace}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"data", "forward", "backward", "optimizer", "aten::mm"} <= names
    # Every linear layer is a matmul: 2 layers x 7 + lm_head = 15 in forward, twice that in
    # backward (the input's and the weight's gradient). Counted in the trace, not among the top
    # operators: which operators take the most time depends on the machine and its load.
    mm_calls = sum(e.get("name") == "aten::mm" and e.get("ph") == "X" for e in events)
    assert mm_calls == 45 * 2, mm_calls  # FAST profiles 2 steps


def test_profile_options_add_shapes_and_memory_columns(capsys):
    profile_step.run(profile_step.parse_args(FAST + ["--steps", "1", "--record-shapes"]))
    assert "Input Shapes" in capsys.readouterr().out
    profile_step.run(profile_step.parse_args(FAST + ["--steps", "1", "--profile-memory"]))
    assert "Self CPU Mem" in capsys.readouterr().out


def test_fused_adamw_replaces_the_per_parameter_loop(capsys):
    profile_step.run(profile_step.parse_args(FAST + ["--row-limit", "500"]))
    default = capsys.readouterr().out
    profile_step.run(profile_step.parse_args(FAST + ["--row-limit", "500", "--adamw", "fused"]))
    fused = capsys.readouterr().out
    assert "aten::lerp_" in default and "aten::_fused_adamw_" not in default
    assert "aten::_fused_adamw_" in fused and "aten::lerp_" not in fused


def test_throughput_log_separates_data_from_compute(capsys):
    records = profile_step.run(profile_step.parse_args(
        FAST + ["--throughput", "--data-delay-ms", "20"]))["throughput"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["data_ms"] >= 20 and r["compute_ms"] > 0 and r["tokens_per_s"] > 0
               for r in records)
    assert "data share" in capsys.readouterr().out


def test_same_seed_is_bit_identical_and_another_seed_is_not(capsys):
    assert reproducibility.demo_same_seed() == {"same_seed_identical": True,
                                                "other_seed_identical": False}


def test_data_order_claims(capsys):
    assert reproducibility.demo_data_order() == {
        "global_same": True, "global_after_layer": False,
        "own_ignores_manual_seed": True, "own_seeded_differs": True}


def test_worker_copies_repeat_until_reseeded(capsys):
    assert reproducibility.demo_workers() == {
        "copies_repeat": True, "reseeded_differ": True, "reseeded_reproducible": True}


def test_deterministic_mode_on_cpu(capsys):
    result = reproducibility.demo_deterministic()
    assert result["empty_is_nan"]
    assert result["put_error"] == "put_ does not have a deterministic implementation"
    assert not torch.are_deterministic_algorithms_enabled()  # the demo switched it back off


def test_float_order_gives_three_sums(capsys):
    result = reproducibility.demo_float_order()
    assert result["distinct"] == 3
    assert sorted(result["sums"].values()) == [
        2.299999713897705, 2.299999952316284, 2.3000001907348633]


def test_batch_split_differs_in_the_last_bits_only(capsys):
    assert reproducibility.demo_batch_split() == {"identical": False, "close": True}


def test_resume_equals_the_unbroken_run(capsys):
    assert reproducibility.demo_resume() == {"resumed_equals_unbroken": True}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the avx2 and default families are x86-64 kernels")
def test_kernel_families_differ_in_the_last_digits_only(capsys):
    """The page's claims about its `kernels` demo: each family runs the kernels it names; the
    first loss agrees to within a few float32 steps of ~5.5 (here 1e-6 relative); the plain
    kernels add in another order than the native ones, so some step differs."""
    runs = reproducibility.demo_kernels(steps=20)
    assert runs["avx2"][0] == "AVX2" and runs["default"][0] == "DEFAULT"
    first = [losses[0] for _, losses in runs.values()]
    assert max(first) - min(first) <= 1e-6 * abs(first[0]), first
    if runs["native"][0] != "DEFAULT":  # a vectorised native family adds in another order
        assert runs["default"][1] != runs["native"][1]
    assert "default vs native: first step that differs" in capsys.readouterr().out


def test_unknown_demo_is_an_error(capsys):
    assert reproducibility.main(["no-such-demo"]) == 2
    assert "unknown demo no-such-demo" in capsys.readouterr().err


@pytest.mark.cuda
def test_cuda_deterministic_mode_pins_scatter_add():
    result = reproducibility.demo_cuda()
    assert result["deterministic"] == 1
    assert result["matmul"] in ("ran", "raised RuntimeError, asking for CUBLAS_WORKSPACE_CONFIG")
