"""The empty-file variant of an exercise: the interface alone, and the learner writes the rest.

`python -m snippets.exercises stubs --empty N` writes `<out>/empty/<file>`, a file that holds
only what exercise N's `empty` functions and classes promise: each one's signature and
docstring, with a `raise NotImplementedError("Exercise N: ...")` for a body. A class keeps its
public methods (and `__init__`); its private helpers are the solution's design, left to the
learner. The file starts with the imports the solution uses; a name the solution takes from
elsewhere in its own module (exercise 20's Bucket) is imported from the course's module, never
copied. The interface is cut out of the solution's syntax tree, so it cannot drift from it:
where a docstring is too thin to write the code from, improve it in the solution itself. The
same check grades it: `python -m snippets.exercises check N --workspace <out>/empty`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from snippets.exercises.catalog import EXERCISES, Exercise
from snippets.exercises.stubs import Written, write_stub


def empty_exercises(file: str) -> list[Exercise]:
    """The available exercises of file that have an empty-file variant."""
    return [ex for ex in EXERCISES if ex.file == file and ex.empty and ex.available]


def _docstring_node(node) -> ast.Expr | None:
    return node.body[0] if ast.get_docstring(node, clean=False) is not None else None


def _interface_of(node, lines: list[str], number: int, prefix: str = "") -> list[str]:
    """The source lines of node's decorators, signature and docstring, and a raise for a body;
    for a class, those of its header and docstring, then each public method's."""
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    if node.body[0].lineno == node.lineno:
        raise ValueError(f"{node.name}: a body on its def line has no signature to keep")
    doc = _docstring_node(node)
    head = lines[start - 1:(doc or node.body[0]).lineno - 1]
    head += lines[doc.lineno - 1:doc.end_lineno] if doc else []
    name = prefix + node.name
    if isinstance(node, ast.FunctionDef):
        indent = " " * node.body[0].col_offset
        message = f"Exercise {number}: write {name} from its docstring"
        return head + [f'{indent}raise NotImplementedError("{message}")\n']
    methods = [child for child in node.body if isinstance(child, ast.FunctionDef)
               and (not child.name.startswith("_") or child.name.endswith("__"))]
    for method in methods:
        head += ["\n", *_interface_of(method, lines, number, name + ".")]
    return head


def _used_names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _imports(tree: ast.Module, used: set[str]) -> list[str]:
    """The module's import statements, cut down to the names in used, in the module's groups
    (a blank line between two groups)."""
    kept, last = [], None
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            node.names = [a for a in node.names if (a.asname or a.name.split(".")[0]) in used]
        if node.names:
            if kept and node.lineno > last + 1:
                kept.append("\n")
            kept.append(ast.unparse(node) + "\n")
        last = node.end_lineno
    return kept


def _own_names(tree: ast.Module, used: set[str], wanted: set[str]) -> list[str]:
    """The module's own top-level names (functions, classes, constants) that the wanted ones
    use."""
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    return sorted((defined & used) - wanted)


def _header(exercises: list[Exercise], workspace: Path) -> list[str]:
    from snippets.exercises.gang import STUCK_AFTER_S  # imports torch: only `stubs --empty` needs it

    lines = ['"""']
    for ex in exercises:
        names = ", ".join(ex.empty)
        lines += [f"Exercise {ex.number}, the empty-file variant: write {names}, from the "
                  f"interface below.",
                  f"    check:  python -m snippets.exercises check {ex.number} --workspace "
                  f"{workspace}",
                  f"    hints:  python -m snippets.exercises hints {ex.number} (written for the "
                  "ordinary stub,",
                  "            they may name the solution's own attributes)",
                  ""]
    lines += ["The signatures and docstrings are the contract: the check uses the names below as",
              "they promise, and any helper you add is yours to name. The imports are those of",
              "the course's solution. Where a check runs your code on several gloo processes,",
              f"a gang in which no rank computes for {STUCK_AFTER_S:g} s is reported as a deadlock, with",
              "the line each rank waits at; a slow rank that still computes is given its time.",
              '"""']
    return [line + "\n" for line in lines]


def empty_stub(file: str, workspace: Path) -> str:
    """The empty-file variant of file: a header, the imports, and the interfaces of its
    exercises' `empty` names, in the order of the module; workspace goes into the commands."""
    exercises = empty_exercises(file)
    if not exercises:
        raise ValueError(f"no exercise of {file} has an empty-file variant")
    source = (exercises[0].solution_path).read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    number = {name: ex.number for ex in exercises for name in ex.empty}
    nodes = [n for n in tree.body if getattr(n, "name", None) in number]
    missing = set(number) - {n.name for n in nodes}
    if missing:
        raise ValueError(f"{file} has no top-level {', '.join(sorted(missing))}")
    used = set().union(*(_used_names(n) for n in nodes))
    imports = _imports(tree, used)
    own = _own_names(tree, used, set(number))
    if own:
        module = file.removesuffix(".py").replace("/", ".")
        imports += ["\n", f"from {module} import {', '.join(own)}\n"]
    out = _header(exercises, workspace) + (["\n", *imports] if imports else [])
    for node in nodes:
        out += ["\n", "\n", *_interface_of(node, lines, number[node.name])]
    return "".join(out)


def write_empty(exercise: Exercise, out: Path, force: bool = False) -> Written:
    """Write the empty-file variant of exercise's file to out/empty/<file>, by write_stub's
    rule: a file holding the learner's work is never overwritten without force."""
    workspace = out / "empty"
    numbers = [ex.number for ex in empty_exercises(exercise.file)]
    return write_stub(workspace / exercise.file, empty_stub(exercise.file, workspace), numbers,
                      force)
