"""Exercises 12-14 are predicted before they are measured (snippets/exercises/predictions.py):
a check without the learner's predictions shows no measured number and writes a blank file to
fill in; a wrong prediction fails, beside the measurement; right ones pass."""

import json

import pytest

from snippets.exercises import catalog
from snippets.exercises.runner import run_check
from tests.test_exercises import RIGHT_PREDICTIONS, workspace_with

# Numbers only the measurement gives: none may appear before the learner has predicted.
MEASURED = ("57", "462,080", "231,040", "100%", "50%", "all-gathers in forward")


@pytest.mark.parametrize("number", [12, 13, 14])
def test_without_a_prediction_the_check_measures_and_shows_nothing(number, tmp_path):
    workspace = workspace_with(tmp_path, {})
    path = workspace / f"predictions-{number}.json"
    path.unlink()
    result = run_check(catalog.get(number), workspace)
    assert result.status == "FAIL" and result.message.startswith("predict first"), result
    assert not any(m in result.message for m in MEASURED), result.message
    blank = json.loads(path.read_text())  # written for the learner to fill in
    cases = {k: v for k, v in blank.items() if k != "about"}
    assert cases and all(v is None for case in cases.values() for v in case.values()), blank

    # Still blank (or half filled): still nothing measured.
    first_case = next(iter(cases))
    blank[first_case] = RIGHT_PREDICTIONS[number][first_case]
    path.write_text(json.dumps(blank))
    again = run_check(catalog.get(number), workspace)
    assert again.status == "FAIL" and "has no answer yet for" in again.message, again
    assert first_case + "." not in again.message
    assert not any(m in again.message for m in MEASURED), again.message


def test_a_wrong_prediction_fails_beside_the_measurement_and_a_right_one_passes(tmp_path):
    workspace = workspace_with(tmp_path, {})
    right = run_check(catalog.get(14), workspace)
    assert right.ok, right.message
    assert any(p.startswith("predicted within the tolerance: blocks_then_model:")
               for p in right.passed), right.passed

    wrong = json.loads(json.dumps(RIGHT_PREDICTIONS[14]))
    wrong["blocks_then_model"]["peak_percent_whole"] = 100  # "FSDP saves nothing in forward"
    (workspace / "predictions-14.json").write_text(json.dumps(wrong))
    result = run_check(catalog.get(14), workspace)
    assert result.status == "FAIL", result
    assert "your code is right, but 1 of your predictions is off" in result.message
    assert "peak_percent_whole predicted 100, measured 57 (off)" in result.message, result.message


def test_the_solutions_are_not_asked_for_predictions():
    from snippets.exercises.runner import solutions_workspace

    result = run_check(catalog.get(14), solutions_workspace())
    assert result.ok and not any("predicted" in p for p in result.passed), result.passed
    assert not (catalog.REPO_ROOT / "predictions-14.json").exists()
