"""Smoke tests of the Week 1 benchmarks, run small: the structure of what they report, and numbers
that are positive and finite. No timing thresholds: timings on a shared CI machine are noise."""

import math

from snippets.bench import BENCHMARKS, allreduce_bandwidth, ddp_step_time
from snippets.models.gpt import GPT, get_config


def positive_finite(x) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_both_are_registered():
    assert "snippets.bench.ddp_step_time" in BENCHMARKS
    assert "snippets.bench.allreduce_bandwidth" in BENCHMARKS


def test_ddp_step_time_reports_every_variant_against_torch_ddp():
    result = ddp_step_time.run(config_name="tiny", seq_len=16, rounds=2, warmup=1)
    names = list(ddp_step_time.VARIANTS)
    assert list(result["median_step_ms"]) == names
    assert list(result["ratio_to_torch_ddp"]) == names
    assert all(positive_finite(v) for v in result["median_step_ms"].values())
    assert all(positive_finite(v) for v in result["ratio_to_torch_ddp"].values())
    assert result["ratio_to_torch_ddp"][ddp_step_time.REFERENCE] == 1.0
    messages = result["all_reduces_per_step"]
    params = len(list(GPT(get_config("tiny")).parameters()))
    assert messages["local (no sync)"] == 0
    assert messages["naive"] == params  # one all-reduce per parameter
    assert messages["bucketed 25MB"] == messages["overlapped 25MB"] == 1  # tiny fits one bucket
    assert all(1 <= messages[n] <= params for n in names if n.startswith("torch"))
    table = ddp_step_time.format_table(result)
    assert all(name in table for name in names)
    assert all(positive_finite(ms) for ms in result["bucket_copy_ms"].values())


def test_allreduce_bandwidth_reports_ring_and_library_by_size():
    sizes = [4096, 65536]
    result = allreduce_bandwidth.run(world_sizes=(2, 3), sizes_bytes=sizes, repeats=1, rounds=1)
    for world in (2, 3):
        report = result[f"world_{world}"]
        assert report["ring_factor"] == round(2 * (world - 1) / world, 3)
        assert [row["bytes"] for row in report["sizes"]] == sizes
        for row in report["sizes"]:
            for name in ("ring", "dist"):
                m = row[name]
                assert all(positive_finite(m[k]) for k in ("us", "algbw_GBps", "busbw_GBps"))
                # busbw = algbw x 2(N-1)/N (up to rounding to 4 significant digits)
                assert math.isclose(m["busbw_GBps"], m["algbw_GBps"] * 2 * (world - 1) / world,
                                    rel_tol=1e-3)
            assert positive_finite(row["ring_over_dist"])
    assert "3 ranks on gloo" in allreduce_bandwidth.format_table(result)
