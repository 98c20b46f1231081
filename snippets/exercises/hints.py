"""The hint ladder: `hints N` shows exercise N's hints one at a time.

The first call shows what the exercise asks and its first hint, each call after that the next
hint, and after the last one it says there are no more (`--all` shows every hint at once,
`--reset` starts the ladder over). How far each exercise has got is kept in one small file in
the workspace, written whole to a temporary file and renamed over the old one, so a stopped
write never leaves half a file; nothing else is written, and nothing is removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from snippets.exercises.catalog import Exercise

PROGRESS_FILE = ".exercise-hints.json"  # {"exercise number": hints seen}


def load_progress(workspace: Path) -> dict[str, int]:
    path = workspace / PROGRESS_FILE
    if not path.is_file():
        return {}
    try:
        progress = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"{path} is not a hints progress file ({err}): move it away and the "
                         "hints start over") from None
    if not isinstance(progress, dict) or not all(isinstance(v, int) for v in progress.values()):
        raise SystemExit(f"{path} is not a hints progress file: move it away and the hints "
                         "start over")
    return progress


def save_progress(workspace: Path, progress: dict[str, int]) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    path = workspace / PROGRESS_FILE
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(progress, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def header(ex: Exercise) -> list[str]:
    lines = [f"Exercise {ex.number}: {ex.title} ({ex.file})",
             f"  concept:    {ex.concept}",
             f"  difficulty: {ex.difficulty}",
             f"  task:       {ex.task}"]
    if ex.depends_on:
        lines.append(f"  builds on:  exercises {', '.join(map(str, ex.depends_on))}")
    return lines + [f"  check it:   python -m snippets.exercises check {ex.number}"]


def all_hints(ex: Exercise) -> list[str]:
    lines = header(ex)
    if ex.hints:
        lines.append("  hints:")
    return lines + [f"    {i}. {hint}" for i, hint in enumerate(ex.hints, 1)]


def next_hint(ex: Exercise, workspace: Path, command: str, reset: bool = False) -> list[str]:
    """The lines that show exercise ex's next hint, the task first the first time; the
    progress in workspace moves on by one. command is how the learner asks again."""
    progress = load_progress(workspace)
    seen = 0 if reset else progress.get(str(ex.number), 0)
    total = len(ex.hints)
    if seen >= total:
        if reset:  # an exercise without hints: nothing to go through
            return header(ex)
        return [f"Exercise {ex.number}: no more hints, you have seen all {total}. "
                f"{command} --all shows them all; {command} --reset starts over"]
    progress[str(ex.number)] = seen + 1
    save_progress(workspace, progress)
    hint = f"hint {seen + 1} of {total}: {ex.hints[seen]}"
    lines = header(ex) + [f"  {hint}"] if seen == 0 else [f"Exercise {ex.number}, {hint}"]
    if seen + 1 < total:
        return lines + [f"next hint: {command}"]
    return lines + [f"that was the last hint; {command} --all shows them all"]
