"""The lesson's functions found in the reference and their bodies replaced by a TODO: a stub per exercise.

An exercise names its functions by the snippet section the docs show them in (``milestones/course/``), so the
stubs follow the reference wherever it changes.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from milestones.course import Exercise, Step
from milestones.exercise import PACKAGE_ROOT, SHARED


def reference_path(milestone: str, file: str) -> Path:
    """An exercise's file in the reference: in the milestone's package, or in the shared layer (``serving/...``)."""
    return PACKAGE_ROOT / file if file.startswith(f"{SHARED}/") else PACKAGE_ROOT / milestone / file


def section_lines(source: str, section: str) -> tuple[int, int]:
    """The first and last line (1-based) of the named snippet section (its start and end markers)."""
    marks = {m.group(1): number for number, line in enumerate(source.splitlines(), 1)
             if (m := re.search(rf"--8<-- \[(start|end):{section}\]", line))}
    if set(marks) != {"start", "end"}:
        raise LookupError(f"no snippet section {section!r}")
    return marks["start"], marks["end"]


def functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Every function of a module by its qualified name: ``grow`` at the top level, ``BlockManager.grow`` in a class."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}.{f.name}": f for f in node.body if isinstance(f, ast.FunctionDef)})
    return found


def wrap(text: str, width: int) -> list[str]:
    """``textwrap.wrap``, except that a `code span` is never broken across lines (a longer line rather)."""
    unbroken = re.sub(r"`[^`]*`", lambda span: span.group().replace(" ", "\0"), text)
    lines = textwrap.wrap(unbroken, width, break_long_words=False, break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines]


def todo_comment(milestone: str, step_number: int, step: Step, exercise: Exercise, hints: bool) -> list[str]:
    """The lines of a stub's TODO: the contract, then how to build it, unless hints are off (HINTS=0)."""
    lines = wrap(f"TODO({milestone}, step {step_number}, {step.name}): {exercise.todo}", 100)
    return lines + (wrap(f"How: {exercise.how}", 100) if hints and exercise.how else [])


def body_start(lines: list[str], node: ast.FunctionDef) -> int:
    """The 0-based index of the first line of the function's body that a stub replaces: the line after its docstring,
    else its first statement's, or the first of the comment lines right above that (a comment that opens a body
    tells what the body does: the answer)."""
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[0].end_lineno
    begin = body[0].lineno - 1
    while begin > node.lineno and lines[begin - 1].lstrip().startswith("#"):  # never the def line itself
        begin -= 1
    return begin


def stub(source: str, milestone: str, step_number: int, step: Step, exercise: Exercise, hints: bool = True) -> str:
    """The source with the exercise's function bodies replaced by a TODO and ``raise NotImplementedError``."""
    first, last = section_lines(source, exercise.section)
    defined = functions(ast.parse(source))
    lines = source.splitlines(keepends=True)
    for name in sorted(exercise.functions, key=lambda n: -defined[n].lineno):  # bottom up: line numbers stay valid
        node = defined[name]
        if not first < node.lineno < last:
            raise LookupError(f"{name} is not inside the snippet section {exercise.section!r}")
        begin = body_start(lines, node)  # 0-based index of the first body line
        indent = " " * node.body[0].col_offset
        message = f"{name} is yours to write (see its TODO in {exercise.file}); `make check M={milestone}` checks it"
        lines[begin : node.end_lineno] = [
            *(f"{indent}# {line}\n" for line in todo_comment(milestone, step_number, step, exercise, hints)),
            f"{indent}raise NotImplementedError({message!r})\n",
        ]
    return "".join(lines)
