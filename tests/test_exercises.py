"""The exercises: stubs are the solutions minus exactly the exercise sections, every check passes
on the solutions, and each check fails, with its explanation, on a typical wrong answer."""

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from snippets.exercises import catalog
from snippets.exercises.runner import run_check, solutions_workspace
from snippets.exercises.stubs import (
    MARKER,
    exercises_by_file,
    make_stub,
    stub_for,
    write_stubs,
)

ROOT = Path(__file__).resolve().parents[1]
AVAILABLE = [ex for ex in catalog.EXERCISES if ex.available]


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snippets.exercises", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def outside_sections(text: str, sections: set[str]) -> list[str]:
    """The lines of text outside the given sections (marker lines included)."""
    kept, inside = [], None
    for line in text.splitlines(keepends=True):
        m = MARKER.match(line)
        if inside is None:
            kept.append(line)
            if m and m["kind"] == "start" and m["name"] in sections:
                inside = m["name"]
        elif m and m["kind"] == "end" and m["name"] == inside:
            kept.append(line)
            inside = None
    return kept


def blanked_bodies(source: str, names) -> dict[str, list]:
    """The statements (docstring left out) of the functions called names (`f`, `Class.f`)."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if name in names:
                    body = child.body
                    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                        body = body[1:]
                    found[name] = body
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def workspace_with(tmp_path: Path, replacements: dict[str, str], stubbed: set[int] = frozenset()):
    """A workspace holding a copy of each exercise file: the solution, with the named sections'
    bodies replaced (code dedented, then indented like the section's marker) and the exercises
    in `stubbed` turned back into stubs."""
    for file, exercises in exercises_by_file().items():
        source = make_stub((ROOT / file).read_text(),
                           [e for e in exercises if e.number in stubbed])
        out, inside = [], None
        for line in source.splitlines(keepends=True):
            m = MARKER.match(line)
            if inside is None:
                out.append(line)
                if m and m["kind"] == "start" and m["name"] in replacements:
                    inside = m["name"]
                    body = textwrap.dedent(replacements[inside]).strip("\n")
                    out += [m["indent"] + code + "\n" for code in body.splitlines()]
            elif m and m["kind"] == "end" and m["name"] == inside:
                out.append(line)
                inside = None
        target = tmp_path / file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(out))
    for number, given in RIGHT_PREDICTIONS.items():  # exercises 12-14 measure nothing without
        (tmp_path / f"predictions-{number}.json").write_text(json.dumps(given))
    return tmp_path


# What the checks of exercises 12-14 measure on the solutions (docs/exercises/phase-3.md), as a
# learner would predict it: every workspace here has predicted right, unless a test says not.
_UNITS = {"all_gathers_per_forward": 3, "peak_percent_whole": 57}
RIGHT_PREDICTIONS = {
    12: {"FULL_SHARD": {"stored_percent": 50, "held_percent": 57, "forward_all_gathers": 3,
                        "backward_all_gathers": 2},
         "SHARD_GRAD_OP": {"stored_percent": 50, "held_percent": 100, "forward_all_gathers": 3,
                           "backward_all_gathers": 0},
         "NO_SHARD": {"stored_percent": 100, "held_percent": 100, "forward_all_gathers": 0,
                      "backward_all_gathers": 0}},
    13: {"fp32": {"forward_all_gather_bytes": 462_080, "backward_reduce_scatter_bytes": 462_080,
                  "loss_dtype": "float32"},
         "bf16": {"forward_all_gather_bytes": 231_040, "backward_reduce_scatter_bytes": 462_080,
                  "loss_dtype": "fp32", "block_on_fp32_activations": "torch.bfloat16"}},
    14: {"model_alone": {"all_gathers_per_forward": 1, "peak_percent_whole": 100},
         "blocks_then_model": _UNITS},
}


# ---------------------------------------------------------------- the catalogue and the stubs


def test_catalogue_lists_every_exercise_of_the_guide_once():
    assert [e.number for e in catalog.EXERCISES] == list(range(1, 28))
    assert {e.number for e in AVAILABLE} >= set(range(1, 8))
    for ex in catalog.EXERCISES:
        assert ex.title and ex.concept and ex.difficulty and ex.task
        assert all(d < ex.number for d in ex.depends_on)
        if ex.available:
            assert ex.hints, f"exercise {ex.number} has no hints"
        else:
            assert ex.arrives_with, f"exercise {ex.number} does not say when it arrives"


def test_every_exercise_has_one_check_file_and_every_check_file_an_exercise():
    # checks/exNN_<what>.py is exercise NN's check, found by the number; `_`-files are shared.
    files = sorted(p.name for p in catalog.CHECKS_DIR.glob("*.py") if not p.name.startswith("_"))
    for ex in catalog.EXERCISES:
        path = ex.check_path
        assert path is not None, (f"exercise {ex.number}: not exactly one "
                                  f"checks/ex{ex.number:02d}_*.py")
        assert f"\ndef {ex.check}(" in path.read_text(), f"{path.name} has no {ex.check}"
    assert files == sorted(ex.check_path.name for ex in catalog.EXERCISES)


@pytest.mark.parametrize("file", sorted(exercises_by_file()))
def test_stub_is_valid_python_and_differs_only_in_the_exercise_sections(file):
    exercises = exercises_by_file()[file]
    solution = (ROOT / file).read_text()
    stub = stub_for(file)
    compile(stub, file, "exec")
    sections = {s for e in exercises for s in e.sections}
    assert outside_sections(stub, sections) == outside_sections(solution, sections)
    raises = "raise NotImplementedError(\n"
    assert stub.count(raises) - solution.count(raises) == sum(len(e.blank) or len(e.sections)
                                                              for e in exercises)
    for ex in exercises:
        assert f'"Exercise {ex.number}: {ex.title}. ' in stub
        assert f"# TODO(exercise {ex.number}): " in stub
        assert f"python -m snippets.exercises check {ex.number}\")" in stub
        # the whole message, its literals joined: where to start and how to get a hint, never
        # the hints themselves
        assert (f"Exercise {ex.number}: {ex.title}. Start from the TODO above; python -m "
                f"snippets.exercises hints {ex.number} gives a hint, the next one each time you "
                f"run it. Check with: python -m snippets.exercises check {ex.number}\")"
                in re.sub(r'"\n\s*"', "", stub)), ex.number
    assert "Hints:" not in stub
    # nothing of a solution body survives in its section (or, for an exercise that blanks
    # functions, in those functions: only their signature and docstring are left)
    for ex in exercises:
        if ex.blank:
            bodies = blanked_bodies(stub, ex.blank)
            assert set(bodies) == set(ex.blank)
            for name, body in bodies.items():
                assert [type(node) for node in body] == [ast.Raise], (name, body)
            continue
        for section in ex.sections:
            body = re.search(rf"\[start:{section}\]\n(.*?)\n[ \t]*# --8<-- \[end:{section}\]",
                             stub, re.S)[1]
            assert all(line.lstrip().startswith(("#", "raise", '"')) for line in
                       body.splitlines()), body


def test_stubs_never_overwrite_edited_files_without_force(tmp_path):
    first = write_stubs(tmp_path)
    assert {w.action for w in first} == {"wrote"}
    again = write_stubs(tmp_path)
    assert {w.action for w in again} == {"unchanged"}
    gpt = tmp_path / catalog.GPT_FILE
    edited = gpt.read_text().replace("# TODO(exercise 1)", "return x  # mine; TODO(exercise 1)", 1)
    gpt.write_text(edited)

    result = cli("stubs", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"skipped {gpt}" in result.stdout and "--force" in result.stdout
    assert gpt.read_text() == edited

    replaced = {w.path: w for w in write_stubs(tmp_path, force=True)}[gpt]
    assert replaced.action == "replaced"
    assert gpt.read_text() == stub_for(catalog.GPT_FILE)
    assert replaced.backup.read_text() == edited  # --force still keeps the learner's work
    gpt.write_text(edited + "# more work\n")
    again = {w.path: w for w in write_stubs(tmp_path, force=True)}[gpt]
    assert again.backup.name == "gpt.py.bak.2" and replaced.backup.read_text() == edited


def solution_statements(ex) -> list[str]:
    """The lines of ex's solution (the bodies of its `blank` functions, or its sections), with
    comments and whitespace taken out."""
    source = ex.solution_path.read_text()
    if ex.blank:
        lines = [line for body in blanked_bodies(source, ex.blank).values() for node in body
                 for line in ast.get_source_segment(source, node).splitlines()]
    else:
        lines = [line for section in ex.sections for line in re.search(
            rf"\[start:{section}\]\n(.*?)\n[ \t]*# --8<-- \[end:{section}\]", source, re.S)[1]
            .splitlines()]
    return [re.sub(r"\s+", "", line.split("#")[0]) for line in lines]


def lines_given_away(ex, hint: str) -> list[str]:
    """The lines of ex's solution that hint spells out. Short lines (`self.step += 1`, an API
    call named by its name) are fair to mention: only lines of 24 characters or more, spaces
    left out, count as code given away."""
    code = [line for line in solution_statements(ex) if len(line) >= 24]
    return [line for line in code if line in re.sub(r"\s+", "", hint)]


def test_no_hint_is_the_solutions_code():
    # A hint guides; it never hands out a line of the solution.
    for ex in AVAILABLE:
        for number, hint in enumerate(ex.hints, 1):
            given = lines_given_away(ex, hint)
            assert not given, f"exercise {ex.number}'s hint {number} is the solution's {given}"


def hints_boxes(text: str) -> dict[int, str]:
    """The `??? tip "Hints"` box of each `## Exercise N.` section of a page, as text."""
    boxes, number, box = {}, None, None
    for line in text.splitlines():
        heading = re.match(r"## Exercise (\d+)\.", line)
        if heading:
            number = int(heading[1])
        if line.startswith('??? tip "Hints"'):
            box = boxes.setdefault(number, [])
        elif box is not None and (line.startswith("    ") or not line.strip()):
            box.append(line.strip())
        else:
            box = None
    return {n: "\n".join(lines).strip() for n, lines in boxes.items()}


# What makes a code span a computation rather than a name: arithmetic between two operands
# (`warmup + i`, not `dim=-1`), a slice, or a loop.
COMPUTATION = re.compile(r"[\w)\]]\s*[-+*/%]\s*[\w(]|\[[^\]]*:|\bfor\b")


def expressions_given_away(ex, box: str) -> list[str]:
    """The code spans of box that are computations of ex's solution, 14 characters or more
    (spaces left out). A name, or a call with its arguments (`x.chunk(2, dim=-1)`), is fair to
    mention, as in the catalog's hints."""
    code = solution_statements(ex)
    spans = [span for span in re.findall(r"`([^`]+)`", box) if COMPUTATION.search(span)]
    compact = [re.sub(r"\s+", "", span) for span in spans]
    return [span for span in compact if len(span) >= 14 and any(span in line for line in code)]


