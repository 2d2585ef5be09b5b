"""Each milestone's lesson as exercises: the functions a learner writes, and the steps of tests that check them.

An ``Exercise`` names a snippet section of a reference file (the code the milestone's
page shows) and the functions inside it whose bodies are the lesson; ``python -m
milestones.exercise start`` replaces those bodies by ``raise NotImplementedError``.
A ``Step`` is a group of tests, ordered from the smallest piece to the whole engine:
a learner passes them one at a time. The last steps of every milestone compare the
engine with the reference m(K-1), token for token, and run the contract.

Course text, not engine code: ``Exercise``, ``Step`` and ``contract`` live in ``steps.py``, and
milestone mK's steps in ``mK.py``, as ``STEPS`` inside the snippet section ``mK`` that its page
includes (docs/hooks/diffs.py reads that file too). A new milestone's lesson is one more module,
named after the milestone, imported below with its line in ``LESSONS``.
"""

from __future__ import annotations

from milestones.course import m1, m2, m3, m4, m5, m6, m7, m8, m9
from milestones.course.steps import Exercise, Step, contract

__all__ = ["LESSONS", "Exercise", "Step", "contract"]

LESSONS: dict[str, tuple[Step, ...]] = {
    "m1": m1.STEPS,
    "m2": m2.STEPS,
    "m3": m3.STEPS,
    "m4": m4.STEPS,
    "m5": m5.STEPS,
    "m6": m6.STEPS,
    "m7": m7.STEPS,
    "m8": m8.STEPS,
    "m9": m9.STEPS,
}
