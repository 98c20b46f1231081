"""Predict, then measure: exercises 12-14 take the learner's prediction before they show a number.

Each of those checks measures what the learner's FSDP method makes FSDP2 do (the share of the
parameters a rank holds, the bytes a collective moves, ...). Shown first, those numbers would be
read, not predicted. So the check starts by reading `<workspace>/predictions-N.json`: when it does
not exist, the check writes a blank one (every answer `null`) and stops, having measured nothing;
while an answer is blank, it stops again. Once every answer is filled in, it measures, prints each
prediction beside its measurement, and fails when one is off by more than the stated tolerance.

The repository's own solutions (`check --solutions`) are not asked for predictions: that command
shows the measurements on purpose, like the solution it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from snippets.exercises import catalog
from snippets.exercises.runner import CheckFailed

PERCENT_POINTS = 5  # a share of the parameters, in percentage points either way
BYTES_SHARE = 0.05  # bytes, within 5 % of the measurement
TOLERANCES = (f"shares within {PERCENT_POINTS} percentage points, bytes within "
              f"{BYTES_SHARE:.0%}, counts and dtypes exactly")

STRATEGY = {"stored_percent": "percent", "held_percent": "percent",
            "forward_all_gathers": "count", "backward_all_gathers": "count"}
PRECISION = {"forward_all_gather_bytes": "bytes", "backward_reduce_scatter_bytes": "bytes",
             "loss_dtype": "dtype"}
UNITS = {"all_gathers_per_forward": "count", "peak_percent_whole": "percent"}
# exercise: (the question, {case: {quantity: kind}})
QUESTIONS = {
    12: ("For 2 ranks and the tiny model, for each strategy: the share (%) of the parameters "
         "each rank stores, the share it holds between forward and backward, and how many "
         "all-gathers over the 2 ranks one forward and one backward make.",
         {name: STRATEGY for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")}),
    13: ("For 2 ranks and the tiny model, with fp32 and with bf16: the bytes one forward "
         "all-gathers (every all-gather's full output, added up), the bytes one backward "
         "reduce-scatters (every full input), and the dtype of the loss the model hands back; "
         "with bf16, also the dtype a block computes in when it is handed fp32 activations.",
         {"fp32": PRECISION, "bf16": {**PRECISION, "block_on_fp32_activations": "dtype"}}),
    14: ("For the tiny model (2 blocks): how many all-gathers one forward makes, and the largest "
         "share (%) of the parameters whole at once, first with the model alone as one unit, "
         "then with one unit per block and the model last.",
         {"model_alone": UNITS, "blocks_then_model": UNITS}),
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def prediction_path(number: int, learner: ModuleType) -> Path | None:
    """Where the learner's predictions for exercise `number` live, beside their copies; None for
    the repository's own solutions."""
    file = Path(learner.__file__).resolve()
    workspace = file.parents[len(Path(catalog.get(number).file).parts) - 1]
    if workspace == catalog.REPO_ROOT.resolve():
        return None
    return workspace / f"predictions-{number}.json"


def _blank(number: int) -> dict:
    question, cases = QUESTIONS[number]
    about = (f"Exercise {number}, predicted before it is measured. {question} Replace every "
             f"null with your answer (a dtype as a name such as \"float32\"); graded with "
             f"{TOLERANCES}.")
    return {"about": about, **{case: dict.fromkeys(quantities) for case, quantities in
                               cases.items()}}


def _valid(kind: str, value) -> bool:
    if kind == "dtype":
        return isinstance(value, str)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require(number: int, learner: ModuleType) -> dict | None:
    """The learner's predictions, complete; stops the check (CheckFailed, nothing measured)
    while they are missing or blank. None for the repository's own solutions."""
    path = prediction_path(number, learner)
    if path is None:
        return None
    question, cases = QUESTIONS[number]
    if not path.exists():
        path.write_text(json.dumps(_blank(number), indent=2) + "\n", encoding="utf-8")
        raise CheckFailed(
            f"predict first, then measure. {question} Write your answers into {path} (just "
            "written, every answer null) and run the check again: it measures nothing until "
            "then, and grades your numbers against what it measures")
    try:
        given = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckFailed(f"{path} is not valid JSON ({err}); fix it, or delete it for a blank "
                          "one") from None
    blank = [f"{case}.{q}" for case, quantities in cases.items() for q, kind in quantities.items()
             if not isinstance(given.get(case), dict) or not _valid(kind, given[case].get(q))]
    if blank:
        raise CheckFailed(
            f"predict first, then measure: {path} has no answer yet for {', '.join(blank)} "
            "(a number, or a dtype's name). The check measures nothing until every answer is "
            "filled in")
    return given


def _matches(kind: str, predicted, measured) -> bool:
    if kind == "dtype":
        name = str(predicted).strip().lower().removeprefix("torch.")
        return DTYPES.get(name, name) == measured
    if kind == "percent":
        return abs(predicted - measured) <= PERCENT_POINTS
    if kind == "bytes":
        return abs(predicted - measured) <= BYTES_SHARE * measured
    return predicted == measured


def grade(number: int, predicted: dict | None, measured: dict) -> list[str]:
    """Each prediction beside its measurement: a report line per case when every one is within
    its tolerance, else CheckFailed with the whole table."""
    if predicted is None:
        return []
    _, cases = QUESTIONS[number]
    lines, off = [], 0
    for case, quantities in cases.items():
        cells = []
        for q, kind in quantities.items():
            p, m = predicted[case][q], measured[case][q]
            good = _matches(kind, p, m)
            off += not good
            cells.append(f"{q} predicted {p}, measured {m}" + ("" if good else " (off)"))
        lines.append(f"{case}: " + "; ".join(cells))
    if off:
        raise CheckFailed(
            f"your code is right, but {off} of your predictions {'is' if off == 1 else 'are'} off ({TOLERANCES}):\n  "
            + "\n  ".join(lines)
            + "\n  Work out where each number marked (off) comes from, correct "
            f"predictions-{number}.json, and run the check again")
    return [f"predicted within the tolerance: {line}" for line in lines]