def test_no_hints_box_on_the_pages_is_the_solutions_code():
    # The phase pages' handwritten Hints boxes follow the catalog's rule, and may not hand out
    # an expression of the solution in a code span either (1F1B's `("F", warmup + i)`).
    boxes = {}
    for page in sorted((ROOT / "docs" / "exercises").glob("phase-*.md")):
        boxes |= hints_boxes(page.read_text())
    assert sorted(boxes) == [ex.number for ex in AVAILABLE]
    for ex in AVAILABLE:
        given = lines_given_away(ex, boxes[ex.number])
        given += expressions_given_away(ex, boxes[ex.number])
        assert not given, f"exercise {ex.number}'s Hints box spells out the solution's {given}"


def hints(capsys, *args) -> str:
    from snippets.exercises.__main__ import main

    assert main(["hints", *map(str, args)]) == 0
    return capsys.readouterr().out


def test_hints_come_one_at_a_time_and_the_count_is_kept_in_the_workspace(tmp_path, capsys):
    ex, where = catalog.get(2), ("--workspace", tmp_path)
    again = f"python -m snippets.exercises hints 2 --workspace {tmp_path}"
    (tmp_path / "notes.txt").write_text("mine")
    first = hints(capsys, 2, *where)
    assert first.startswith(f"Exercise 2: rotate_half ({catalog.GPT_FILE})\n")
    assert f"  task:       {ex.task}\n" in first
    assert f"  hint 1 of 3: {ex.hints[0]}\nnext hint: {again}\n" in first
    assert ex.hints[1] not in first
    assert hints(capsys, 2, *where) == f"Exercise 2, hint 2 of 3: {ex.hints[1]}\nnext hint: {again}\n"
    assert hints(capsys, 2, *where) == (f"Exercise 2, hint 3 of 3: {ex.hints[2]}\n"
                                        f"that was the last hint; {again} --all shows them all\n")
    assert hints(capsys, 2, *where).startswith("Exercise 2: no more hints, you have seen all 3. ")
    every = hints(capsys, 2, "--all", *where)  # every hint, and the count stays where it is
    assert all(f"    {i}. {hint}\n" in every for i, hint in enumerate(ex.hints, 1))
    assert "no more hints" in hints(capsys, 2, *where)
    assert hints(capsys, 2, "--reset", *where) == first
    assert "hint 1 of 4: " in hints(capsys, 1, *where)  # each exercise counts on its own
    # one file written whole (no temporary left behind), and the learner's own file untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [".exercise-hints.json", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_damaged_hints_file_is_reported_and_kept(tmp_path):
    from snippets.exercises.__main__ import main

    (tmp_path / ".exercise-hints.json").write_text("{half a")
    with pytest.raises(SystemExit, match="is not a hints progress file"):
        main(["hints", "2", "--workspace", str(tmp_path)])
    assert (tmp_path / ".exercise-hints.json").read_text() == "{half a"


# ---------------------------------------------------------------- checks accept correct code


# Every check once, here, on the solutions (the checks of exercises 12, 15, 16 and 19-27 start
# processes). The phase-3 page shows each report as `check 12-15` prints it, in a text block
# checked here rather than by running the command a second time (phase 4 runs its `check 16-27`
# as an expected-output block); `check all --solutions` runs on docs/exercises/index.md, the
# CLI's table checked there.
def phase_3_page() -> str:
    """docs/exercises/phase-3.md with the collapsed boxes' 4-space indent removed: the measured
    reports sit inside them, after the predictions they answer."""
    text = (ROOT / "docs" / "exercises" / "phase-3.md").read_text()
    return "\n".join(line.removeprefix("    ") for line in text.splitlines())


@pytest.mark.parametrize("ex", AVAILABLE, ids=lambda e: f"exercise-{e.number}")
def test_every_check_passes_on_the_solutions(ex):
    from snippets.exercises.__main__ import _report

    result = run_check(ex, solutions_workspace())
    assert result.ok, result.message
    assert result.passed
    if ex.phase == 3:
        assert "\n" + _report(result) + "\n" in phase_3_page(), _report(result)


def test_cli_check_on_the_solutions_and_on_fresh_stubs(tmp_path):
    solutions = cli("check", "1-2", "--workspace", ".")
    assert solutions.returncode == 0, solutions.stdout + solutions.stderr
    assert solutions.stdout.startswith("Exercise 1, RMSNorm.forward: PASS\n"), solutions.stdout
    assert "Exercise 2, rotate_half: PASS\n" in solutions.stdout, solutions.stdout

    write_stubs(tmp_path)
    fresh = cli("check", "2", "--workspace", str(tmp_path))
    assert fresh.returncode == 1
    line = next(n for n, text in enumerate(stub_for(catalog.GPT_FILE).splitlines(), 1)
                if text.startswith("    # TODO(exercise 2): "))
    assert (f"not started yet: edit {tmp_path / catalog.GPT_FILE} at line {line}"
            in fresh.stdout)


# ---------------------------------------------------------------- checks reject wrong code

WRONG = {
    # exercise: (section, wrong body, part of the explanation the learner must see)
    "rmsnorm-no-rsqrt": (1, "exercise-1",
                         "return x * x.pow(2).mean(-1, keepdim=True) * self.weight",
                         "expected 1.0 with weight=1: did you divide by the root mean square"),
    "rmsnorm-layernorm": (1, "exercise-1", """
        xc = x - x.mean(-1, keepdim=True)
        return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        """, "that is LayerNorm"),
    "rmsnorm-no-weight": (1, "exercise-1",
                          "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)",
                          "ignores self.weight"),
    "rmsnorm-guide-one-liner": (1, "exercise-1",
                                "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + "
                                "self.eps) * self.weight",
                                "cast back with out.to(x.dtype)"),
    "rotate-half-no-negation": (2, "exercise-2", """
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x2, x1), dim=-1)
        """, "returned [3, 4, 1, 2]; expected [-3, -4, 1, 2]: you swapped the halves but forgot "
             "the sign"),
    "rotate-half-wrong-half": (2, "exercise-2", """
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x2, -x1), dim=-1)
        """, "rotate_half([1, 2, 3, 4]) returned [3, 4, -1, -2]; expected [-3, -4, 1, 2]: the "
             "first half of the output must be the NEGATED second half of the input"),
    "rotate-half-first-dim": (2, "exercise-2", """
        x1, x2 = x.chunk(2, dim=0)
        return torch.cat((-x2, x1), dim=0)
        """, "along the LAST dimension"),
    "rope-minus-sin": (3, "exercise-3",
                       "return q * cos - rotate_half(q) * sin, k * cos - rotate_half(k) * sin",
                       "rotates the wrong way"),
    "rope-k-unrotated": (3, "exercise-3", "return q * cos + rotate_half(q) * sin, k",
                         "your rotated k is k unchanged"),
    "mlp-gelu": (4, "exercise-4",
                 "return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))",
                 "you used GELU; SwiGLU gates with SiLU"),
    "mlp-silu-on-up": (4, "exercise-4",
                       "return self.down_proj(self.gate_proj(x) * F.silu(self.up_proj(x)))",
                       "SiLU goes on gate_proj(x)"),
    "attention-no-mask": (5, "exercise-5", """
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        y = torch.softmax(scores, dim=-1) @ v
        """, "your attention leaks the future: changing token 5 changed the output at position 0:"
             " apply the causal mask before softmax"),
    "attention-mask-zero": (5, "exercise-5", """
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        y = torch.softmax(scores.masked_fill(~causal, 0.0), dim=-1) @ v
        """, "exp(0) = 1 still gives them weight"),
    "attention-no-scale": (5, "exercise-5", """
        scores = q @ k.transpose(-2, -1)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        y = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        """, "divide q @ k^T by math.sqrt(self.head_dim)"),
    "attention-mask-after-softmax": (5, "exercise-5", """
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        y = (torch.softmax(scores, dim=-1) * causal) @ v
        """, "you masked after the softmax"),
    "init-no-residual-scaling": (6, "exercise-6", """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        """, "layers.0.self_attn.o_proj.weight has std 0.020"),
    "init-embedding-untouched": (6, "exercise-6", """
        if isinstance(module, nn.Linear):
            std = self.config.initializer_range
            if getattr(module, "is_residual_output", False):
                std = std / math.sqrt(2 * self.config.num_hidden_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        """, "embed_tokens.weight has std 1.00"),
    "forward-no-final-norm": (7, "exercise-7", """
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
        """, "you skipped the final norm"),
    "forward-shifts-again": (7, "exercise-7", """
        x = self.norm(self.layers[1](self.layers[0](self.embed_tokens(input_ids))))
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1))
        return logits, loss
        """, "you shifted the targets again"),
    "forward-no-checkpointing": (7, "exercise-7", """
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
        """, "checkpoint() ran 0 times for 2 blocks"),
}

