"""Import a learner's copy of a module and run an exercise's check on it.

The learner's file is imported by path under a fresh module name, never as `snippets.models.gpt`:
that name is the solution, and testing it would pass whatever the learner wrote.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import itertools
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from snippets.exercises.catalog import CHECKS_DIR, REPO_ROOT, Exercise, all_dependencies
from snippets.exercises.stubs import stub_location

_counter = itertools.count()
_NOT_DONE = re.compile(r"^Exercise (\d+):")


@dataclass
class Result:
    exercise: Exercise
    status: str  # "PASS", "FAIL", "not started", "blocked", "not yet"
    message: str = ""
    passed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "PASS"


class CheckFailed(AssertionError):
    """The learner's code runs but does the wrong thing; the message says what and why."""


class LoadError(Exception):
    """The learner's file is missing or cannot be imported; the message says why."""


def load_learner_module(path: Path) -> ModuleType:
    """Import the file at path as a new, uniquely named module."""
    if not path.is_file():
        raise LoadError(f"there is no {path}")
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_exercise_{stem}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is being built.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        sys.modules.pop(name, None)
        raise LoadError(f"{path} line {err.lineno} is not valid Python: {err.msg}") from None
    except Exception as err:  # noqa: BLE001 - whatever the learner's module raised on import
        sys.modules.pop(name, None)
        raise LoadError(f"importing {path} raised {_describe(err, path)}") from None
    return module


def _describe(err: BaseException, path: Path) -> str:
    """`Type: message`, and where in the learner's file it was raised."""
    text = f"{type(err).__name__}: {err}"
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if Path(f.filename).resolve() == path.resolve()]
    if frames:
        f = frames[-1]
        text += f"\n  at {path} line {f.lineno}, in {f.name}: {(f.line or '').strip()}"
    return text


def find_check(exercise: Exercise):
    """The exercise's check function, from its own file checks/exNN_<what>.py, NN its number
    (imported on first use: the checks of the parallelisms import much of torch.distributed)."""
    path = exercise.check_path
    if path is None:
        raise LookupError(f"exercise {exercise.number} needs exactly one check file "
                          f"{CHECKS_DIR}/ex{exercise.number:02d}_*.py")
    module = importlib.import_module(f"snippets.exercises.checks.{path.stem}")
    if not hasattr(module, exercise.check):
        raise LookupError(f"no check called {exercise.check} in {path}")
    return getattr(module, exercise.check)


def _workspace_file(workspace: Path, exercise: Exercise) -> Path:
    return workspace / exercise.file


def _not_done(workspace: Path, exercise: Exercise) -> str | None:
    """`<file> at line L` when the exercise's stub is still in the learner's file."""
    path = _workspace_file(workspace, exercise)
    if not path.is_file():
        return None
    line = stub_location(path.read_text(encoding="utf-8"), exercise.number)
    return None if line is None else f"{path} at line {line}"


def run_check(exercise: Exercise, workspace: Path, *, explain_dependencies: bool = True) -> Result:
    if not exercise.available:
        return Result(exercise, "not yet", f"comes with {exercise.arrives_with}")
    path = _workspace_file(workspace, exercise)
    if not path.is_file():
        return Result(exercise, "FAIL",
                      f"there is no {path}: create your copies with "
                      f"python -m snippets.exercises stubs --out {workspace}")
    where = _not_done(workspace, exercise)
    if where:
        return Result(exercise, "not started", f"not started yet: edit {where}")
    deps = all_dependencies(exercise)
    for dep in deps:
        where = _not_done(workspace, dep)
        if where:
            return Result(exercise, "blocked",
                          f"exercise {exercise.number} needs {_numbers(deps)}; exercise "
                          f"{dep.number} is not done yet: edit {where}")
    try:
        module = load_learner_module(path)
    except LoadError as err:
        return Result(exercise, "FAIL", str(err))

    threads = torch.get_num_threads()
    # The checks use tiny tensors: one thread is fastest, and on a busy machine several
    # threads spinning for each small matmul make a check take seconds instead of milliseconds.
    torch.set_num_threads(1)
    printed = io.StringIO()  # the learner's prints (and the trainer's logs) stay out of a PASS
    try:
        with contextlib.redirect_stdout(printed):
            passed = find_check(exercise)(module)
        return Result(exercise, "PASS", passed=passed)
    except CheckFailed as err:
        message = str(err)
    except NotImplementedError as err:
        m = _NOT_DONE.match(str(err))
        if m and int(m[1]) != exercise.number:
            return Result(exercise, "blocked",
                          f"exercise {exercise.number} calls the code of exercise {m[1]}, which "
                          f"still raises NotImplementedError: do exercise {m[1]} first")
        message = f"your code raised {_describe(err, path)}"
    except Exception as err:  # noqa: BLE001 - the learner's code may raise anything
        message = f"your code raised {_describe(err, path)}"
    finally:
        torch.set_num_threads(threads)
        sys.modules.pop(module.__name__, None)

    if printed.getvalue().strip():
        lines = printed.getvalue().strip().splitlines()
        message += "\n  your code printed:\n" + "\n".join(f"    {line}" for line in lines[:10])
        if len(lines) > 10:
            message += f"\n    ... ({len(lines) - 10} more lines)"
    if explain_dependencies:
        for dep in deps:
            if not run_check(dep, workspace, explain_dependencies=False).ok:
                message += (f"\n  note: exercise {exercise.number} builds on exercise "
                            f"{dep.number}, which does not pass its own check yet: run "
                            f"python -m snippets.exercises check {dep.number}")
                break
    return Result(exercise, "FAIL", message)


def _numbers(exercises: list[Exercise]) -> str:
    ns = [e.number for e in exercises]
    if len(ns) == 1:
        return f"exercise {ns[0]}"
    if len(ns) > 2 and ns == list(range(ns[0], ns[-1] + 1)):
        return f"exercises {ns[0]}-{ns[-1]}"
    return "exercises " + ", ".join(map(str, ns[:-1])) + f" and {ns[-1]}"


def solutions_workspace() -> Path:
    """The repository itself: its files are the solutions, so every check passes there."""
    return REPO_ROOT
