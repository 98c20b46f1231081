"""snippets/figures/parallel_timeline.py: one step of the parallel trainer, rank by rank, from
its per-rank logs. Times vary by machine; what is checked holds on any: each rank's actions are
its stage's schedule, a TP group ran the same actions, a stage waited for its neighbours. On the
committed record of a real run (docs/assets/figures/parallel-timeline.json), on synthetic logs
written in the trainer's format (1F1B and interleaved), and on planted mistakes."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET

import pytest

from snippets.figures import parallel_timeline as pt
from snippets.figures import svg
from snippets.scratch.pipeline import one_f_one_b_schedule
from snippets.scratch.pipeline_interleaved import interleaved_schedule, simulate

pytestmark = pytest.mark.kernel_independent("schedule order and figure structure of a record")

SVG_NS = "{http://www.w3.org/2000/svg}"


def committed() -> dict:
    return json.loads(pt.RECORD.read_text(encoding="utf-8"))


def write_logs(out, dp: int, pp: int, tp: int, m: int, v: int = 1, steps: int = 2,
               base: float = 1000.0) -> None:
    """Per-rank logs as the trainer writes them, with times from the schedules' simulation
    (1 ms a forward, 2 a backward), ranks numbered (d * PP + p) * TP + t, TP innermost."""
    orders = {p: (interleaved_schedule(m, p, pp, v) if v > 1 else
                  [(k, p, i) for k, i in one_f_one_b_schedule(m, p, pp)]) for p in range(pp)}
    timeline = simulate(orders, pp * v, m, {"F": 1, "B": 2})
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                rank = (d * pp + p) * tp + t
                lines = []
                for step in range(1, steps + 1):
                    events = [[kind, [c, i] if v > 1 else i, s / 1e3, e / 1e3]
                              for kind, c, i, s, e in timeline[p]]
                    lines.append(json.dumps({
                        "step": step, "loss": 5.0, "coords": {"dp": d, "pp": p, "cp": 0, "tp": t},
                        "seconds": 1.0, "start": base + 10 * step, "peak_mib": 1.0,
                        "events": events}))
                (logs / f"rank-{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_committed_run_followed_the_schedule():
    record = committed()
    layout = record["layout"]
    assert len(record["ranks"]) == layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"]
    assert all(pt.follows_schedule(record).values())
    assert all(same for _, same in pt.tp_groups(record))
    assert pt.waits_for_neighbours(record)
    assert "False" not in pt.summary(record)


@pytest.mark.parametrize("sizes", [dict(dp=1, pp=2, tp=2, m=4), dict(dp=2, pp=2, tp=1, m=4, v=2)])
def test_synthetic_logs_are_read_aligned_and_checked(tmp_path, capsys, sizes):
    write_logs(tmp_path, **sizes)
    # an earlier run in the same folder, at a bigger layout: its extra rank is left out
    stale = {"step": 2, "coords": {"dp": 9, "pp": 0, "cp": 0, "tp": 0}, "seconds": 1.0,
             "start": 10.0, "events": []}
    (tmp_path / "logs" / "rank-99.jsonl").write_text(json.dumps(stale) + "\n")
    assert pt.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ranks = sizes["dp"] * sizes["pp"] * sizes["tp"]
    assert out.startswith(f"step 2 of {tmp_path}: {ranks} ranks")  # the last step, by default
    assert "False" not in out and out.count(": True") == ranks + 2
    record = pt.align(tmp_path, pt.select_step(pt.read_logs(tmp_path), 1))
    assert record["step"] == 1 and [r["rank"] for r in record["ranks"]] == list(range(ranks))
    assert min(r["span"][0] for r in record["ranks"]) == 0.0
    root = ET.fromstring(pt.render(record))
    assert len([e for e in root.iter(f"{SVG_NS}rect") if e.get("data-lane")]) == ranks


def test_a_planted_wrong_order_fails():
    record = committed()
    planted = copy.deepcopy(record)
    rank = next(r for r in planted["ranks"] if r["coords"]["pp"] == 0 and r["coords"]["tp"] == 1)
    events = rank["events"]
    i = next(k for k, e in enumerate(events) if e[0] == "B")  # run a forward before it instead
    events[i][:2], events[i + 1][:2] = events[i + 1][:2], events[i][:2]
    assert not pt.follows_schedule(planted)[rank["rank"]]
    assert sum(pt.follows_schedule(planted).values()) == len(planted["ranks"]) - 1
    assert [ranks for ranks, same in pt.tp_groups(planted) if not same] == [
        [rank["rank"] - 1, rank["rank"]]]
    assert not pt.holds(planted) and "False" in pt.summary(planted)


def test_a_stage_that_did_not_wait_for_its_input_fails():
    planted = copy.deepcopy(committed())
    first = next(r for r in planted["ranks"] if r["coords"]["pp"] == 0)
    second = next(r for r in planted["ranks"] if r["coords"]["pp"] == 1 and all(
        r["coords"][a] == first["coords"][a] for a in ("dp", "cp", "tp")))
    f0 = next(e for e in first["events"] if e[:2] == ["F", 0])
    g0 = next(e for e in second["events"] if e[:2] == ["F", 0])
    g0[2] = f0[3] - 1e-3  # stage 1 began micro-batch 0 before stage 0 had finished it
    assert pt.follows_schedule(planted) == pt.follows_schedule(committed())
    assert not pt.waits_for_neighbours(planted)


def test_the_figure_is_well_formed_with_one_lane_per_rank():
    record = committed()
    text = (svg.OUT_DIR / f"{pt.NAME}.svg").read_text(encoding="utf-8")
    assert text == pt.render(record)
    root = ET.fromstring(text)
    lanes = [e for e in root.iter(f"{SVG_NS}rect") if e.get("data-lane")]
    assert sorted(int(e.get("data-rank")) for e in lanes) == [r["rank"] for r in record["ranks"]]
    labels = {e.text for e in root.iter(f"{SVG_NS}text")}
    assert all(pt.label(record, r) in labels for r in record["ranks"])
    boxes = [e for e in root.iter(f"{SVG_NS}rect") if e.get("data-kind")]
    assert len(boxes) == sum(len(r["events"]) for r in record["ranks"])


def test_missing_logs_are_one_line_naming_the_trainer(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pt.main([str(tmp_path / "nothing")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run the trainer first" in err
    assert "snippets/training/parallel_trainer.py" in err