TRAINER_WRONG = {
    "optimizer-decays-everything": (8, "exercise-8", """
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        """, "(1-D: an RMSNorm gain) has weight_decay 0.05, expected 0.0"),
    "optimizer-adam": (8, "exercise-8", """
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.Adam([{"params": decay, "weight_decay": 0.05},
                                 {"params": rest, "weight_decay": 0.0}])
        """, "return a torch.optim.AdamW: torch.optim.Adam's weight_decay"),
    "optimizer-tied-twice": (8, "exercise-8", """
        params = [p for _, p in model.named_parameters(remove_duplicate=False)]
        return torch.optim.AdamW([
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}])
        """, "ONE Parameter under two names"),
    "lr-decays-to-zero": (9, "exercise-9", """
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) * lr
        """, "you decay to 0; the cosine ends at min_lr"),
    "lr-warmup-late": (9, "exercise-9", """
        if step < warmup_steps:
            return lr * step / warmup_steps
        if step >= max_steps:
            return min_lr
        progress = (step - warmup_steps) / (max_steps - warmup_steps)
        return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)
        """, "lr_at(0, ...) = 0, expected 0.0001"),
    "lr-linear-decay": (9, "exercise-9", """
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
        return lr - progress * (lr - min_lr)
        """, "that is a linear decay"),
    "step-no-loss-scaling": (10, "exercise-10", """
        accum = self.train_config.grad_accum_steps
        lr = self.get_lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for micro_step in range(accum):
            inputs, targets = shift_for_next_token(next(batch_iter))
            with self._grad_sync(last_micro_step=micro_step == accum - 1):
                _, loss = self.model(inputs, targets)
                loss.backward()
            losses.append(loss.item())
        clip = self.train_config.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": sum(losses) / accum, "grad_norm": grad_norm.item(), "lr": lr,
                "tokens": accum * targets.numel() * self.world_size}
        """, "divide each micro-batch's loss by grad_accum_steps before backward()"),
    "step-no-zero-grad": (10, "exercise-10", """
        accum = self.train_config.grad_accum_steps
        lr = self.get_lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for micro_step in range(accum):
            inputs, targets = shift_for_next_token(next(batch_iter))
            with self._grad_sync(last_micro_step=micro_step == accum - 1):
                _, loss = self.model(inputs, targets)
                (loss / accum).backward()
            losses.append(loss.item())
        clip = self.train_config.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.step += 1
        return {"loss": sum(losses) / accum, "grad_norm": grad_norm.item(), "lr": lr,
                "tokens": accum * targets.numel() * self.world_size}
        """, "self.optimizer.zero_grad(set_to_none=True)"),
    "step-no-clipping": (10, "exercise-10", """
        accum = self.train_config.grad_accum_steps
        lr = self.get_lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for micro_step in range(accum):
            inputs, targets = shift_for_next_token(next(batch_iter))
            with self._grad_sync(last_micro_step=micro_step == accum - 1):
                _, loss = self.model(inputs, targets)
                (loss / accum).backward()
            losses.append(loss.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": sum(losses) / accum, "grad_norm": grad_norm.item(), "lr": lr,
                "tokens": accum * targets.numel() * self.world_size}
        """, "with grad_clip=0.01 the optimizer saw gradients of norm"),
    "checkpoint-wrapped-keys": (11, "exercise-11-save", """
        return save_atomic(path, {"model": self.model.state_dict(),
                                  "optimizer": self.optimizer.state_dict(), "step": self.step,
                                  "sampler": self.sampler.state_dict()})
        """, "the saved model keys start with 'module.'"),
    "checkpoint-no-optimizer": (11, "exercise-11-save", """
        groups = self.optimizer.state_dict()["param_groups"]
        return save_atomic(path, {"model": unwrap_model(self.model).state_dict(),
                                  "step": self.step, "sampler": self.sampler.state_dict(),
                                  "optimizer": {"state": {}, "param_groups": groups},
                                  "rng": capture_rng_state(),
                                  "model_config": self.config.to_dict(),
                                  "train_config": asdict(self.train_config)})
        """, "the optimizer has no state"),
    "checkpoint-no-sampler": (11, "exercise-11-load", """
        state = load_verified(path, map_location="cpu")
        unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        return state
        """, "restore the data position"),
    "checkpoint-no-step": (11, "exercise-11-load", """
        state = load_verified(path, map_location="cpu")
        unwrap_model(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        return state
        """, "restore the step"),
}
if catalog.get(8).available:
    WRONG.update(TRAINER_WRONG)

# On the phase-3 page, and checked there (below): not in FSDP_WRONG, so it runs once.
SGO_RESHARDS = (12, "exercise-12", """
        ranks, group = self.world_size, self.shard_group_size
        layouts = {"FULL_SHARD": (1, ranks, True), "SHARD_GRAD_OP": (1, ranks, True),
                   "NO_SHARD": (ranks, 1, False), "HYBRID_SHARD": (ranks // group, group, True)}
        replicas, shards, reshard = layouts[self.fsdp_config.sharding_strategy]
        return {"mesh": self._device_mesh(replicas, shards), "reshard_after_forward": reshard}
        """, "Those are FULL_SHARD's numbers: you gave SHARD_GRAD_OP FULL_SHARD's layout")
# Exercise 13's answer, with {} standing for the policy's fields but param_dtype.
PRECISION = """
        name = self.fsdp_config.mixed_precision
        dtypes = {{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}}
        if name not in dtypes:
            raise ConfigError(f"{{name}} is not one of bf16, fp16, fp32")
        return MixedPrecisionPolicy(param_dtype=dtypes[name]{})
        """
# On the phase-3 page, and checked there (below): not in FSDP_WRONG, so it runs once.
REDUCE_IN_BF16 = (13, "exercise-13", PRECISION.format(""),
                  "bf16, measured on 2 ranks: the gradients were reduce-scattered in bfloat16, "
                  "231,040 bytes per backward where float32 moves 462,080; fp32 was asked for")
FSDP_WRONG = {
    "strategy-hybrid-swapped": (12, "exercise-12", """
        ranks, group = self.world_size, self.shard_group_size
        layouts = {"FULL_SHARD": (1, ranks, True), "SHARD_GRAD_OP": (1, ranks, False),
                   "NO_SHARD": (ranks, 1, False), "HYBRID_SHARD": (group, ranks // group, True)}
        replicas, shards, reshard = layouts[self.fsdp_config.sharding_strategy]
        return {"mesh": self._device_mesh(replicas, shards), "reshard_after_forward": reshard}
        """, "you swapped the two sizes: the mesh is (replicas, shards)"),
    "strategy-no-shard-shards": (12, "exercise-12", """
        ranks, group = self.world_size, self.shard_group_size
        layouts = {"FULL_SHARD": (1, ranks, True), "SHARD_GRAD_OP": (1, ranks, False),
                   "NO_SHARD": (1, ranks, False), "HYBRID_SHARD": (ranks // group, group, True)}
        replicas, shards, reshard = layouts[self.fsdp_config.sharding_strategy]
        return {"mesh": self._device_mesh(replicas, shards), "reshard_after_forward": reshard}
        """, "Those are SHARD_GRAD_OP's numbers: you gave NO_SHARD SHARD_GRAD_OP's layout"),
    # Exercise 13's mistakes, each one run of the check on 2 processes (its fields left at
    # their defaults but the one planted; leaving out reduce_dtype is on the page, below).
    "precision-unknown-is-fp32": (13, "exercise-13", """
        name = self.fsdp_config.mixed_precision
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        return MixedPrecisionPolicy(param_dtype=dtypes.get(name, torch.float32),
                                    reduce_dtype=torch.float32)
        """, "for mixed_precision='fp8' you returned"),
    "precision-output-in-compute-dtype": (13, "exercise-13", PRECISION.format(
        ", reduce_dtype=torch.float32, output_dtype=dtypes[name]"),
        "bf16, measured on 2 ranks: the loss came back in bfloat16 ("),
    "precision-output-fp32-everywhere": (13, "exercise-13", PRECISION.format(
        ", reduce_dtype=torch.float32, output_dtype=torch.float32"),
        "output_dtype=float32 casts the outputs of EVERY unit, each block's too"),
    "precision-inputs-not-cast": (13, "exercise-13", PRECISION.format(
        ", reduce_dtype=torch.float32, cast_forward_inputs=False"),
        "bf16, measured on 2 ranks: a block handed fp32 activations (as from any module "
        "outside the policy) gave 'expected m1 and m2 to have the same dtype"),
    "policy-no-root": (14, "exercise-14",
                       "return [m for m in model.modules() if isinstance(m, Block)]",
                       "without the model itself: embed_tokens (tied to lm_head)"),
    "policy-root-first": (14, "exercise-14",
                          "return [model, *[m for m in model.modules() if isinstance(m, Block)]]",
                          "the model comes first in your list"),
    "policy-root-only": (14, "exercise-14", "return [model]",
                         "1 unit, so 1 all-gather per forward on N ranks; measured in one "
                         "forward: at most 100% of the parameters whole at once. With no unit "
                         "per Block"),
    "policy-every-linear": (14, "exercise-14",
                            "return [m for m in model.modules() if isinstance(m, nn.Linear)]"
                            " + [model]", "Units smaller than a block"),
    "checkpoint-rank-0-shard-only": (15, "exercise-15", """
        if not self.is_main:
            return None
        shards = {name: t.to_local() for name, t in self.model.state_dict().items()}
        return save_atomic(path, {"model": shards, "step": self.step})
        """, "you saved rank 0's shard only"),
    "checkpoint-every-rank-writes": (15, "exercise-15", """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer,
                                                      options=options)
        return save_atomic(path, {"model": model_state, "optimizer": optimizer_state,
                                  "step": self.step})
        """, "rank 1 wrote the checkpoint too"),
}
if catalog.get(12).available:
    WRONG.update(FSDP_WRONG)


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
@pytest.mark.parametrize("case", sorted(WRONG))
def test_check_explains_a_wrong_implementation(case, tmp_path):
    number, section, body, explanation = WRONG[case]
    workspace = workspace_with(tmp_path, {section: body})
    result = run_check(catalog.get(number), workspace)
    assert result.status == "FAIL", result
    assert explanation in result.message, result.message


