"""Wrong answers planted in the exercises: each must FAIL with the message that names it.

A plant is a realistic wrong answer: the solution's section with one small edit, written into a
workspace of its own and checked as `python -m snippets.exercises check N` checks it
(runner.run_check). An exercise check that passes a wrong answer is a defect; one that fails it
with a generic message teaches nothing, so each plant names the message it must get.

The list is published as the table of docs/exercises/wrong-answers.md, and a test keeps the page
equal to it: a row of the table is a plant run here, and every plant run here is a row.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest

from snippets.exercises import catalog
from snippets.exercises.runner import run_check
from tests.test_exercises import RING, edited, raised_at, ring, solution_section, workspace_with

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "exercises" / "wrong-answers.md"


@dataclass(frozen=True)
class Plant:
    exercise: int
    wrong: str  # the wrong answer, in words: the table's second column
    message: str  # a part of the check's message that names it: the table's third column
    section: str  # the solution's section the planted code replaces
    code: str
    at: tuple[str, str] = ("", "")  # (code, function) of the line the message must point at
    shown: bool = False  # the page shows its message's measured events, in a text block


OVERLAPPED = solution_section(catalog.DDP_SCRATCH_FILE, "overlapped")
LAUNCH = "                self.pending.append((bucket, dist.all_reduce(bucket.buffer, async_op=True)))\n"
WAIT_THEN_UNPACK = "            work.wait()\n            bucket.unpack(1 / world)\n"
BUCKETED = solution_section(catalog.DDP_SCRATCH_FILE, "bucketed")
SCHEDULES = solution_section(catalog.PIPELINE_FILE, "schedules")
SP_REPLICATED = solution_section(catalog.SP_FILE, "replicated-grads")
ZERO3 = solution_section(catalog.ZERO_FILE, "zero3")

PLANTS = (
    Plant(16, "the all-gather phase uses the reduce-scatter phase's chunk indices",
          "the all-gather phase used the reduce-scatter phase's chunk indices",
          "ring-all-reduce", ring(("(rank + 1 - step) % world, (rank - step) % world",
                                   "(rank - step) % world, (rank - step - 1) % world"))),
    Plant(16, "the reduce-scatter adds each received chunk into the chunk before the one it sent",
          "the reduce-scatter phase is wrong: after it (your first p-1 = 3 sends) rank 0 holds no "
          "chunk summed over all 4 ranks",
          "ring-all-reduce", ring(("(rank - step) % world, (rank - step - 1) % world",
                                   "(rank - step) % world, (rank - step + 1) % world"))),
    Plant(16, "the all-gather copies each received chunk one index too far",
          "the reduce-scatter phase is right (after it every rank holds one finished chunk) but "
          "the all-gather phase is wrong",
          "ring-all-reduce", ring(("(rank + 1 - step) % world, (rank - step) % world",
                                   "(rank + 1 - step) % world, (rank - step - 1) % world"))),
    Plant(16, "the tensor cut with tensor.chunk(world): a 3x4 tensor gives 3 rows, and the ranks "
              "that index a fourth raise",
          "rank 0 raised IndexError: list index out of range",
          "ring-all-reduce", ring(("chunks = list(tensor.view(-1).tensor_split(world))",
                                   "chunks = list(tensor.chunk(world))")),
          at=("chunks[recv_index] += exchange", "ring_all_reduce")),
    Plant(18, "the cool-down's backwards run newest first",
          "the cool-down runs the owed backwards in reverse order",
          "schedules", edited(SCHEDULES, (
              'actions += [("B", i) for i in range(m - warmup, m)]',
              'actions += [("B", i) for i in reversed(range(m - warmup, m))]'))),
    Plant(20, "a blocking dist.all_reduce in the hook, the bucket unpacked there",
          "your hook's all-reduce blocks backward: it is a blocking dist.all_reduce",
          "overlapped", edited(OVERLAPPED, (
              LAUNCH,
              "                dist.all_reduce(bucket.buffer)\n"
              "                bucket.unpack(1 / dist.get_world_size())\n"
              "                self.pending.append((bucket, None))\n"),
              (WAIT_THEN_UNPACK, "            pass  # reduced and unpacked in the hook\n"))),
    Plant(20, "the async all-reduce waited on in the hook, right after its launch",
          "your hook's all-reduce blocks backward: you wait() on the handle before backward has "
          "ended",
          "overlapped", edited(OVERLAPPED, (
              LAUNCH,
              "                work = dist.all_reduce(bucket.buffer, async_op=True)\n"
              "                work.wait()\n"
              "                self.pending.append((bucket, work))\n")), shown=True),
    Plant(20, "no_sync() ignored: the hook reduces inside it too",
          "inside no_sync() your hook launched 2 all-reduce(s)",
          "overlapped", edited(OVERLAPPED, (
              "            if not self.require_sync:\n"
              "                return  # inside no_sync(): gradients just accumulate locally\n",
              ""))),
    Plant(20, "every bucket reduced after backward, in _finish",
          "every bucket's all-reduce was launched after backward had ended (in _finish)",
          "overlapped", edited(OVERLAPPED, (
              "                bucket.pack()\n" + LAUNCH,
              "                self.pending.append((bucket, None))\n"), (
              WAIT_THEN_UNPACK,
              "            bucket.pack()\n            dist.all_reduce(bucket.buffer)\n"
              "            bucket.unpack(1 / world)\n"))),
    Plant(20, "every bucket launched together, at the last gradient of the backward",
          "bucket 0 (2.bias, 2.weight, 0.bias) was complete after gradient 3 of 4, but its "
          "all-reduce was launched only after gradient 4",
          "overlapped", edited(OVERLAPPED, (
              "            if bucket.ready == len(bucket.params):\n"
              "                bucket.pack()\n" + LAUNCH,
              "            if all(b.ready == len(b.params) for b in self.buckets):\n"
              "                for b in self.buckets:\n"
              "                    b.pack()\n"
              "                    self.pending.append((b, dist.all_reduce(b.buffer, "
              "async_op=True)))\n"))),
    Plant(20, "each bucket unpacked before its handle is waited on",
          "you unpacked a bucket before waiting on its all-reduce",
          "overlapped", edited(OVERLAPPED, (
              WAIT_THEN_UNPACK, "            bucket.unpack(1 / world)\n            work.wait()\n"))),
    Plant(23, "free() never called after a unit's forward",
          "the full weights were never freed, because free() was never called in forward",
          "zero3", edited(ZERO3, ("        unit.free()\n", ""))),
    Plant(25, "the norm weight's gradient divided by N after its all-reduce",
          "the norm weight's gradient was divided by N = 2 after the all-reduce",
          "replicated-grads", edited(SP_REPLICATED, (
              "        dist.all_reduce(grad, group=group)\n",
              "        dist.all_reduce(grad, group=group)\n"
              "        grad /= dist.get_world_size(group)\n"))),
    Plant(27, "an async all-reduce in sync_gradients, the bucket unpacked before the wait",
          "you unpacked a bucket before waiting on its all-reduce",
          "bucketed", edited(BUCKETED, (
              "            dist.all_reduce(bucket.buffer)\n            bucket.unpack(1 / world)",
              "            work = dist.all_reduce(bucket.buffer, async_op=True)\n"
              "            bucket.unpack(1 / world)\n            work.wait()"))),
)


def plant_id(plant: Plant) -> str:
    return f"{plant.exercise}-{plant.wrong[:40]}"


@pytest.mark.parametrize("plant", PLANTS, ids=plant_id)
def test_a_planted_wrong_answer_fails_with_its_named_message(plant, tmp_path, monkeypatch):
    from snippets.exercises import gang

    if plant.at[0]:  # a rank raises and its peers wait: the watchdog reports them in 2 s
        monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)
    ex = catalog.get(plant.exercise)
    result = run_check(ex, workspace_with(tmp_path, {plant.section: plant.code}))
    assert result.status == "FAIL", result
    assert plant.message in result.message, result.message
    if plant.at[0]:
        assert raised_at(tmp_path / ex.file, *plant.at) in result.message, result.message
    if plant.shown:
        measured = next(line.strip() for line in result.message.splitlines()
                        if line.startswith("  Measured on rank 0"))
        assert f"```text\n{measured}\n```" in PAGE.read_text(), measured


def test_the_planted_code_differs_from_the_solution():
    for plant in PLANTS:
        solution = solution_section(catalog.get(plant.exercise).file, plant.section)
        assert plant.code.strip() != (RING if plant.section == "ring-all-reduce"
                                      else solution).strip(), plant


def table() -> str:
    rows = ["| exercise | wrong answer | message it gets |", "| --- | --- | --- |"]
    rows += [f"| {p.exercise} | {p.wrong} | `{p.message}` |" for p in PLANTS]
    return "\n".join(rows) + "\n"


def test_the_page_shows_exactly_the_plants_run_here():
    page = PAGE.read_text()
    assert table() in page, "docs/exercises/wrong-answers.md's table should be:\n" + table()
    rows = [line for line in page.splitlines() if line.startswith("|")]
    assert len(rows) == len(PLANTS) + 2, "the page has table rows that are no plant of this file"
