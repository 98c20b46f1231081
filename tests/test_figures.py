"""The site's figures are drawn by scripts in snippets/figures/ from the course's own code.

Each test renders a figure again and compares it, byte for byte, with the SVG committed in
docs/assets/figures/: a figure cannot drift from its generator, nor the generator from the code it
draws. After changing a generator (or the code it draws from), regenerate with
`python -m snippets.figures.<module>` and commit both.
"""

from __future__ import annotations

import importlib
import pkgutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import snippets.figures as figures_pkg

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "assets" / "figures"
DOCS = ROOT / "docs"
GENERATORS = sorted(m.name for m in pkgutil.iter_modules(figures_pkg.__path__) if m.name != "svg")
SVG_NS = "{http://www.w3.org/2000/svg}"


def test_every_generator_has_a_committed_figure():
    # Figures drawn from a measured run (a `make bench` record) are written by their benchmark
    # and checked by its own test; the ones here are drawn from code alone.
    names = {importlib.import_module(f"snippets.figures.{g}").NAME for g in GENERATORS}
    committed = {p.stem for p in FIGURES.glob("*.svg")}
    assert names <= committed, f"generators without a committed SVG: {sorted(names - committed)}"


@pytest.mark.parametrize("generator", GENERATORS)
def test_figure_matches_its_generator(generator):
    module = importlib.import_module(f"snippets.figures.{generator}")
    path = FIGURES / f"{module.NAME}.svg"
    assert path.is_file(), f"run `python -m snippets.figures.{generator}` and commit {path}"
    assert module.render() == path.read_text(encoding="utf-8"), (
        f"{path.relative_to(ROOT)} is not what snippets/figures/{generator}.py draws now: "
        f"run `python -m snippets.figures.{generator}` and commit the new SVG")


@pytest.mark.parametrize("generator", GENERATORS)
def test_figure_has_a_text_alternative_and_is_used(generator):
    module = importlib.import_module(f"snippets.figures.{generator}")
    path = FIGURES / f"{module.NAME}.svg"
    root = ET.fromstring(path.read_text(encoding="utf-8"))  # well-formed XML
    assert root.find(f"{SVG_NS}title").text and root.find(f"{SVG_NS}desc").text
    users = [p for p in DOCS.rglob("*.md") if f"assets/figures/{module.NAME}.svg" in p.read_text()]
    assert users, f"no page shows {path.name}"
    for page in users:  # the page's image carries alt text, not an empty ![]
        assert f"![](../../assets/figures/{module.NAME}.svg)" not in page.read_text()


def test_pipeline_figure_times_agree_with_the_bubble_formula():
    from snippets.figures.pipeline_schedules import (DURATION, MICRO_BATCHES, STAGES,
                                                     peak_in_flight, simulate)
    from snippets.scratch.pipeline import SCHEDULES
    from snippets.scratch.pipeline_trace import theoretical_bubble

    unit = DURATION["F"] + DURATION["B"]
    for name in ("gpipe", "1f1b"):
        timeline = simulate(name)
        end = max(e for acts in timeline.values() for *_, e in acts)
        assert end == (MICRO_BATCHES + STAGES - 1) * unit  # T = (m + p - 1)(t_f + t_b)
        for s, acts in timeline.items():
            # Each stage runs exactly the course's schedule, in its order.
            assert [(k, i) for k, i, *_ in acts] == SCHEDULES[name](MICRO_BATCHES, s, STAGES)
            busy = sum(e - b for *_, b, e in acts)
            assert 1 - busy / end == pytest.approx(theoretical_bubble(STAGES, MICRO_BATCHES))
            expected_peak = MICRO_BATCHES if name == "gpipe" else STAGES - s
            assert peak_in_flight(acts) == expected_peak


def test_ring_figure_replays_what_the_ring_computed():
    from snippets.figures.ring_allreduce import replay

    sent, history = replay(3)
    full = 0b111
    assert all(v == full for rank in history[-1] for v in rank)  # every rank holds every sum
    # After reduce-scatter each rank owns exactly one finished chunk: (rank + 1) % N.
    assert [[k for k, v in enumerate(rank) if v == full] for rank in history[2]] == [[1], [2], [0]]


def test_interleaved_figure_is_drawn_from_the_interleaved_schedule():
    """The second figure of snippets/figures/pipeline_schedules.py: committed, described, shown
    with alt text, and its timelines are the scratch module's schedule, with the bubbles the
    formulas give: (p-1)/m, (p-1)/(v m), and a third of that with zero bubble."""
    from snippets.figures.pipeline_schedules import (INTERLEAVED_NAME, INTERLEAVED_V,
                                                     MICRO_BATCHES, STAGES,
                                                     interleaved_timelines, render_interleaved)
    from snippets.scratch.pipeline_interleaved import bubble_over_compute, interleaved_schedule

    path = FIGURES / f"{INTERLEAVED_NAME}.svg"
    assert render_interleaved() == path.read_text(encoding="utf-8"), (
        "run `python -m snippets.figures.pipeline_schedules` and commit the new SVG")
    root = ET.fromstring(path.read_text(encoding="utf-8"))
    assert root.find(f"{SVG_NS}title").text and root.find(f"{SVG_NS}desc").text
    users = [p for p in DOCS.rglob("*.md") if f"assets/figures/{path.name}" in p.read_text()]
    assert users and all(f"![](../../assets/figures/{path.name})" not in p.read_text()
                         for p in users)
    p, m, v = STAGES, MICRO_BATCHES, INTERLEAVED_V
    runs = interleaved_timelines()
    for (label, timeline), n in zip(runs.items(), (1, v, 3 * v)):
        span = max(end for acts in timeline.values() for *_, end in acts)
        for r, acts in timeline.items():
            busy = sum(end - start for *_, start, end in acts)
            assert (span - busy) / busy == pytest.approx(bubble_over_compute(p, m, n)), label
            if label != "1F1B":
                assert [a[:3] for a in acts] == interleaved_schedule(m, r, p, v,
                                                                     "zero" in label)