# A SHARD_GRAD_OP that reshards after forward measures as FULL_SHARD; reduce_dtype left out,
# FSDP2 reduce-scatters bf16 gradients in bf16: each measured, named, and shown on the page.
@pytest.mark.parametrize("mistake", [SGO_RESHARDS, REDUCE_IN_BF16], ids=["strategy", "precision"])
def test_the_failure_shown_on_the_fsdp_page_is_real(tmp_path, mistake):
    from snippets.exercises.__main__ import _report

    number, section, body, explanation = mistake
    result = run_check(catalog.get(number), workspace_with(tmp_path, {section: body}))
    assert result.status == "FAIL" and explanation in result.message, result.message
    assert f"```text\n{_report(result)}\n```" in phase_3_page(), _report(result)


def test_the_untouched_precision_stub_is_not_started(tmp_path):
    workspace = workspace_with(tmp_path, {}, stubbed={13})
    result = run_check(catalog.get(13), workspace)
    assert result.status == "not started", result
    assert result.message.startswith(
        f"not started yet: edit {tmp_path / catalog.FSDP_FILE} at line "), result.message


def test_a_stub_is_not_started_and_blocks_what_builds_on_it(tmp_path):
    workspace = workspace_with(tmp_path, {}, stubbed={3})
    gpt = tmp_path / catalog.GPT_FILE
    result = run_check(catalog.get(3), workspace)
    assert result.status == "not started"
    assert result.message.startswith(f"not started yet: edit {gpt} at line ")
    result = run_check(catalog.get(7), workspace)
    assert result.status == "blocked"
    assert "exercise 7 needs exercises 1-6; exercise 3 is not done yet" in result.message
    assert run_check(catalog.get(2), workspace).ok


def test_a_wrong_dependency_is_named(tmp_path):
    number, section, body, _ = WRONG["rotate-half-no-negation"]
    workspace = workspace_with(tmp_path, {section: body})
    result = run_check(catalog.get(3), workspace)
    assert result.status == "FAIL"
    assert ("exercise 3 builds on exercise 2, which does not pass its own check yet"
            in result.message)


def test_errors_in_the_learners_code_point_at_the_line(tmp_path):
    workspace = workspace_with(tmp_path, {"exercise-4": "return self.down_proj(self.gate_proj)"})
    result = run_check(catalog.get(4), workspace)
    assert result.status == "FAIL"
    assert f"at {tmp_path / catalog.GPT_FILE} line" in result.message
    workspace_with(tmp_path, {"exercise-4": "return (("})
    result = run_check(catalog.get(4), workspace)
    assert "is not valid Python" in result.message


def test_the_checked_module_is_the_learners_copy_not_the_solution(tmp_path):
    workspace = workspace_with(tmp_path, {"exercise-2": "return x"})
    assert run_check(catalog.get(2), workspace).status == "FAIL"
    import snippets.models.gpt as solution
    import torch

    assert solution.rotate_half(torch.tensor([1, 2, 3, 4])).tolist() == [-3, -4, 1, 2]


def test_the_failure_shown_on_the_exercises_page_is_real(tmp_path):
    from snippets.exercises.__main__ import _report

    number, section, body, _ = WRONG["rotate-half-no-negation"]
    report = _report(run_check(catalog.get(number), workspace_with(tmp_path, {section: body})))
    page = (ROOT / "docs" / "exercises" / "index.md").read_text()
    assert f"```text\n{report}\n```" in page, report


# ---------------------------------------------------------------- the parallelisms (16 onward)
# Their exercises blank function bodies inside larger sections (Exercise.blank); a planted
# mistake replaces the whole section, so each wrong answer is written out as the full function.

RING = '''
def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(send_index, recv_index):
        received = torch.empty_like(chunks[recv_index])
        request = dist.isend(chunks[send_index], right)
        dist.recv(received, left)
        request.wait()
        return received

    for step in range(world - 1):
        send_index, recv_index = (rank - step) % world, (rank - step - 1) % world
        chunks[recv_index] += exchange(send_index, recv_index)
    for step in range(world - 1):
        send_index, recv_index = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv_index].copy_(exchange(send_index, recv_index))
    return tensor
'''


def ring(*edits: tuple[str, str]) -> str:
    """The ring solution above with each (old, new) edit applied once."""
    code = RING
    for old, new in edits:
        assert old in code, old
        code = code.replace(old, new, 1)
    return code


PARALLEL_WRONG = {
    "ring-sends-left": (16, "ring-all-reduce", ring(
        ("right, left = (rank + 1) % world, (rank - 1) % world",
         "right, left = (rank - 1) % world, (rank + 1) % world")),
        "your ring sends to rank-1 (or counts the chunk index up, rank + step)"),
    "ring-p-steps": (16, "ring-all-reduce", ring(("for step in range(world - 1):",
                                                   "for step in range(world):")),
                     "a phase ran p steps, not p-1"),
    "ring-whole-tensor": (16, "ring-all-reduce", """
        def ring_all_reduce(tensor):  # right sums, passing the whole tensor around
            rank, world = dist.get_rank(), dist.get_world_size()
            passing = tensor.clone()
            for step in range(world - 1):
                received = torch.empty_like(tensor)
                request = dist.isend(passing, (rank + 1) % world)
                dist.recv(received, (rank - 1) % world)
                request.wait()
                tensor += received
                passing = received
            return tensor
        """,
        "sends of one chunk (1/p of the tensor) each"),
    "ring-averaged": (16, "ring-all-reduce", ring(("    return tensor",
                                                    "    return tensor.div_(world)")),
                      "you averaged instead of summed"),
    "ring-no-all-gather": (16, "ring-all-reduce", ring(("    for step in range(world - 1):\n"
                                                         "        send_index, recv_index = "
                                                         "(rank + 1",
                                                         "    for step in range(0):\n"
                                                         "        send_index, recv_index = "
                                                         "(rank + 1")),
                           "the all-gather phase is missing"),
    "ring-all-gather-adds": (16, "ring-all-reduce", ring((
        "chunks[recv_index].copy_(exchange(send_index, recv_index))",
        "chunks[recv_index] += exchange(send_index, recv_index)")),
        "the all-gather phase added the chunks it received"),
    "ring-index-counts-up": (16, "ring-all-reduce", ring(
        ("(rank - step) % world, (rank - step - 1) % world",
         "(rank + step) % world, (rank + step + 1) % world"),
        ("(rank + 1 - step) % world, (rank - step) % world",
         "(rank - 1 + step) % world, (rank + step) % world")),
        "your ring sends to rank-1 (or counts the chunk index up, rank + step)"),
    "ring-not-in-place": (16, "ring-all-reduce", ring(
        ("chunks = list(tensor.view(-1).tensor_split(world))",
         "tensor = tensor.clone()\n    chunks = list(tensor.view(-1).tensor_split(world))")),
        "left the caller's tensor unchanged"),
}


# Both ranks block in recv before anyone sends.
RING_DEADLOCK = ring(("request = dist.isend(chunks[send_index], right)\n"
                      "        dist.recv(received, left)\n        request.wait()",
                      "dist.recv(received, left)\n        dist.send(chunks[send_index], right)"))


def assert_reported_by_the_watchdog(took: float, stuck_after_s: float) -> None:
    """A deadlock is reported by gang's watchdog, stuck_after_s after the ranks stopped
    computing (moments after the last rank started its worker), not by gloo's timeout
    (GLOO_TIMEOUT_S) nor never. After that, only the parent's noticing, killing and reaping
    remain: 10 s covers that on a 2-core machine under a load of 13 and is still under gloo's
    timeout. The start-up before it (forking, imports, joining the group) depends on the
    machine's load, so the whole check is bounded by STARTUP_S + stuck_after_s (+ the same 10 s)."""
    from snippets.exercises import gang

    detection = gang.LAST_DETECTION_S
    assert detection is not None and detection < stuck_after_s + 10, detection
    assert stuck_after_s + 10 < gang.GLOO_TIMEOUT_S  # before gloo would
    assert took < gang.STARTUP_S + stuck_after_s + 10, took


def test_a_deadlocked_ring_fails_in_seconds_naming_the_ranks_and_leaves_no_process(tmp_path):
    import os
    import time

    from snippets.exercises import gang

    workspace = workspace_with(tmp_path, {"ring-all-reduce": RING_DEADLOCK})
    start = time.monotonic()
    result = run_check(catalog.get(16), workspace)
    took = time.monotonic() - start
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(took, gang.STUCK_AFTER_S)
    learner = tmp_path / catalog.COLLECTIVES_FILE
    line = next(n for n, text in enumerate(learner.read_text().splitlines(), 1)
                if "dist.recv(received, left)" in text)
    for rank in range(4):
        assert (f"rank {rank} is stuck in recv (your collectives.py line {line}: "
                "dist.recv(received, left))") in result.message, result.message
    assert "every rank waits to receive and none is sending" in result.message
    from snippets.exercises.__main__ import _report

    page = (ROOT / "docs" / "exercises" / "phase-4.md").read_text()
    assert f"```text\n{_report(result)}\n```" in page, _report(result)
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


