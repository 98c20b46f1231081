"""Every autograded exercise is reachable from the lesson that teaches its code, from its week's
index and from the study plan, as the catalogue says (snippets/exercises/catalog.py, `lesson`).

- the lesson page ends with an "Autograded exercise(s)" section holding
  `python -m snippets.exercises check N` for each of its exercises, a link to the exercise on its
  phase page, and the solution included from the module (never copied);
- the week index links each exercise of its week's lessons, at its phase page's heading;
- the study plan names every exercise exactly once, in a `check N` (or `check N-M`) command, and
  each of its tick boxes carries a distinct `data-checklist-id`.
"""

import re
from collections import Counter
from pathlib import Path

import markdown
import pytest

from snippets.exercises import catalog

pytestmark = pytest.mark.kernel_independent("page text")

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHECK = re.compile(r"python -m snippets\.exercises check (\d+)(?:-(\d+))?")
BY_LESSON: dict[str, list] = {}
for _ex in catalog.EXERCISES:
    BY_LESSON.setdefault(_ex.lesson, []).append(_ex)


def anchor(ex) -> str:
    """The id Markdown's toc gives the exercise's heading on its phase page."""
    page = (DOCS / "exercises" / f"phase-{ex.phase}.md").read_text(encoding="utf-8")
    heading = next(line for line in page.splitlines()
                   if line.startswith(f"## Exercise {ex.number}."))
    html = markdown.Markdown(extensions=["toc"]).convert(heading)
    return re.search(r'id="([^"]+)"', html)[1]


def phase_link(ex, page: str) -> str:
    up = "../" * (len(Path(page).parts) - 1)
    return f"({up}exercises/phase-{ex.phase}.md#{anchor(ex)})"


def final_section(text: str) -> str:
    """The page's last level-2 section, which must be its autograded exercise(s)."""
    start = text.rfind("\n## ")
    return text[start + 1:]


def test_every_exercise_names_an_existing_lesson():
    for ex in catalog.EXERCISES:
        assert ex.lesson and (DOCS / ex.lesson).is_file(), (ex.number, ex.lesson)


@pytest.mark.parametrize("page", sorted(BY_LESSON))
def test_each_lesson_ends_with_its_exercises(page):
    section = final_section((DOCS / page).read_text(encoding="utf-8"))
    assert re.match(r"## Autograded exercises?\n", section), (
        f"{page} must end with an 'Autograded exercise' section; its last is {section[:60]!r}")
    for ex in BY_LESSON[page]:
        assert f"python -m snippets.exercises check {ex.number}`" in section or \
            f"python -m snippets.exercises check {ex.number}\n" in section, (
                f"{page}'s last section lacks `python -m snippets.exercises check {ex.number}`")
        assert phase_link(ex, page) in section, f"{page} does not link exercise {ex.number}"
        for name in ex.sections:  # the solution, included from the module, collapsed
            assert f'    --8<-- "{ex.file}:{name}"' in section, (
                f"{page} does not include {ex.file}:{name} as exercise {ex.number}'s solution")
    assert "python -m snippets.exercises stubs" in section
    assert "python -m snippets.exercises hints " in section
    assert '??? success "Solution' in section


@pytest.mark.parametrize("week", [1, 2, 3, 4])
def test_each_week_index_links_its_exercises(week):
    page = f"course/week-{week}/index.md"
    text = (DOCS / page).read_text(encoding="utf-8")
    mine = [ex for ex in catalog.EXERCISES if ex.lesson.startswith(f"course/week-{week}/")]
    assert mine
    for ex in mine:
        assert phase_link(ex, page) in text, f"{page} does not link exercise {ex.number}"


def test_the_study_plan_names_every_exercise_once_with_a_stable_id():
    text = (DOCS / "reference" / "study-plan.md").read_text(encoding="utf-8")
    named = Counter()
    for m in CHECK.finditer(text):
        first, last = int(m[1]), int(m[2] or m[1])
        named.update(range(first, last + 1))
    numbers = [ex.number for ex in catalog.EXERCISES]
    assert sorted(named) == numbers, f"exercises missing: {sorted(set(numbers) - set(named))}"
    assert all(count == 1 for count in named.values()), {n: c for n, c in named.items() if c > 1}
    items = [line for line in text.splitlines() if line.startswith("- [ ] ")]
    ids = [re.match(r'- \[ \] <span data-checklist-id="([\w-]+)"></span>', line) for line in items]
    assert all(ids), [line for line, m in zip(items, ids) if not m]
    assert len({m[1] for m in ids}) == len(ids), "two tick boxes share an id"
