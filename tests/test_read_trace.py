"""read_trace.py reads what docs/workshop/session-b/profiling-and-accelerate.md says a profiler
trace holds, and catches a table that does not match its trace; profile_mps.py refuses to run
without MPS in one line. The real trace and table are checked by that page's own blocks; these
tests use small hand-written ones, and need no profiler run."""

import json

import pytest

from snippets.tools import read_trace

pytestmark = pytest.mark.kernel_independent("a profiler trace's records and a table's text")

TABLE = """\
-----------------------------------------------  ------------  ------------  ------------
                                           Name    Self CPU %      Self CPU    # of Calls
-----------------------------------------------  ------------  ------------  ------------
                                       aten::mm        50.00%      10.000ms             4
                                  ProfilerStep*        10.00%       2.000ms             2
                                      aten::mul         6.00%       1.200ms             2
 autograd::engine::evaluate_function: MmBack...         5.00%       1.000ms             2
-----------------------------------------------  ------------  ------------  ------------
Self CPU time total: 20.000ms
"""


def event(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def two_steps() -> list[dict]:
    """Two profiled steps: a forward label around two matmuls and a mul that only calls another
    mul (the table folds the inner one into it), then one backward node."""
    events = [{"ph": "M", "name": "process_name", "args": {"name": "python"}},  # metadata
              event("PyTorch Profiler (0)", 0, 200, "Trace")]
    for step, start in ((2, 0), (3, 100)):
        events += [event(f"ProfilerStep#{step}", start, 50, "user_annotation"),
                   event("forward", start + 1, 19, "user_annotation"),
                   event("aten::mm", start + 2, 1), event("aten::mm", start + 4, 1),
                   event("aten::mul", start + 6, 4), event("aten::mul", start + 7, 2),
                   event("autograd::engine::evaluate_function: MmBackward0", start + 21, 5)]
    return events


def write(tmp_path, content, name="trace.json"):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_summary_counts_each_label_and_operator_per_step(tmp_path):
    events = read_trace.load_events(write(tmp_path, {"traceEvents": two_steps()}))
    summary = read_trace.summarize(events)
    assert summary["steps"] == ["ProfilerStep#2", "ProfilerStep#3"]
    assert summary["events"] == 15  # the metadata event is not a complete event
    assert summary["by_category"] == {"Trace": 1, "user_annotation": 4, "cpu_op": 10}
    assert summary["labels"] == {"forward": 1}
    assert summary["merged"] == 2  # the inner mul of each step
    assert summary["operators"] == {"aten::mm": 2, "aten::mul": 1,
                                    "autograd::engine::evaluate_function: MmBackward0": 1}
    assert summary["calls"]["ProfilerStep*"] == 2  # grouped the way the table groups them


def test_an_operator_with_another_child_beside_its_namesake_is_not_folded():
    events = [event("aten::mul", 0, 10), event("aten::mul", 1, 2), event("aten::empty", 5, 1),
              event("aten::mul", 20, 5), event("aten::add", 21, 3), event("aten::add", 22, 1)]
    assert read_trace.merged_into_parent(events) == [events[5]]  # the second add, not a mul


def test_a_table_that_matches_its_trace(tmp_path, capsys):
    trace = write(tmp_path, {"traceEvents": two_steps()})
    table = write(tmp_path, TABLE, "table.txt")
    assert read_trace.main([str(trace), "--table", str(table), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"{trace}: 15 complete events, by category: Trace 1, cpu_op 10, user_annotation 4",
        "2 profiled steps: ProfilerStep#2, ProfilerStep#3",
        "labels per step: forward 1",
        "3 distinct operators, 4 calls per step; the 1 most called:",
        "       2  aten::mm",
        "the table's 4 rows: each one is in the trace, with the same number of calls "
        "(the table folds 2 events into a parent of the same name)",
    ]


def test_a_row_with_another_count_is_reported(tmp_path, capsys):
    trace = write(tmp_path, {"traceEvents": two_steps()})
    table = write(tmp_path, TABLE.replace("             4\n", "             5\n"), "table.txt")
    assert read_trace.main([str(trace), "--table", str(table)]) == 2
    assert capsys.readouterr().err == (
        f"error: {table} does not match the trace: aten::mm: 5 calls in the table, 4 in the trace\n")


def test_a_row_missing_from_the_trace_is_reported(tmp_path, capsys):
    events = [e for e in two_steps() if not e["name"].startswith("autograd::")]
    trace = write(tmp_path, {"traceEvents": events})
    table = write(tmp_path, TABLE, "table.txt")
    assert read_trace.main([str(trace), "--table", str(table)]) == 2
    assert "evaluate_function: MmBack...: 2 calls in the table, none in the trace" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable JSON file"),
    ({"events": []}, "JSON, but no traceEvents list: not a Chrome trace"),
    ({"traceEvents": [{"ph": "M", "name": "process_name"}]},
     "a Chrome trace with no complete events: nothing was profiled"),
])
def test_a_file_that_is_not_a_trace_is_one_line(tmp_path, capsys, content, message):
    path = write(tmp_path, content)
    assert read_trace.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: {message}") and err.count("\n") == 1


def test_a_missing_or_tableless_table_file_is_one_line(tmp_path, capsys):
    trace = write(tmp_path, {"traceEvents": two_steps()})
    assert read_trace.main([str(trace), "--table", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'none.txt'}: No such file or directory\n")
    assert read_trace.main([str(trace), "--table", str(write(tmp_path, "hello\n", "t.txt"))]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 't.txt'}: no profiler table found "
                                       "(it is framed by three lines of dashes)\n")


def test_bad_numbers_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        read_trace.main(["trace.json", "--top", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --top: must be a whole number >= 0, got -1\n")


def test_profile_mps_without_mps_is_one_line(capsys):
    import torch

    from snippets.scripts import profile_mps

    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS: the script would record")
    assert profile_mps.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device mps was requested, but MPS is not available")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        profile_mps.main(["--steps", "0"])
    assert capsys.readouterr().err.endswith(
        "error: argument --steps: must be a whole number >= 1, got 0\n")


def test_the_facts_the_mps_tab_states_about_the_pinned_torch():
    import inspect

    import torch

    # "torch.profiler has no MPS activity in PyTorch 2.13 (its ProfilerActivity lists ...)"
    assert set(torch.profiler.ProfilerActivity.__members__) == {
        "CPU", "CUDA", "XPU", "MTIA", "HPU", "PrivateUse1"}
    # profile_mps.py calls torch.mps.profiler.profile(mode="interval", wait_until_completed=...)
    assert list(inspect.signature(torch.mps.profiler.profile).parameters) == [
        "mode", "wait_until_completed"]