def _compute_then_all_reduce(learner, rank, world, cpu_seconds):
    """Rank 0 computes for cpu_seconds of CPU time (a slow rank: on a busy machine it takes
    longer still) while the other ranks wait for it in an all-reduce."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 0:
        x, end = torch.ones(64, 64), time.process_time() + cpu_seconds
        while time.process_time() < end:
            x = (x @ x).clamp(-1, 1)
    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)


def test_a_slow_rank_that_computes_is_no_deadlock(tmp_path, monkeypatch):
    """The exercise checks' watchdog once took any rank still busy after 5 s of wall time to be
    stuck, and reported FSDP answers that were right as deadlocks on a loaded machine. A gang
    is stuck only when none of its ranks computes: rank 0 computing for 6 s of CPU, three times
    the watchdog's window, while rank 1 waits for it, is reported as the result it is."""
    from snippets.exercises import gang

    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)
    learner = tmp_path / "learner.py"
    learner.write_text("")
    assert gang.run_ranks(learner, _compute_then_all_reduce, 2, 6.0) == [2.0, 2.0]
    assert gang.LAST_DETECTION_S > 3 * gang.STUCK_AFTER_S


def _call_spin(learner, rank, world):
    learner.spin()


SPIN = "def spin():\n    while True:\n        sum(range(1000))\n"


def test_a_rank_that_never_stops_computing_is_stopped_at_the_running_limit(tmp_path,
                                                                            monkeypatch):
    import os

    from snippets.exercises import gang

    monkeypatch.setattr(gang, "RUNNING_LIMIT_S", 3.0)
    learner = tmp_path / "learner.py"
    learner.write_text(SPIN)
    with pytest.raises(gang.Stuck) as raised:
        gang.run_ranks(learner, _call_spin, 2)
    message = str(raised.value)
    assert message.startswith("still running after 3 s"), message
    for rank in range(2):
        assert re.search(rf"rank {rank} is in your code \(your learner.py line "
                         r"(2: while True:|3: sum\(range\(1000\)\))\)", message), message
    assert "Likely cause: a loop that never ends" in message
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


# chunk splits the first dimension: a 3 x 4 tensor gives 3 rows, not 4 pieces. Ranks 0 and 3
# index chunk 3 and raise IndexError; ranks 1 and 2 wait in the ring for them.
RING_CHUNK_TOO_FEW = ring(("chunks = list(tensor.view(-1).tensor_split(world))",
                           "chunks = list(tensor.chunk(world))"))


def raised_at(learner: Path, code: str, function: str) -> str:
    """`at <file> line N, in function: code`, as runner._describe names the learner's line."""
    n, text = next((n, t) for n, t in enumerate(learner.read_text().splitlines(), 1)
                   if code in t)
    return f"at {learner} line {n}, in {function}: {text.strip()}"


def line_of(learner: Path, code: str) -> int:
    return next(n for n, t in enumerate(learner.read_text().splitlines(), 1) if code in t)


