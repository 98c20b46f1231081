"""The exercises' checks, one file per exercise: exNN_<what>.py holds the check of exercise NN,
the function its catalog entry names in `check`. The runner finds it by the number
(catalog.Exercise.check_path), so adding an exercise's check is adding its file. The files whose
names start with `_` hold what the checks of several exercises share.

Each check takes the learner's module (their copy of the file, imported by path) and returns
the list of things it verified; on the first problem it raises CheckFailed with a message that
says what the code did, what was expected, and the likely cause. Checks compare with the
solution modules in snippets/ (same seeds, same weights) and recognise the usual mistakes by
computing them: a result that equals "the right formula without the scaling" is reported as
that, not as "wrong numbers"; a ring simulated with the wrong direction, a schedule with one
warm-up forward too many, a g that all-reduces in backward, ... are computed too, so that an
output matching one of them is named.

Checks that need processes run the learner's file on gloo processes through gang.run_learner: one
start per check, a deadlock (no rank computing for 5 s) reported with each waiting rank's call,
and a limit for a rank that never stops computing.
"""