def test_memory_timeline_rises_in_forward_falls_in_backward_and_checkpointing_lowers_the_peak():
    """snippets/figures/memory_timeline.py. Its values are byte counts, so the committed SVG is
    compared byte for byte by test_figure_matches_its_generator above; here, what the curves must
    show: memory rises through forward and falls through backward, the step ends where it began
    (nothing of it stays alive), and checkpointing lowers the peak by recomputing each block."""
    from snippets.figures.memory_timeline import timeline

    peaks = {}
    for checkpointed in (False, True):
        samples = timeline(checkpointed)
        assert [s.phase for s in samples] == sorted(
            (s.phase for s in samples), key=["forward", "backward", "optimizer"].index)
        forward = [s.live for s in samples if s.phase == "forward"]
        grads = [s.live for s in samples if s.where.startswith("grad ")]
        # Rises through forward: each layer adds what it keeps for backward.
        assert forward[-1] > forward[0] and forward[-1] == max(forward), checkpointed
        # Falls through backward: from the end of forward down to the last gradient, as
        # activations are freed faster than gradients are allocated.
        assert grads[-1] < grads[0] < forward[-1], checkpointed
        assert grads == sorted(grads, reverse=True) or checkpointed  # plain: at every gradient
        assert samples[-1].live == samples[0].live, "the step left tensors alive"
        recomputed = [s for s in samples if s.where.startswith("recompute ")]
        assert bool(recomputed) == checkpointed
        peaks[checkpointed] = max(s.live for s in samples)
    assert peaks[True] < peaks[False]


def test_ddp_trace_all_reduces_overlap_backward_only_when_overlapped():
    """snippets/figures/ddp_trace.py draws one recorded run (timings vary by machine, so its
    bytes are compared with the committed record, not with a new run). Here: the run is done
    again: in it every naive all-reduce (one per gradient) is launched after backward has ended
    and at least one overlapped all-reduce (one per bucket) before. When gloo's thread starts a
    launched one depends on when the thread gets a core (on a loaded machine, possibly after
    backward), so that is checked only in the committed record, whose figure shows it; naive
    all-reduces start after backward on every run, since they are launched after it. The
    committed SVG draws one backward bar and every all-reduce of each rank."""
    import json

    from snippets.figures import ddp_trace
    from snippets.models.gpt import GPT, get_config
    from snippets.scratch.ddp import make_buckets

    model = GPT(get_config(ddp_trace.CONFIG))
    expected = {"naive": len(list(model.parameters())),
                "overlapped": len(make_buckets(model, ddp_trace.BUCKET_CAP_MB))}
    assert expected["overlapped"] > 1  # else there would be nothing to overlap

    def check(record, where):
        for variant in ddp_trace.VARIANTS:
            assert len(record[variant]) == ddp_trace.WORLD_SIZE, where
            for rank, trace in enumerate(record[variant]):
                what = (where, variant, rank)
                bw_start, bw_end = trace["backward"]
                assert bw_start < bw_end <= trace["backward_call_ends"], what
                assert len(trace["all_reduces"]) == expected[variant], what
                assert all(start <= end for start, end in trace["all_reduces"]), what
                started = ddp_trace.started_before_backward_ended(trace)
                if "launches" in trace:  # a new run
                    launched = ddp_trace.launched_before_backward_ended(trace)
                    assert len(trace["launches"]) == expected[variant], what
                    assert (launched == started == 0) if variant == "naive" else launched >= 1, \
                        (what, trace)
                else:  # the committed record: the run the figure shows
                    assert (started == 0) if variant == "naive" else started >= 1, (what, trace)

    committed = json.loads(ddp_trace.RECORD.read_text(encoding="utf-8"))
    check(committed, "committed record")
    check(ddp_trace.measure(), "a new run")

    root = ET.fromstring((FIGURES / f"{ddp_trace.NAME}.svg").read_text(encoding="utf-8"))
    rects = root.iter(f"{SVG_NS}rect")
    drawn = {}
    for r in rects:
        if r.get("data-kind"):
            key = (r.get("data-variant"), int(r.get("data-rank")), r.get("data-kind"))
            drawn.setdefault(key, []).append((float(r.get("x")), float(r.get("width"))))
    for variant in ddp_trace.VARIANTS:
        for rank in range(ddp_trace.WORLD_SIZE):
            (backward,) = drawn[variant, rank, "backward"]
            bars = drawn[variant, rank, "all-reduce"]
            assert len(bars) == expected[variant]
            early = [x for x, _ in bars if x < backward[0] + backward[1]]
            assert (not early) if variant == "naive" else early, (variant, rank)
