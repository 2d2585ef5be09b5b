"""The scheduling side of every milestone (scheduler, a step's records, later block manager and radix tree) never
imports torch.

Checked on the source: follow the milestone's own relative imports from the module and
make sure none of them imports torch at run time (imports under TYPE_CHECKING are hints only).
"""

from __future__ import annotations

import ast
from pathlib import Path

TORCH_FREE = ["scheduler.py", "sequence.py", "block_manager.py", "radix_tree.py", "step.py", "proposer.py"]


def runtime_imports(path: Path) -> tuple[set[str], set[str]]:
    """(absolute modules, sibling modules) imported by the file outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    absolute, siblings = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            absolute |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                siblings.add(f"{node.module}.py")
            elif node.module:
                absolute.add(node.module.split(".")[0])
    return absolute, siblings


def test_scheduling_modules_do_not_import_torch(mod, milestone):
    folder = Path(mod.__file__).parent  # the package under test (a learner's, with `make check`)
    todo = [name for name in TORCH_FREE if (folder / name).exists()]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        absolute, siblings = runtime_imports(folder / name)
        assert not absolute & {"torch", "numpy", "transformers"}, f"{milestone}/{name} imports {absolute}"
        todo += siblings
    assert "scheduler.py" in seen
