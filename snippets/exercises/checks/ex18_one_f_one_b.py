"""Check of exercise 18: one_f_one_b_schedule (pipeline.py)."""

from __future__ import annotations

from types import ModuleType

from snippets.exercises.runner import CheckFailed


SCHEDULE_CASES = ((2, 4), (4, 8), (4, 4), (4, 2), (3, 5))  # (stages p, micro-batches m)


def _one_f_one_b(m, s, p, warmup, backward_first=False, cool_down_reversed=False) -> list:
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        pair = [("F", warmup + i), ("B", i)]
        actions += pair[::-1] if backward_first else pair
    owed = [("B", i) for i in range(m - warmup, m)]
    return actions + (owed[::-1] if cool_down_reversed else owed)


SCHEDULE_MISTAKES = (
    ("stage s ran p - s warm-up forwards, one too many: it then holds one micro-batch's "
     "activations more than 1F1B needs. Stage s runs min(p - s - 1, m) forwards before its "
     "first backward (the last stage none)",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s, m))),
    ("the warm-up is counted from the wrong end: you gave stage s s warm-up forwards. The "
     "FIRST stage waits longest for its first gradient, so it runs the most: "
     "min(p - s - 1, m), and the last stage none",
     lambda m, s, p: _one_f_one_b(m, s, p, min(s, m))),
    ("that is the GPipe schedule (all forwards, then all backwards): every stage holds all m "
     "micro-batches' activations. 1F1B starts backwards after a warm-up of p - s - 1 forwards",
     lambda m, s, p: _one_f_one_b(m, s, p, m)),
    ("in the steady state each pair must be forward, then backward: F(warmup + i), B(i). "
     "Backward first makes the last stage wait for a gradient of a micro-batch it has not "
     "run forward yet",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s - 1, m), backward_first=True)),
    ("the cool-down runs the owed backwards in reverse order. The next stage runs its "
     "backwards, and sends their gradients back, oldest micro-batch first; a stage that asks "
     "for the newest first sits idle while the gradient it could use now waits unread, and "
     "keeps every owed micro-batch's activations until the last gradient comes. Run the "
     "owed backwards oldest first, in the order their gradients arrive",
     lambda m, s, p: _one_f_one_b(m, s, p, min(p - s - 1, m), cool_down_reversed=True)),
)


def simulate_pipeline(schedules: list[list]) -> str | None:
    """None when stages running these orders (stage s's list, in order) all finish; else
    where the first stuck stage waits. F(i) on stage s needs F(i) on s-1; B(i) needs F(i)
    on the same stage and B(i) on s+1."""
    p, done, pos = len(schedules), set(), [0] * len(schedules)
    while True:
        moved = False
        for s, actions in enumerate(schedules):
            while pos[s] < len(actions):
                kind, i = actions[pos[s]]
                needs = ([("F", i, s - 1)] if kind == "F" and s > 0 else []) + (
                    [("F", i, s)] + ([("B", i, s + 1)] if s < p - 1 else [])
                    if kind == "B" else [])
                if not all(n in done for n in needs):
                    break
                done.add((kind, i, s))
                pos[s] += 1
                moved = True
        if all(pos[s] == len(a) for s, a in enumerate(schedules)):
            return None
        if not moved:
            s = next(s for s, a in enumerate(schedules) if pos[s] < len(a))
            kind, i = schedules[s][pos[s]]
            return f"stage {s} waits forever at {kind}{i}"


def _peak(actions: list) -> int:
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def check_one_f_one_b(learner: ModuleType) -> list[str]:
    from snippets.scratch.pipeline import one_f_one_b_schedule as reference

    for p, m in SCHEDULE_CASES:
        got = [[tuple(a) for a in learner.one_f_one_b_schedule(m, s, p)] for s in range(p)]
        want = [reference(m, s, p) for s in range(p)]
        if got == want:
            continue
        where = f"with p = {p} stages and m = {m} micro-batches"
        for s in range(p):
            if sorted(got[s]) != sorted(want[s]):
                out_of_range = sorted({i for _, i in got[s] if not 0 <= i < m})
                extra = (f" (micro-batches {out_of_range} do not exist: with fewer "
                         "micro-batches than stages the warm-up is min(p - s - 1, m))"
                         if out_of_range else "")
                raise CheckFailed(f"{where}, stage {s}'s actions are {_fmt_actions(got[s])}: "
                                  f"each of F0..F{m - 1} and B0..B{m - 1} must appear "
                                  f"exactly once{extra}")
        for message, variant in SCHEDULE_MISTAKES:
            if all([variant(m2, s, p2) for s in range(p2)] ==
                   [[tuple(a) for a in learner.one_f_one_b_schedule(m2, s, p2)]
                    for s in range(p2)] for p2, m2 in SCHEDULE_CASES):
                raise CheckFailed(f"{message}.\n  W{where[1:]}, stage 0 ran "
                                  f"{_fmt_actions(got[0])}; 1F1B is {_fmt_actions(want[0])}")
        stuck = simulate_pipeline(got)
        s = next(s for s in range(p) if got[s] != want[s])
        raise CheckFailed(
            f"{where}, stage {s} runs {_fmt_actions(got[s])}; 1F1B is "
            f"{_fmt_actions(want[s])}"
            + (f": the pipeline deadlocks ({stuck}: the action it needs comes later in "
               "another stage's order)" if stuck else
               f" (it holds up to {_peak(got[s])} micro-batches' activations; 1F1B at most "
               f"{_peak(want[s])})"))
    return [f"the 1F1B order on every stage for {len(SCHEDULE_CASES)} (stages, micro-batches) "
            "settings, fewer micro-batches than stages included",
            "stage s holds at most p - s micro-batches' activations"]


def _fmt_actions(actions: list) -> str:
    return " ".join(f"{k}{i}" for k, i in actions)
