"""Learner copies of the solution modules, with each exercise's section blanked out.

The copy keeps every other byte of the module, the section markers included, so stub and
solution never drift apart and the checker can find the exercise in the learner's file. The
section's lines become a `# TODO(exercise N)` comment and a `raise NotImplementedError(...)`
that names the exercise, says where to start and how to get a hint (one at a time, with
`hints N`: the stub never lists them all), and gives the command that checks it.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from snippets.exercises.catalog import EXERCISES, Exercise

MARKER = re.compile(r"^(?P<indent>[ \t]*)# --8<-- \[(?P<kind>start|end):(?P<name>[\w.-]+)\]\s*$")
# Where a stub still stands: `raise NotImplementedError(` then, on the next line, "Exercise N: ...
STUB = re.compile(r'raise NotImplementedError\(\s*"Exercise (\d+):')


def _literal(text: str) -> str:
    """A double-quoted Python string literal holding text."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _wrap(text: str, width: int) -> list[str]:
    """text cut at spaces into pieces of at most width characters (longer words stay whole);
    every piece but the last keeps its trailing space, so the pieces join back into text."""
    pieces, line = [], ""
    for word in text.split(" "):
        if line and len(line) + len(word) > width:
            pieces.append(line)
            line = ""
        line += word + " "
    return pieces + [line[:-1]]


def stub_lines(exercise: Exercise, indent: str, width: int = 96) -> list[str]:
    """The lines that stand in for one of the exercise's sections."""
    n = exercise.number
    message = [f"Exercise {n}: {exercise.title}. ",
               "Start from the TODO above; python -m snippets.exercises hints "
               f"{n} gives a hint, the next one each time you run it. ",
               f"Check with: python -m snippets.exercises check {n}"]
    todo = _wrap(f"TODO(exercise {n}): {exercise.task}.", width - len(indent) - 2)
    literal_width = width - len(indent) - 4 - 2  # the 4-space continuation and the quotes
    literals = [piece for part in message for piece in _wrap(part, literal_width)
                if piece]
    return [
        f"{indent}# {todo[0].rstrip()}\n",
        *(f"{indent}#   {line.rstrip()}\n" for line in todo[1:]),
        f"{indent}raise NotImplementedError(\n",
        *(f"{indent}    {_literal(piece)}\n" for piece in literals[:-1]),
        f"{indent}    {_literal(literals[-1])})\n",
    ]


def blank_bodies(source: str, exercises: list[Exercise]) -> str:
    """source with the bodies of the exercises' `blank` functions replaced by their stubs.

    For a section that holds more than the exercise (a whole class, two functions), the
    exercise names the functions to write (`Class.method` or `function`): their signatures and
    docstrings stay, so the learner sees what each must do."""
    lines = source.splitlines(keepends=True)
    bodies = []  # (first line, last line, indent, exercise), 1-based, inclusive

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                for ex in exercises:
                    if isinstance(child, ast.FunctionDef) and name in ex.blank:
                        body = child.body
                        if (len(body) > 1 and isinstance(body[0], ast.Expr)
                                and isinstance(body[0].value, ast.Constant)
                                and isinstance(body[0].value.value, str)):
                            body = body[1:]  # keep the docstring
                        indent = " " * body[0].col_offset
                        bodies.append((body[0].lineno, child.end_lineno, indent, ex, name))
                visit(child, name + ".")

    visit(ast.parse(source), "")
    missing = {n for ex in exercises for n in ex.blank} - {b[4] for b in bodies}
    if missing:
        raise ValueError(f"functions not found: {', '.join(sorted(missing))}")
    for first, last, indent, ex, _ in sorted(bodies, key=lambda b: b[0], reverse=True):
        lines[first - 1:last] = stub_lines(ex, indent)
    return "".join(lines)


def make_stub(source: str, exercises: list[Exercise]) -> str:
    """source with the sections of the given exercises replaced by their stubs."""
    source = blank_bodies(source, [ex for ex in exercises if ex.blank])
    exercises = [ex for ex in exercises if not ex.blank]
    owner = {section: ex for ex in exercises for section in ex.sections}
    out: list[str] = []
    inside: str | None = None
    found: set[str] = set()
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        m = MARKER.match(line)
        if inside is None:
            out.append(line)
            if m and m["kind"] == "start" and m["name"] in owner:
                inside = m["name"]
                out += stub_lines(owner[inside], m["indent"])
        elif m and m["kind"] == "end" and m["name"] == inside:
            out.append(line)
            found.add(inside)
            inside = None
        elif m and m["name"] in owner:
            raise ValueError(f"line {lineno}: section {m['name']} inside section {inside}")
    if inside is not None:
        raise ValueError(f"section {inside} has no end marker")
    missing = set(owner) - found
    if missing:
        raise ValueError(f"sections not found: {', '.join(sorted(missing))}")
    return "".join(out)


def exercises_by_file() -> dict[str, list[Exercise]]:
    files: dict[str, list[Exercise]] = {}
    for ex in EXERCISES:
        if ex.available:
            files.setdefault(ex.file, []).append(ex)
    return files


def stub_for(file: str) -> str:
    exercises = exercises_by_file()[file]
    return make_stub(exercises[0].solution_path.read_text(encoding="utf-8"), exercises)


@dataclass
class Written:
    path: Path
    action: str  # "wrote", "unchanged", "replaced", "skipped"
    exercises: list[int]
    backup: Path | None = None


def write_stubs(out: Path, force: bool = False) -> list[Written]:
    """Write a stub of every file that holds an available exercise under out/, mirroring paths,
    by write_stub's rule."""
    return [write_stub(out / file, stub_for(file), [e.number for e in exercises], force)
            for file, exercises in exercises_by_file().items()]


def write_stub(target: Path, stub: str, numbers: list[int], force: bool = False) -> Written:
    """Write stub to target. A file there that differs from the fresh stub holds the learner's
    work: it is skipped unless force, and even then the old file is kept beside it as
    <name>.bak (.bak.2, ... if that exists)."""
    if target.exists():
        if target.read_text(encoding="utf-8") == stub:
            return Written(target, "unchanged", numbers)
        if not force:
            return Written(target, "skipped", numbers)
        backup = target.with_name(target.name + ".bak")
        n = 2
        while backup.exists():  # an older backup is someone's work too
            backup = target.with_name(f"{target.name}.bak.{n}")
            n += 1
        shutil.copy2(target, backup)
        target.write_text(stub, encoding="utf-8")
        return Written(target, "replaced", numbers, backup)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(stub, encoding="utf-8")
    return Written(target, "wrote", numbers)


def stub_location(text: str, number: int) -> int | None:
    """Line (1-based) of the TODO comment of exercise number's stub in text; None when the
    exercise's stub is no longer there."""
    for m in STUB.finditer(text):
        if int(m[1]) == number:
            lineno = text.count("\n", 0, m.start()) + 1
            todo = f"# TODO(exercise {number})"
            previous = text.splitlines()[lineno - 2] if lineno >= 2 else ""
            return lineno - 1 if todo in previous else lineno
    return None
