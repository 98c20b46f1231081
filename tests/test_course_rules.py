"""The course's rule for `snippets/scratch/`: only torch.distributed primitives, never the library
class a lesson re-implements (DESIGN.md, "The literate-code contract", rule 5)."""

import ast
import re

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.kernel_independent("the source of snippets/scratch/: which names it uses")

FORBIDDEN = {
    "DistributedDataParallel": "re-implemented by snippets/scratch/ddp.py",
    "FullyShardedDataParallel": "re-implemented by snippets/scratch/zero.py",
    "fully_shard": "re-implemented by snippets/scratch/zero.py",
    "ZeroRedundancyOptimizer": "re-implemented by snippets/scratch/zero.py",
    "DTensor": "re-implemented by snippets/scratch/tensor_parallel.py",
    "distribute_tensor": "re-implemented by snippets/scratch/tensor_parallel.py",
    "parallelize_module": "re-implemented by snippets/scratch/tensor_parallel.py",
    "torch.distributed.fsdp": "re-implemented by snippets/scratch/zero.py",
    "torch.distributed.tensor": "re-implemented by snippets/scratch/tensor_parallel.py",
    "torch.distributed.pipelining": "re-implemented by snippets/scratch/pipeline.py",
    "torch.distributed.optim": "re-implemented by snippets/scratch/zero.py",
    "torch.nn.parallel": "re-implemented by snippets/scratch/ddp.py",
}


def violations(source: str) -> list[str]:
    """Names and modules from FORBIDDEN that the code imports or refers to."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            names += [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr, ast.unparse(node)]
        elif isinstance(node, ast.Name):
            names = [node.id]
        for name in names:
            for bad in FORBIDDEN:
                if name == bad or name.startswith(bad + "."):
                    found.append(f"line {node.lineno}: {name} ({FORBIDDEN[bad]})")
    return found


def test_the_checker_catches_library_classes():
    assert violations("from torch.nn.parallel import DistributedDataParallel as DDP")
    assert violations("import torch\nm = torch.nn.parallel.DistributedDataParallel(m)")
    assert violations("from torch.distributed.fsdp import fully_shard")
    assert violations("from torch.distributed.pipelining import ScheduleGPipe")
    assert not violations("import torch.distributed as dist\ndist.all_reduce(t)\ndist.send(t, 1)")


def test_scratch_uses_only_distributed_primitives():
    scratch = sorted((ROOT / "snippets" / "scratch").glob("*.py"))
    problems = {
        str(path.relative_to(ROOT)): v for path in scratch if (v := violations(path.read_text()))
    }
    assert not problems, f"snippets/scratch/ must use torch.distributed primitives only: {problems}"


def test_scratch_does_not_even_name_the_library_classes():
    # Stricter than the import check: a docstring that names the class invites copying it, and
    # a reader skimming the file should not have to work out that it is only mentioned.
    named = [f"{path.relative_to(ROOT)}:{n}: {bad}"
             for path in sorted((ROOT / "snippets" / "scratch").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for bad in FORBIDDEN if bad in line]
    assert not named, "\n".join(named)


# ---------------------------------------------------------------- layout (issue 13)

# What snippets/scratch/ may import from the course's own package: the parts below it. The
# planner (a cost model), bench (measurements against it), training, library and the rest sit
# above it and may import scratch, never the other way round (README, "Contributing").
SCRATCH_MAY_IMPORT = ("snippets.scratch", "snippets.models", "snippets.data", "snippets.dist",
                      "snippets.flags")


def upward_imports(source: str) -> list[str]:
    """The snippets.* modules the code imports, anywhere in it (inside functions too), that are
    not in SCRATCH_MAY_IMPORT."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "snippets":  # from snippets import planner
                modules = [f"snippets.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: from .x import y, from .. import z
            modules = [f"(relative, level {node.level}) {node.module or ''}"]
        else:
            continue
        for module in modules:
            if module.startswith("(relative") or module == "snippets" or (
                    module.startswith("snippets.")
                    and not any(module == ok or module.startswith(ok + ".")
                                for ok in SCRATCH_MAY_IMPORT)):
                found.append(f"line {node.lineno}: {module}")
    return found


def test_the_import_checker_catches_upward_imports():
    assert upward_imports("from snippets.planner.cost_model import MODELS")
    assert upward_imports("def f():\n    from snippets.bench.zero_accounting import x")
    assert upward_imports("import snippets.training.trainer")
    assert upward_imports("from snippets import planner")
    assert upward_imports("from . import zero")
    assert not upward_imports("from snippets.scratch.ddp import make_buckets\n"
                              "import snippets.models.gpt\nfrom snippets.dist import spawn\n"
                              "from snippets.flags import Parser\nimport torch")


def test_scratch_imports_point_down():
    problems = {str(path.relative_to(ROOT)): found
                for path in sorted((ROOT / "snippets" / "scratch").glob("*.py"))
                if (found := upward_imports(path.read_text()))}
    assert not problems, (f"snippets/scratch/ imports only {', '.join(SCRATCH_MAY_IMPORT)}; "
                          f"move what it needs down, or the code that needs it up: {problems}")


def test_no_snippets_module_imports_one_that_imports_it_back():
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "snippets").rglob("*.py")}
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions count too
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
        imports[name] = {m for m in found if m in modules and m not in (name, "snippets")}

    def reaches(start, goal, seen):
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen))
                   for m in imports[start])

    cycles = sorted(f"{a} -> {b} -> ... -> {a}" for a in imports for b in imports[a]
                    if reaches(b, a, set()))
    assert not cycles, "\n".join(cycles)