def test_a_rank_that_raised_is_reported_with_its_error_not_as_finished(tmp_path, monkeypatch):
    import os
    import time

    from snippets.exercises import gang

    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)  # as for ZeRO and MoE below
    start = time.monotonic()
    result = run_check(catalog.get(16), workspace_with(tmp_path, {
        "ring-all-reduce": RING_CHUNK_TOO_FEW}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, 2.0)
    learner, message = tmp_path / catalog.COLLECTIVES_FILE, result.message
    # Rank 0 reads chunk 3 to add into it, rank 3 sends chunk 3: each with its own line.
    assert ("rank 0 raised IndexError: list index out of range\n  " + raised_at(
        learner, "chunks[recv_index] += exchange", "ring_all_reduce")) in message, message
    assert ("rank 3 raised IndexError: list index out of range\n  " + raised_at(
        learner, "dist.isend(chunks[send_index], right)", "exchange")) in message, message
    # The others are named where they wait, as what the error left behind, not as its cause.
    assert ("rank 1 is stuck in recv (your collectives.py line "
            f"{line_of(learner, 'dist.recv(received, left)')}: dist.recv(received, left))"
            in message), message
    assert "rank 2 is stuck in " in message, message
    assert "finished" not in message, message
    assert "only some ranks call" not in message, message
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


def edited(code: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert old in code, old
        code = code.replace(old, new, 1)
    return code


def solution_section(file: str, section: str) -> str:
    text = (ROOT / file).read_text()
    return re.search(rf"\[start:{section}\]\n(.*?)\n# --8<-- \[end:{section}\]", text, re.S)[1]


SAMPLER = solution_section(catalog.SAMPLER_FILE, "sampler")
SCHEDULES = solution_section(catalog.PIPELINE_FILE, "schedules")
PARALLEL_WRONG.update({
    "sampler-contiguous": (17, "sampler", edited(SAMPLER, (
        "return iter(indices[self.rank : self.total_size : self.num_replicas])",
        "n = self.num_samples\n        return iter(indices[self.rank * n : (self.rank + 1) * n])")),
        "a contiguous block of the permutation; DistributedSampler strides"),
    "sampler-no-padding": (17, "sampler", edited(SAMPLER, (
        "indices += (indices * math.ceil(padding / len(indices)))[:padding]", "pass"), (
        "return iter(indices[self.rank : self.total_size : self.num_replicas])",
        "return iter(indices[self.rank :: self.num_replicas])")),
        "the ranks got different numbers of examples ([3, 3, 2, 2])"),
    "sampler-seeded-by-rank": (17, "sampler", edited(SAMPLER, (
        "manual_seed(self.seed + self.epoch)", "manual_seed(self.seed + self.epoch + self.rank)")),
        "Did you seed with seed + rank"),
    "sampler-epoch-ignored": (17, "sampler", edited(SAMPLER, (
        "manual_seed(self.seed + self.epoch)", "manual_seed(self.seed)")),
        "set_epoch has no effect"),
    "1f1b-one-warmup-too-many": (18, "schedules", edited(SCHEDULES, (
        "warmup = min(num_stages - stage_index - 1, m)", "warmup = min(num_stages - stage_index, m)")),
        "stage s ran p - s warm-up forwards, one too many"),
    "1f1b-warmup-reversed": (18, "schedules", edited(SCHEDULES, (
        "warmup = min(num_stages - stage_index - 1, m)", "warmup = min(stage_index, m)")),
        "the warm-up is counted from the wrong end"),
    "1f1b-is-gpipe": (18, "schedules", edited(SCHEDULES, (
        "warmup = min(num_stages - stage_index - 1, m)", "warmup = m")),
        "that is the GPipe schedule"),
    "1f1b-uncapped-warmup": (18, "schedules", edited(SCHEDULES, (
        "warmup = min(num_stages - stage_index - 1, m)", "warmup = num_stages - stage_index - 1")),
        "with fewer micro-batches than stages the warm-up is min(p - s - 1, m)"),
    "1f1b-backward-first": (18, "schedules", edited(SCHEDULES, (
        'actions += [("F", warmup + i), ("B", i)]', 'actions += [("B", i), ("F", warmup + i)]')),
        "in the steady state each pair must be forward, then backward"),
})


F_AND_G = solution_section(catalog.TP_FILE, "f-and-g")
LINEARS = solution_section(catalog.TP_FILE, "linears")
G_REDUCES_ON_RANK_0_ONLY = edited(F_AND_G, (
    "        dist.all_reduce(total, group=group)",
    "        if dist.get_rank() == 0:\n            dist.all_reduce(total, group=group)"))
PARALLEL_WRONG.update({
    "tp-g-backward-all-reduces": (19, "f-and-g", edited(F_AND_G, (
        "    def backward(ctx, grad):\n        return grad, None, None",
        "    def backward(ctx, grad):\n        grad = grad.clone()\n"
        "        dist.all_reduce(grad)\n        return grad, None, None")),
        "g's backward all-reduces too"),
    "tp-f-backward-identity": (19, "f-and-g", edited(F_AND_G, (
        "        dist.all_reduce(grad, group=ctx.group)\n", "")),
        "so f's backward must all-reduce"),
    "tp-g-forward-identity": (19, "f-and-g", edited(F_AND_G, (
        "        dist.all_reduce(total, group=group)\n", "")),
        "g's forward must all-reduce the partial results"),
    "tp-f-forward-all-reduces": (19, "f-and-g", edited(F_AND_G, (
        "        return x.view_as(x)  # says what happens: returning x, autograd would make this view",
        "        x = x.clone()\n        dist.all_reduce(x, group=group)\n        return x")),
        "f's forward all-reduced x"),
    "tp-column-splits-columns": (19, "linears", edited(LINEARS, (
        "linear.weight.detach().chunk(size, dim=0)", "linear.weight.detach().chunk(size, dim=1)")),
        "you split the columns (dim 1, the input features)"),
    "tp-row-splits-rows": (19, "linears", edited(LINEARS, (
        "linear.weight.detach().chunk(size, dim=1)", "linear.weight.detach().chunk(size, dim=0)")),
        "you split the rows (dim 0, the output features)"),
})


OVERLAPPED = solution_section(catalog.DDP_SCRATCH_FILE, "overlapped")
PARALLEL_WRONG.update({
    "ddp-summed": (20, "overlapped", edited(OVERLAPPED, (
        "bucket.unpack(1 / world)", "bucket.unpack(1)")),
        "you summed instead of averaging"),
    "ddp-no-wait": (20, "overlapped", edited(OVERLAPPED, (
        "            work.wait()\n", "")),
        "stepping before the handles are waited on"),
    "ddp-reduce-at-first-hook": (20, "overlapped", edited(OVERLAPPED, (
        "if bucket.ready == len(bucket.params):", "if bucket.ready == 1:")),
        "reducing before all the bucket's hooks have fired"),
    "ddp-no-reset": (20, "overlapped", edited(OVERLAPPED, (
        "        for bucket in self.buckets:\n            bucket.ready = 0\n", "")),
        "the first backward synchronised, the second raised"),
})
BUCKETS = solution_section(catalog.DDP_SCRATCH_FILE, "buckets")
BUCKETED = solution_section(catalog.DDP_SCRATCH_FILE, "bucketed")
BUCKETED_ALL_REDUCE = "            dist.all_reduce(bucket.buffer)\n"
PARALLEL_WRONG.update({
    "buckets-forward-order": (27, "buckets", edited(BUCKETS, (
        "for p in reversed(params):", "for p in params:")),
        "your buckets follow the registration order"),
    "buckets-elements": (27, "buckets", edited(BUCKETS, (
        "if current and size + p.numel() * p.element_size() > cap:",
        "if current and size + p.numel() > cap:"), (
        "size += p.numel() * p.element_size()", "size += p.numel()")),
        "you counted elements against the cap, not bytes"),
    "buckets-close-after-overflow": (27, "buckets", edited(BUCKETS, (
        "        if current and size + p.numel() * p.element_size() > cap:\n"
        "            buckets.append(Bucket(current))\n"
        "            current, size = [], 0\n"
        "        current.append(p)\n"
        "        size += p.numel() * p.element_size()\n",
        "        current.append(p)\n"
        "        size += p.numel() * p.element_size()\n"
        "        if size > cap:\n"
        "            buckets.append(Bucket(current))\n"
        "            current, size = [], 0\n")),
        "you close a bucket only after a parameter has overflowed it"),
    "buckets-frozen-included": (27, "buckets", edited(BUCKETS, (
        "params = [p for p in module.parameters() if p.requires_grad]",
        "params = list(module.parameters())")),
        "a parameter with requires_grad=False is in a bucket"),
    "bucketed-summed": (27, "bucketed", edited(BUCKETED, (
        "bucket.unpack(1 / world)", "bucket.unpack(1)")),
        "the gradients are 2 times the mean: gradients not divided by the world size"),
    "bucketed-unpacked-before-reduce": (27, "bucketed", edited(BUCKETED, (
        "dist.all_reduce(bucket.buffer)\n            bucket.unpack(1 / world)",
        "bucket.unpack(1 / world)\n            dist.all_reduce(bucket.buffer)")),
        "rank 0's gradients are its own divided by 2: the all-reduced sums never reached them"),
    "bucketed-async-never-waited": (27, "bucketed", edited(BUCKETED, (
        "dist.all_reduce(bucket.buffer)", "dist.all_reduce(bucket.buffer, async_op=True)")),
        "started 2 async all-reduce(s) and never waited on the handle"),
})

# ---------------------------------------------------------------- ZeRO 1-3 and the MoE dispatch

ZERO1_STEP = re.search(r"\[start:zero1-step\]\n(.*?)\n[ \t]*# --8<-- \[end:zero1-step\]",
                       (ROOT / catalog.ZERO_FILE).read_text(), re.S)[1] + "\n"
ZERO2 = solution_section(catalog.ZERO_FILE, "zero2")
ZERO3_UNIT = solution_section(catalog.ZERO_FILE, "zero3-unit")
ZERO3 = solution_section(catalog.ZERO_FILE, "zero3")
DISPATCH = solution_section(catalog.MOE_FILE, "dispatch")
ZERO1_GATHER = ("        shard = self.flat.local(self.flat.full)\n"
                "        self.comm.all_gather(self.flat.full, shard)  # every rank gets every "
                "updated shard\n")
ZERO2_REDUCE = "        self.comm.reduce_scatter(received, bucket.flat_grad())\n"
PARALLEL_WRONG.update({
    "zero1-summed": (21, "zero1-step", edited(ZERO1_STEP, (
        "        self.flat_grads /= dist.get_world_size()  # ...then the mean, as in DDP\n", "")),
        "the gradients were summed, not averaged: 2 times too large"),
    "zero1-not-reduced": (21, "zero1-step", edited(ZERO1_STEP, (
        "        self.comm.all_reduce(self.flat_grads)  # every rank gets the summed gradient...\n"
        "        self.flat_grads /= dist.get_world_size()  # ...then the mean, as in DDP\n", "")),
        "the gradients were never all-reduced"),
    "zero1-no-all-gather": (21, "zero1-step", edited(ZERO1_STEP, (ZERO1_GATHER, "")),
        "the updated shards were never all-gathered"),
    "zero1-gather-before-step": (21, "zero1-step", edited(ZERO1_STEP, (ZERO1_GATHER, ""), (
        "        self.optimizer.step()", ZERO1_GATHER + "        self.optimizer.step()")),
        "all-gathered before the step, so the update used stale parameters"),
    "zero1-bypasses-comm": (21, "zero1-step", edited(ZERO1_STEP, (
        "self.comm.all_reduce(self.flat_grads)", "dist.all_reduce(self.flat_grads)")),
        "make the all-reduce and the all-gather through self.comm"),
    "zero2-summed": (22, "zero2", edited(ZERO2, (
        "        received /= dist.get_world_size()\n", "")),
        "the gradients were summed, not averaged: 2 times too large"),
    "zero2-wrong-rank": (22, "zero2", edited(ZERO2, (ZERO2_REDUCE, (
        "        flat = bucket.flat_grad()\n        self.comm.all_reduce(flat)\n"
        "        world = dist.get_world_size()\n"
        "        received = flat.chunk(world)[(dist.get_rank() + 1) % world].clone()\n"))),
        "reduce-scatter shard given to the wrong rank: rank 0 holds the averaged gradient of "
        "rank 1's shard"),
    "zero2-all-reduced": (22, "zero2", edited(ZERO2, (ZERO2_REDUCE, (
        "        flat = bucket.flat_grad()\n        self.comm.all_reduce(flat)\n"
        "        received = bucket.local(flat).clone()\n"))),
        "the gradients were all-reduced, not reduce-scattered"),
    "zero2-overwrites": (22, "zero2", edited(ZERO2, (
        "        if shard.grad is None:\n            shard.grad = received\n"
        "        else:  # gradient accumulation: add this micro-batch's averaged gradient\n"
        "            shard.grad += received\n", "        shard.grad = received\n")),
        "the hook overwrote self.shards[i].grad"),
    "zero2-keeps-full-grads": (22, "zero2", edited(ZERO2, (
        "        for p in bucket.params:\n            p.grad = None  # the full gradient is "
        "gone; only this rank's shard remains\n", "")),
        "after backward 0.weight.grad still holds the full gradient"),
    "zero2-reduces-early": (22, "zero2", edited(ZERO2, (
        "if self.ready[i] < len(bucket.params):", "if self.ready[i] < 1:")),
        "reducing before all the bucket's gradients exist"),
    "zero2-count-not-reset": (22, "zero2", edited(ZERO2, (
        "self.ready[i], self.reduced[i] = 0, True", "self.reduced[i] = True")),
        "self.ready[i] was not reset to 0"),
    "zero2-reduced-not-marked": (22, "zero2", edited(ZERO2, (
        "self.ready[i], self.reduced[i] = 0, True", "self.ready[i] = 0")),
        "did not set self.reduced[i] = True"),
    "zero3-never-freed": (23, "zero3", edited(ZERO3, ("        unit.free()\n", "")),
        "the full weights were never freed"),
    "zero3-no-gather-in-backward": (23, "zero3", edited(ZERO3, (
        "                t.register_hook(lambda grad, unit=unit: (unit.gather(), grad)[1])\n",
        "                pass\n")),
        "backward ran on freed parameters"),
    "zero3-gather-without-resize": (23, "zero3-unit", edited(ZERO3_UNIT, (
        "            self.flat.full.untyped_storage().resize_(self.full_bytes)\n", "")),
        "gather() must first give the flat buffer its bytes back"),
    "moe-counts-not-exchanged": (24, "dispatch", edited(DISPATCH, (
        "    recv_per_expert = torch.empty_like(tokens_per_expert)\n"
        "    dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=group)\n",
        "    recv_per_expert = tokens_per_expert  # assumed symmetric\n")),
        "counts not exchanged"),
    "moe-splits-per-expert": (24, "dispatch", edited(DISPATCH, (
        "send_splits = tokens_per_expert.view(world, local).sum(dim=1).tolist()",
        "send_splits = tokens_per_expert.tolist()"), (
        "recv_splits = recv_per_expert.view(world, local).sum(dim=1).tolist()",
        "recv_splits = recv_per_expert.tolist()")),
        "the splits are per RANK, not per expert"),
    "moe-no-regroup": (24, "dispatch", edited(DISPATCH, (
        "outputs = moe.run_local_experts(torch.cat(by_expert), counts.sum(dim=0))",
        "outputs = moe.run_local_experts(received, counts.sum(dim=0))"), (
        "back = torch.cat([out_pieces[j * world + s] for s in range(world) for j in range(local)])",
        "back = outputs")),
        "the experts ran on them in that order: rows from rank 1 went to the wrong expert"),
    "moe-combined-in-send-order": (24, "dispatch", edited(DISPATCH, (
        "back = torch.cat([out_pieces[j * world + s] for s in range(world) for j in range(local)])",
        "back = outputs")),
        "tokens combined in send order instead of original order"),
    "moe-return-splits-not-swapped": (24, "dispatch", edited(DISPATCH, (
        "return AllToAll.apply(back, recv_splits, send_splits, group)",
        "return AllToAll.apply(back, send_splits, recv_splits, group)")),
        "the results go back with the splits of the way out"),
    "moe-no-return-trip": (24, "dispatch", edited(DISPATCH, (
        "return AllToAll.apply(back, recv_splits, send_splits, group)", "return back")),
        "the results never went back to the ranks their tokens came from"),
    "moe-no-autograd": (24, "dispatch", edited(DISPATCH, (
        "received = AllToAll.apply(inputs, send_splits, recv_splits, group)",
        "received = inputs.new_empty(sum(recv_splits), inputs.shape[1])\n"
        "    dist.all_to_all_single(received, inputs.detach(), recv_splits, send_splits, "
        "group=group)")),
        "no gradient flows back to the inputs"),
})

# Hand-written exchanges that call a blocking recv before any rank sends: every rank waits.
ZERO1_RECV_FIRST = edited(ZERO1_STEP, (ZERO1_GATHER, (
    "        rank, world = dist.get_rank(), dist.get_world_size()\n"
    "        shards = self.flat.full.chunk(world)\n"
    "        for peer in range(world):\n"
    "            if peer != rank:\n"
    "                dist.recv(shards[peer], peer)\n"
    "        for peer in range(world):\n"
    "            if peer != rank:\n"
    "                dist.send(shards[rank], peer)\n")))
MOE_RECV_FIRST = edited(DISPATCH, (
    "    dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=group)\n",
    "    rank, rows = dist.get_rank(), recv_per_expert.view(world, local)\n"
    "    for peer in range(world):\n"
    "        if peer != rank:\n"
    "            dist.recv(rows[peer], peer)\n"
    "    for peer in range(world):\n"
    "        if peer != rank:\n"
    "            dist.send(tokens_per_expert.view(world, local)[peer].contiguous(), peer)\n"
    "    rows[rank] = tokens_per_expert.view(world, local)[rank]\n"))
# A collective that only rank 0 makes: the others go on, rank 0 waits for them.
ZERO2_RANK_0_ONLY = edited(ZERO2, (ZERO2_REDUCE, (
    "        if dist.get_rank() == 0:\n"
    "            self.comm.reduce_scatter(received, bucket.flat_grad())\n"
    "        else:\n            received.zero_()\n")))
ZERO3_RANK_0_ONLY = edited(ZERO3, (
    "                t.register_hook(lambda grad, unit=unit: (unit.gather(), grad)[1])\n",
    "                if dist.get_rank() == 0:\n"
    "                    t.register_hook(lambda grad, unit=unit: (unit.gather(), grad)[1])\n"))
ZERO_MOE_DEADLOCKS = {
    # exercise: (section, code, the line each waiting rank is named in, who waits, the cause)
    21: ("zero1-step", ZERO1_RECV_FIRST, "dist.recv(shards[peer], peer)", "recv", (0, 1),
         "every rank waits to receive and none is sending"),
    # (CommStats lives in snippets/scratch/flat_shard.py: a collective through it is named at
    # the learner's call of it)
    22: ("zero2", ZERO2_RANK_0_ONLY, "self.comm.reduce_scatter(received, bucket.flat_grad())",
         "reduce_scatter_single", (0,), "every rank calls the same collectives in the same order"),
    # (rank 1, which never gathers, raises in backward on its freed parameter: that error is
    # reported, not a rank that "finished")
    23: ("zero3", ZERO3_RANK_0_ONLY, "self.comm.all_gather(self.flat.full, self.shard.detach())",
         "all_gather_single", (0,), "rank 1 raised RuntimeError: setStorage"),
    24: ("dispatch", MOE_RECV_FIRST, "dist.recv(rows[peer], peer)", "recv", (0, 1),
         "every rank waits to receive and none is sending"),
}


@pytest.mark.parametrize("number", sorted(ZERO_MOE_DEADLOCKS))
def test_a_deadlocked_zero_or_moe_answer_fails_fast_naming_the_ranks(number, tmp_path,
                                                                     monkeypatch):
    import os
    import time

    from snippets.exercises import gang

    # The pages say 5 s; 2 s here keeps the four deadlocks cheap (a correct answer takes 0.1 s).
    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)
    section, code, line_text, op, waiting, cause = ZERO_MOE_DEADLOCKS[number]
    ex = catalog.get(number)
    start = time.monotonic()
    result = run_check(ex, workspace_with(tmp_path, {section: code}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, 2.0)
    name = Path(ex.file).name
    line = next(n for n, text in enumerate((tmp_path / ex.file).read_text().splitlines(), 1)
                if line_text in text)
    for rank in waiting:
        assert (f"rank {rank} is stuck in {op} (your {name} line {line}: {line_text})"
                in result.message), result.message
    assert cause in result.message, result.message
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_a_collective_on_one_rank_in_tensor_parallel_fails_in_seconds(tmp_path):
    import time

    from snippets.exercises import gang

    start = time.monotonic()
    result = run_check(catalog.get(19), workspace_with(tmp_path, {
        "f-and-g": G_REDUCES_ON_RANK_0_ONLY}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, gang.STUCK_AFTER_S)
    assert "rank 0 is stuck in all_reduce (your tensor_parallel.py line" in result.message
    assert "rank 1 finished while the others wait" in result.message, result.message

# Rank 1 indexes a one-entry list by its rank and raises inside g's forward; the check's
# worker catches the error (to report it with the weights), so the rank returns, while rank 0
# waits in g's all-reduce.
G_INDEXES_BY_RANK = edited(F_AND_G, ('        stats.record("forward", total)',
                                     '        stats.record("forward", [total][dist.get_rank()])'))


def test_an_error_a_worker_caught_while_a_peer_waits_is_reported_not_finished(tmp_path,
                                                                              monkeypatch):
    import time

    from snippets.exercises import gang

    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)  # as for ZeRO and MoE above
    start = time.monotonic()
    result = run_check(catalog.get(19), workspace_with(tmp_path, {"f-and-g": G_INDEXES_BY_RANK}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, 2.0)
    learner, message = tmp_path / catalog.TP_FILE, result.message
    assert ("rank 1 raised IndexError: list index out of range\n  " + raised_at(
        learner, '[total][dist.get_rank()]', "forward")) in message, message
    assert ("rank 0 is stuck in all_reduce (your tensor_parallel.py line "
            f"{line_of(learner, 'dist.all_reduce(total, group=group)')}: "
            "dist.all_reduce(total, group=group))") in message, message
    assert "finished" not in message, message


def test_a_bucket_reduced_on_one_rank_only_fails_fast_naming_the_rank(tmp_path, monkeypatch):
    import os
    import time

    from snippets.exercises import gang

    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)  # as for ZeRO and MoE above
    code = edited(BUCKETED, (BUCKETED_ALL_REDUCE, "            if dist.get_rank() == 0:\n    "
                             + BUCKETED_ALL_REDUCE))
    start = time.monotonic()
    result = run_check(catalog.get(27), workspace_with(tmp_path, {"bucketed": code}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, 2.0)
    line = next(n for n, text in enumerate(
        (tmp_path / catalog.DDP_SCRATCH_FILE).read_text().splitlines(), 1)
        if text == "    " + BUCKETED_ALL_REDUCE.rstrip("\n"))
    assert ("rank 0 is stuck in all_reduce (your ddp.py line "
            f"{line}: dist.all_reduce(bucket.buffer))") in result.message, result.message
    assert "rank 1 finished while the others wait" in result.message, result.message
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_fresh_stubs_of_the_parallelisms_are_not_started(tmp_path):
    write_stubs(tmp_path)
    for number in range(16, 28):
        ex = catalog.get(number)
        result = run_check(ex, tmp_path)
        assert result.status == "not started", result
        assert result.message.startswith(f"not started yet: edit {tmp_path / ex.file} at line ")


def test_what_each_rank_printed_comes_with_the_failure(tmp_path):
    body = ring(("    return tensor", "    print('rank', rank, 'done')\n    return tensor / world"))
    result = run_check(catalog.get(16), workspace_with(tmp_path, {"ring-all-reduce": body}))
    assert result.status == "FAIL", result
    assert "the tensor holds the sum, but ring_all_reduce did not return it" in result.message
    for rank in range(4):
        assert f"    rank {rank}: rank {rank} done" in result.message, result.message

@pytest.mark.parametrize("case", ["ring-sends-left", "moe-counts-not-exchanged"])
def test_the_named_mistake_shown_on_the_parallelisms_page_is_real(case, tmp_path):
    from snippets.exercises.__main__ import _report

    number, section, body, _ = PARALLEL_WRONG[case]
    report = _report(run_check(catalog.get(number), workspace_with(tmp_path, {section: body})))
    page = (ROOT / "docs" / "exercises" / "phase-4.md").read_text()
    assert f"```text\n{report}\n```" in page, report

@pytest.mark.parametrize("case", sorted(PARALLEL_WRONG))
def test_parallel_check_names_a_planted_mistake(case, tmp_path):
    number, section, body, explanation = PARALLEL_WRONG[case]
    result = run_check(catalog.get(number), workspace_with(tmp_path, {section: body}))
    assert result.status == "FAIL", result
    assert explanation in result.message, result.message


# ---------------------------------------------------------------- sequence parallelism, 3-D groups

SP_COLLECTIVES = solution_section(catalog.SP_FILE, "collectives")
SP_EDGES = solution_section(catalog.SP_FILE, "enter-and-leave")
SP_REPLICATED = solution_section(catalog.SP_FILE, "replicated-grads")
MESH = solution_section(catalog.THREE_D_FILE, "mesh")
SP_GATHER_BACKWARD = ('        ctx.stats.record("backward", "reduce_scatter", grad)\n'
                      "        return reduce_scatter_sequence(grad, ctx.group), None, None")
SP_PARALLEL_WRONG = {
    "sp-gathered-along-batch": (25, "collectives", edited(SP_COLLECTIVES, (
        "    mine = shard.movedim(1, 0).contiguous()\n", "    mine = shard.contiguous()\n"), (
        "    return full.movedim(0, 1).contiguous()", "    return full")),
        "gathered along the batch dimension instead of the sequence"),
    "sp-wrong-rank-order": (25, "collectives", edited(SP_COLLECTIVES, (
        "    return full.movedim(0, 1).contiguous()",
        "    blocks = full.movedim(0, 1).chunk(dist.get_world_size(group), dim=1)\n"
        "    return torch.cat(blocks[::-1], dim=1)")),
        "shards concatenated in the wrong rank order: positions 0-3, 4-7 of the sequence hold "
        "the tokens of ranks [1, 0]"),
    "sp-backward-all-reduced": (25, "enter-and-leave", edited(SP_EDGES, (
        SP_GATHER_BACKWARD,
        '        ctx.stats.record("backward", "reduce_scatter", grad)\n'
        "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
        "        return grad, None, None")),
        "the whole sequence's, N = 2 times too large. Backward all-reduced instead of "
        "reduce-scattered"),
    "sp-backward-all-reduced-then-sliced": (25, "enter-and-leave", edited(SP_EDGES, (
        SP_GATHER_BACKWARD,
        '        ctx.stats.record("backward", "reduce_scatter", grad)\n'
        "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
        "        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)\n"
        "        return grad.chunk(world, dim=1)[rank], None, None")),
        "the values are right, but a (B, T, h) activation or gradient was all-reduced where SP "
        "reduce-scatters"),
    "sp-norm-grads-not-reduced": (25, "replicated-grads", edited(SP_REPLICATED, (
        "        dist.all_reduce(grad, group=group)\n", "")),
        "forgot to all-reduce the norm weights' gradients: partial sums"),
}
GROUPS_3D_WRONG = {
    "3d-dp-over-world": (26, "mesh", edited(MESH, (
        "    return mine",
        "    mine[\"dp\"] = dist.group.WORLD  # every rank holds a copy of the model: average\n"
        "    return mine")),
        "averaging over the world: every rank's DP group holds all 8 ranks"),
    "3d-dp-over-stage": (26, "mesh", edited(MESH, (
        "        for ranks in mesh.groups(axis):\n",
        "        stages = [[r for r in range(mesh.size) if mesh.coords(r)[\"pp\"] == p]\n"
        "                  for p in range(mesh.pp)]\n"
        "        for ranks in (stages if axis == \"dp\" else mesh.groups(axis)):\n")),
        "averaging over the stage group (DP x TP): rank 0's DP group is [0, 1, 4, 5]"),
    "3d-tp-outermost": (26, "mesh", edited(MESH, (
        "        return [[self.rank(**{axis: i}, **dict(zip(others, fixed)))",
        "        from dataclasses import replace\n"
        "        return [[replace(self, order=self.order[::-1]).rank(\n"
        "                     **{axis: i}, **dict(zip(others, fixed)))")),
        "your groups lay the ranks out with TP outermost: consecutive ranks (one node) land in "
        "other TP groups"),
}


@pytest.mark.parametrize("case", sorted(SP_PARALLEL_WRONG))
def test_sp_check_names_a_planted_mistake(case, tmp_path):
    number, section, body, explanation = SP_PARALLEL_WRONG[case]
    result = run_check(catalog.get(number), workspace_with(tmp_path, {section: body}))
    assert result.status == "FAIL", result
    assert explanation in result.message, result.message


@pytest.mark.parametrize("case", sorted(GROUPS_3D_WRONG))
def test_3d_groups_check_names_a_planted_mistake_without_processes(case, tmp_path):
    from snippets.exercises import gang

    number, section, body, explanation = GROUPS_3D_WRONG[case]
    gang.LAST_PIDS.clear()
    result = run_check(catalog.get(number), workspace_with(tmp_path, {section: body}))
    assert result.status == "FAIL", result
    assert explanation in result.message, result.message
    # the wrong membership comes with the layout expected, rank by rank, and the learner's
    assert "expected (TP innermost: rank = ((d * pp) + p) * tp + t):" in result.message
    assert "       0   0  0  0  [0, 1]    [0, 2]    [0, 4]" in result.message, result.message
    assert gang.LAST_PIDS == []  # judged on 8 simulated ranks: no process was started


def test_the_3d_mistake_shown_on_the_parallelisms_page_is_real(tmp_path):
    from snippets.exercises.__main__ import _report

    number, section, body, _ = GROUPS_3D_WRONG["3d-dp-over-stage"]
    report = _report(run_check(catalog.get(number), workspace_with(tmp_path, {section: body})))
    page = (ROOT / "docs" / "exercises" / "phase-4.md").read_text()
    assert f"```text\n{report}\n```" in page, report


def test_fresh_stubs_of_sp_and_3d_raise_the_stub_message(tmp_path):
    from snippets.exercises.runner import load_learner_module

    write_stubs(tmp_path)
    sp = load_learner_module(tmp_path / catalog.SP_FILE)
    with pytest.raises(NotImplementedError, match=r"^Exercise 25: SP's gather and scatter "
                       r"edges .*Check with: python -m snippets.exercises check 25$"):
        sp.all_gather_sequence(None, None)
    three_d = load_learner_module(tmp_path / catalog.THREE_D_FILE)
    with pytest.raises(NotImplementedError, match=r"^Exercise 26: the 3-D process groups "
                       r".*Check with: python -m snippets.exercises check 26$"):
        three_d.Mesh(2, 2, 2).groups("tp")
    for number in (25, 26):
        result = run_check(catalog.get(number), tmp_path)
        assert result.status == "not started", result


# Only rank 0 all-reduces the norm's gradient: rank 1 finishes, rank 0 waits for it.
SP_RANK_0_ONLY = edited(SP_REPLICATED, (
    "        dist.all_reduce(grad, group=group)\n",
    "        if dist.get_rank() == 0:\n            dist.all_reduce(grad, group=group)\n"))
# Each rank creates only its own groups: as many calls on every rank, but the ranks disagree on
# which group is which (on gloo that hangs or connects the wrong ranks, by timing: named from
# the simulation, without processes).
MESH_OWN_GROUPS_ONLY = edited(MESH, (
    "            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))\n"
    "            if rank in ranks:\n                mine[axis] = group\n",
    "            if rank in ranks:\n"
    "                mine[axis] = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))\n"))
# Rank 0 alone creates the groups: it waits in new_group for peers that never come.
MESH_RANK_0_ONLY = edited(MESH, (
    "    for axis in [a for a in (\"tp\", \"cp\", \"pp\", \"dp\") if a in mesh.order]:\n",
    "    for axis in ((\"tp\", \"pp\", \"dp\") if rank == 0 else ()):  # set up once, on rank 0\n"))


def test_3d_groups_created_in_different_orders_are_named_without_processes(tmp_path):
    from snippets.exercises import gang

    gang.LAST_PIDS.clear()
    result = run_check(catalog.get(26), workspace_with(tmp_path, {"mesh": MESH_OWN_GROUPS_ONLY}))
    assert result.status == "FAIL", result
    assert ("new_group not called on every rank in the same order" in result.message
            and "call 2 was new_group([0, 2]) on rank 0 but new_group([1, 3]) on rank 1"
            in result.message), result.message
    assert gang.LAST_PIDS == []

SP_3D_DEADLOCKS = {
    # exercise: (how the report starts, section, code, the line each waiting rank is named in,
    # its call, who waits, the cause the check gives)
    25: ("a deadlock: for 2 s no rank has computed, and these ranks are waiting",
         "replicated-grads", SP_RANK_0_ONLY, "dist.all_reduce(grad, group=group)", "all_reduce",
         (0,), "rank 1 finished while the others wait"),
    # Ranks 1-3 create no group: the check's worker raises on their empty dict of groups.
    26: ("on 4 processes, ranks 1, 2, 3 raised KeyError: 'tp'\n  Left waiting for them:",
         "mesh", MESH_RANK_0_ONLY,
         "group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))", "new_group",
         (0,), "Why: new_group not called on every rank in the same order"),
}


@pytest.mark.parametrize("number", sorted(SP_3D_DEADLOCKS))
def test_a_deadlocked_sp_or_3d_answer_fails_fast_naming_the_ranks(number, tmp_path, monkeypatch):
    import os
    import time

    from snippets.exercises import gang

    monkeypatch.setattr(gang, "STUCK_AFTER_S", 2.0)  # as for ZeRO and MoE above
    head, section, code, line_text, op, waiting, cause = SP_3D_DEADLOCKS[number]
    ex = catalog.get(number)
    start = time.monotonic()
    result = run_check(ex, workspace_with(tmp_path, {section: code}))
    assert result.status == "FAIL", result
    assert_reported_by_the_watchdog(time.monotonic() - start, 2.0)
    assert result.message.startswith(head), result.message
    name = Path(ex.file).name
    line = next(n for n, text in enumerate((tmp_path / ex.file).read_text().splitlines(), 1)
                if line_text in text)
    for rank in waiting:
        assert (f"rank {rank} is stuck in {op} (your {name} line {line}: {line_text})"
                in result.message), result.message
    assert cause in result.message, result.message
    for pid in gang.LAST_PIDS:  # killed and reaped: no process is left behind
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_the_page_states_the_watchdogs_own_limits():
    """phase-4.md's numbers for the deadlock watchdog are gang's constants."""
    from snippets.exercises import gang

    page = " ".join((ROOT / "docs" / "exercises" / "phase-4.md").read_text().split())
    assert (f"no rank has computed anything for {gang.STUCK_AFTER_S:g} s (each used under "
            f"{gang.IDLE_SHARE:.0%} of a core)") in page
    assert f"a rank that computes for {gang.RUNNING_LIMIT_S:g} s (a loop that never ends)" in page
