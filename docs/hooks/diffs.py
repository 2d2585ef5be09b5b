"""MkDocs hook: put the real diff between two milestones into a page, so it can never drift.

Two marker lines are replaced, each on a line of its own:

``<!-- diff m2 m3 scheduler.py -->``
    a fenced ``diff`` block with the unified diff (3 lines of context) of
    ``milestones/m2/scheduler.py`` against ``milestones/m3/scheduler.py``, labelled
    ``m2/scheduler.py`` and ``m3/scheduler.py``. A file that the older milestone does
    not have is shown as a new file, diffed against ``/dev/null``.

    When the file holds functions of the newer milestone's exercise (``milestones/course/m3.py``), the block is
    folded in a collapsed ``??? example``: it shows their bodies, the answers.

``<!-- changed-files m3 -->``
    a bullet list of ``milestones.CHANGED_FILES["m3"]``, new files marked as such.

On a page of the Chinese edition (``m3.zh.md``) the folded block's title and the "new file" mark are in Chinese.

The ``# --8<--`` (and, in C++, ``// --8<--``) snippet-section marker lines are dropped from both files before
diffing, so the diff shows only code (and pymdownx.snippets never sees them).

Anything wrong (an unknown milestone, a missing file, two identical files, a marker
with the wrong number of arguments) raises ``PluginError``, so ``mkdocs build
--strict`` fails instead of rendering an empty section. ``CHANGED_FILES`` is read by
parsing ``milestones/__init__.py`` next to ``mkdocs.yml``, so the page always shows
the checkout being built, whichever copy of the package Python would import.
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^[ \t]*<!--[ \t]*(diff|changed-files)\b(.*?)-->[ \t]*$", re.MULTILINE)
SNIPPET_LINE = re.compile(r"^\s*(#|//)\s*--8<--")
WORDS = {
    "en": {"answers": "The diff of {name} (the lesson's answers: open once you have written yours)",
           "new": " (new file)"},
    "zh": {"answers": "{name} 的 diff（本课练习的答案：写完自己的版本后再展开）", "new": "（新文件）"},
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).resolve().parent
    where = page.file.src_uri
    words = WORDS["zh" if where.endswith(".zh.md") else "en"]  # the Chinese edition's page gets its own words

    def replace(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split()
        try:
            if kind == "diff":
                if len(args) != 3:
                    raise PluginError("expected <!-- diff OLD NEW FILE -->")
                return diff_block(root, *args, words)
            if len(args) != 1:
                raise PluginError("expected <!-- changed-files MILESTONE -->")
            return changed_files_list(root, args[0], words)
        except PluginError as err:
            raise PluginError(f"{where}: marker {match.group(0).strip()!r}: {err}") from None

    return MARKER.sub(replace, markdown)


def milestones_module(root: Path) -> dict[str, object]:
    """``MILESTONES`` and ``CHANGED_FILES`` from milestones/__init__.py, without importing it."""
    path = root / "milestones" / "__init__.py"
    if not path.is_file():
        raise PluginError(f"{path} not found")
    values = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in ("MILESTONES", "CHANGED_FILES") and node.value is not None:
            values[target.id] = ast.literal_eval(node.value)
    if set(values) != {"MILESTONES", "CHANGED_FILES"}:
        raise PluginError(f"{path} must define MILESTONES and CHANGED_FILES as literals")
    return values


def milestone_dir(root: Path, milestone: str) -> Path:
    known = milestones_module(root)["MILESTONES"]
    if milestone not in known:
        raise PluginError(f"unknown milestone {milestone!r}; milestones.MILESTONES is {known}")
    folder = root / "milestones" / milestone
    if not folder.is_dir():
        raise PluginError(f"{folder} does not exist")
    return folder


def code_lines(path: Path) -> list[str]:
    """The file's lines without the snippet-section markers."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if not SNIPPET_LINE.match(line)]


def diff_block(root: Path, old: str, new: str, name: str, words: dict[str, str]) -> str:
    old_path, new_path = milestone_dir(root, old) / name, milestone_dir(root, new) / name
    if not new_path.is_file():
        raise PluginError(f"{new_path.relative_to(root)} does not exist")
    if old_path.is_file():
        before, label = code_lines(old_path), f"{old}/{name}"
    else:  # a file the milestone adds: the whole file, as a diff from nothing
        before, label = [], "/dev/null"
    diff = list(difflib.unified_diff(before, code_lines(new_path), label, f"{new}/{name}", n=3, lineterm=""))
    if not diff:
        raise PluginError(f"{old}/{name} and {new}/{name} are identical: there is no diff to show")
    fence = "`" * max(3, 1 + max(len(run) for run in re.findall(r"`+", "\n".join(diff)) or [""]))
    block = [f"{fence}diff", *diff, fence]
    if name not in lesson_files(root, new):
        return "\n".join(block)
    # It holds the bodies a learner of this milestone writes: folded, like the chapter's listings of them.
    title = words["answers"].format(name=name)
    return "\n".join([f'??? example "{title}"', "", *(f"    {line}" if line else "" for line in block)])


def lesson_files(root: Path, milestone: str) -> set[str]:
    """The files of the milestone's exercises, as milestones/course/<milestone>.py declares them (read, not imported,
    like CHANGED_FILES: the checkout being built). A milestone with no lesson module has none."""
    path = root / "milestones" / "course" / f"{milestone}.py"
    if not path.is_file():
        return set()
    return {call.args[0].value for call in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Exercise"
            and isinstance(call.args[0], ast.Constant)}


def changed_files_list(root: Path, milestone: str, words: dict[str, str]) -> str:
    folder = milestone_dir(root, milestone)
    values = milestones_module(root)
    changed = values["CHANGED_FILES"].get(milestone)
    if not changed:
        raise PluginError(f"milestones.CHANGED_FILES has no files for {milestone!r}")
    known = values["MILESTONES"]
    index = known.index(milestone)
    previous = root / "milestones" / known[index - 1] if index else None
    items = []
    for name in sorted(changed):
        if not (folder / name).is_file():
            raise PluginError(
                f"CHANGED_FILES[{milestone!r}] lists {name}, but milestones/{milestone}/{name} does not exist"
            )
        is_new = previous is None or not (previous / name).is_file()
        items.append(f"- `{name}`" + (words["new"] if is_new else ""))
    return "\n".join(items)
