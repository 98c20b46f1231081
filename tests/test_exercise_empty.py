"""The empty-file variant of an exercise (`stubs --empty N`): the interface alone, cut out of the
solution, and graded by the same check as the ordinary stub."""

import ast

import pytest

from snippets.exercises import catalog
from snippets.exercises.__main__ import main
from snippets.exercises.empty import empty_stub
from snippets.exercises.runner import load_learner_module, run_check

EMPTY = [ex for ex in catalog.EXERCISES if ex.empty]
TEXT_ONLY = pytest.mark.kernel_independent("the text of the generated file, and statuses")


def test_the_variants_on_offer():
    assert {ex.number: ex.empty for ex in EMPTY} == {
        16: ("ring_all_reduce",), 18: ("one_f_one_b_schedule",), 20: ("OverlappedDDP",),
        21: ("ZeRO1Optimizer",)}


def top_level(source: str, name: str):
    return next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)


def is_public(node) -> bool:
    return not node.name.startswith("_") or node.name.endswith("__")


def body_lines(node, source: str) -> set[str]:
    """Every line of the bodies of node's functions (docstrings left out), stripped."""
    lines = set()
    for f in ast.walk(node):
        if isinstance(f, ast.FunctionDef):
            body = f.body[1:] if ast.get_docstring(f) else f.body
            lines |= {line.strip() for s in body
                      for line in ast.get_source_segment(source, s).splitlines()}
    return {line for line in lines if len(line) >= 12}


def same_signature(got, want) -> None:
    assert ast.dump(got.args) == ast.dump(want.args), want.name
    assert ast.dump(got.returns or ast.Pass()) == ast.dump(want.returns or ast.Pass())
    assert [ast.unparse(d) for d in got.decorator_list] == [ast.unparse(d) for d in
                                                           want.decorator_list]
    assert ast.get_docstring(want), f"{want.name} has no docstring to be its contract"
    assert ast.get_docstring(got) == ast.get_docstring(want), want.name
    assert len(got.body) == 2 and isinstance(got.body[1], ast.Raise), want.name


@TEXT_ONLY
@pytest.mark.parametrize("ex", EMPTY, ids=lambda e: f"exercise-{e.number}")
def test_the_empty_file_is_the_interface_and_none_of_the_body(ex, tmp_path):
    solution = ex.solution_path.read_text()
    stub = empty_stub(ex.file, tmp_path)
    for name in ex.empty:
        want, got = top_level(solution, name), top_level(stub, name)
        if isinstance(want, ast.FunctionDef):
            same_signature(got, want)
        else:
            assert [ast.dump(b) for b in got.bases] == [ast.dump(b) for b in want.bases]
            assert ast.get_docstring(got) == ast.get_docstring(want)
            methods = {m.name: m for m in want.body if isinstance(m, ast.FunctionDef)}
            kept = {m.name: m for m in got.body if isinstance(m, ast.FunctionDef)}
            assert sorted(kept) == sorted(n for n, m in methods.items() if is_public(m))
            for method in kept.values():
                same_signature(method, methods[method.name])
        given = [line for line in body_lines(want, solution) if line in stub]
        assert not given, f"the empty file of exercise {ex.number} holds solution lines {given}"
    path = tmp_path / "learner.py"
    path.write_text(stub)
    module = load_learner_module(path)  # its imports are enough to define the interface
    assert all(callable(getattr(module, name)) for name in ex.empty)


@TEXT_ONLY
def test_stubs_empty_writes_the_file_and_never_overwrites_work(tmp_path, capsys):
    ex = catalog.get(16)
    target = tmp_path / "empty" / ex.file
    assert main(["stubs", "--empty", "16", "--out", str(tmp_path)]) == 0
    assert f"wrote {target} (exercise 16)" in capsys.readouterr().out
    assert target.read_text() == empty_stub(ex.file, tmp_path / "empty")
    assert main(["check", "16", "--workspace", str(tmp_path / "empty")]) == 1
    line = next(n for n, text in enumerate(target.read_text().splitlines(), 1)
                if "raise NotImplementedError" in text)
    assert f"not started yet: edit {target} at line {line}" in capsys.readouterr().out

    mine = target.read_text().replace("raise NotImplementedError", "return tensor  #", 1)
    target.write_text(mine)
    assert main(["stubs", "--empty", "16", "--out", str(tmp_path)]) == 0
    assert f"skipped {target}" in capsys.readouterr().out
    assert target.read_text() == mine
    with pytest.raises(SystemExit, match="exercise 17 has no empty-file variant; these have "
                                         "one: 16, 18, 20, 21"):
        main(["stubs", "--empty", "17", "--out", str(tmp_path)])


def pasted_back(stub: str, solution: str, names) -> str:
    """stub with the interface of each of names replaced by the solution's whole definition."""
    lines, source = stub.splitlines(keepends=True), solution.splitlines(keepends=True)
    # from the bottom up, so that the line numbers of those above stay right
    for got in sorted((top_level(stub, name) for name in names), key=lambda n: -n.lineno):
        want = top_level(solution, got.name)
        first = min([d.lineno for d in got.decorator_list] + [got.lineno])
        start = min([d.lineno for d in want.decorator_list] + [want.lineno])
        lines[first - 1:got.end_lineno] = source[start - 1:want.end_lineno]
    return "".join(lines)


@pytest.mark.parametrize("ex", EMPTY, ids=lambda e: f"exercise-{e.number}")
def test_the_same_check_grades_the_empty_file(ex, tmp_path):
    workspace = tmp_path / "empty"
    target = workspace / ex.file
    target.parent.mkdir(parents=True)
    stub = empty_stub(ex.file, workspace)
    target.write_text(stub)
    assert run_check(ex, workspace).status == "not started"
    target.write_text(pasted_back(stub, ex.solution_path.read_text(), ex.empty))
    result = run_check(ex, workspace)
    assert result.ok, result.message
