"""What a lesson is made of: exercises, the steps that check them, and the contract step every lesson ends with.

Apart from ``milestones/course/__init__.py`` so that each milestone's module imports them with no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Exercise:
    file: str  # in the milestone's package, or in the skeleton's copy of the shared layer (serving/...)
    section: str  # the snippet section (as the docs include it) that holds the functions
    functions: tuple[str, ...]  # qualified names, e.g. "BlockManager.grow"
    todo: str  # the contract: what goes in, what comes out, the rule (all a TODO says with HINTS=0)
    how: str = ""  # the hint: how to build it, step by step (the TODO's "How:" paragraph, left out with HINTS=0)


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    tests: tuple[str, ...]  # pytest arguments, relative to the repository root
    hint: str  # what to look at when this step fails
    exercises: tuple[Exercise, ...] = ()  # what this step is the first to check
    # A serving feature after the core (penalties, log-probabilities): its functions come filled in, and the core
    # steps never call them, unless the learner asks for them too (``make exercise EXTRAS=1``).
    optional: bool = False


def contract(milestone: str) -> Step:
    return Step("the contract of every milestone", ("tests/contract",),
                f"{milestone} keeps the public API and its promises (errors, streaming, aborts): see docs/promises.md")