# ---------------------------------------------------------------- layout (issue 32, "One trainer")

# snippets/training/ is the trainer core. What a page runs to teach something (scripts/), what a
# learner points at their own runs (tools/) and the workshop's labs (labs/) have folders of their
# own and call the core; the trainer with Accelerate is in library/ (README, "Contributing").
TRAINER_CORE = {"__init__", "checkpoint", "ddp_trainer", "fsdp_trainer", "optim", "parallel_trainer"}
CALLERS_OF_THE_CORE = ("scripts", "tools", "labs")


def snippets_imports(source: str) -> set[str]:
    """The snippets.* modules and packages the code imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return {module for module in found if module.startswith("snippets.")}


def test_training_holds_only_the_trainer_core():
    found = {path.stem for path in (ROOT / "snippets" / "training").glob("*.py")}
    assert found == TRAINER_CORE, (
        f"snippets/training/ holds the trainer core only; by role, {sorted(found - TRAINER_CORE)} "
        f"belong in snippets/scripts/, tools/, labs/ or library/")


def test_each_role_folder_is_a_package_that_says_what_belongs_in_it():
    for folder in ("training", *CALLERS_OF_THE_CORE):
        init = ROOT / "snippets" / folder / "__init__.py"
        assert init.is_file(), f"{init} is missing: pyproject finds packages by their __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_each_script_tool_and_lab_runs_on_its_own():
    not_runnable = [str(path.relative_to(ROOT)) for folder in CALLERS_OF_THE_CORE
                    for path in sorted((ROOT / "snippets" / folder).glob("*.py"))
                    if path.name != "__init__.py"
                    and 'if __name__ == "__main__":' not in path.read_text()]
    assert not not_runnable, not_runnable


def test_the_trainer_core_imports_no_script_tool_or_lab():
    callers = tuple(f"snippets.{folder}" for folder in CALLERS_OF_THE_CORE)
    problems = {path.name: sorted(m for m in snippets_imports(path.read_text())
                                  if m.startswith(callers))
                for path in sorted((ROOT / "snippets" / "training").glob("*.py"))}
    problems = {name: found for name, found in problems.items() if found}
    assert not problems, f"the scripts, tools and labs call the core, not the other way: {problems}"


def test_the_layout_checker_sees_an_import_of_a_script():
    assert "snippets.scripts.profile_step" in snippets_imports(
        "def f():\n    from snippets.scripts.profile_step import build")
    assert "snippets.labs.lab1_sweep" in snippets_imports("from snippets.labs import lab1_sweep")


# ------------------------------------------------- the loop, written once (issue 32)

LOOP_CHECKS = ("snippets/bench/", "snippets/figures/", "snippets/debugging/",
               "snippets/exercises/checks/")


def has_training_loop(source: str) -> bool:
    """A module that calls .backward() and .step(): a forward/backward/step loop (docstrings
    and comments do not count)."""
    calls = [node.func.attr for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    return "backward" in calls and "step" in calls


def test_the_training_loop_is_written_once_and_every_other_loop_is_listed():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"`(snippets/[\w/]+\.py)`", readme.split(
        "Where a training loop is written")[1].split("How `snippets/scratch/` is laid out")[0]))
    found = {str(path.relative_to(ROOT)) for path in sorted((ROOT / "snippets").rglob("*.py"))
             if has_training_loop(path.read_text())}
    core = {f for f in found if f.startswith("snippets/training/")}
    assert core == {"snippets/training/ddp_trainer.py"}, core
    checks = {f for f in found if f.startswith(LOOP_CHECKS) or f.endswith("_check.py")
              or f == "snippets/scratch/reference.py"}
    unlisted = found - core - checks - listed
    assert not unlisted, f"a training loop outside the trainer core, not listed in README: {unlisted}"
    assert not listed - found - core, f"listed in README but no loop there: {listed - found}"


def test_the_loop_detector_sees_a_loop_and_ignores_a_docstring():
    assert has_training_loop("def f(m, o):\n    m().backward()\n    o.step()\n")
    assert not has_training_loop('"""loss.backward(); optimizer.step()"""\n')
