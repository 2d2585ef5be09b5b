"""Execute every notebook under docs/notebooks/, so the walkthroughs can never rot.

The docs build renders the notebooks without running them (``execute: false`` in
mkdocs.yml), so the notebooks are stored *with* their outputs: that is what readers of the
site see. This test runs each notebook top to bottom in a fresh kernel started in the
repository root; any cell that raises fails the test, and so does any code cell whose text
outputs (stream text, and the ``text/plain`` of results and displays) differ from the
stored ones. Executing here does not write the notebooks back. When a change to the code
or to a notebook changes its outputs, refresh the stored outputs with

    .venv/bin/python -m tests.test_notebooks --refresh      (or: make notebooks-refresh)

and review the diff. Nothing in the outputs should vary between runs: the tiny models are
seeded, sampling is seeded, and the notebooks print no timings, memory addresses or
temporary paths. ``normalise`` still masks the two things that could creep in unnoticed
(``0x…`` addresses and ``/tmp/tmp…``-style temporary folders), and trailing whitespace.

The one exception is a measurement: a cell that times something or draws a timeline
(m5's eager against replayed steps, m6's traces) cannot give the same output twice. Such a
cell carries the tag ``varies`` in its metadata (``"metadata": {"tags": ["varies"]}``; in
JupyterLab, the property inspector's cell tags). It is still executed, and an exception in
it still fails the test, but its outputs are not compared (see ``VARIES``); the refresh
stores whatever it printed. Keep such cells few and small, and print everything that should
not change in the cells around them. Images (``image/png``) are never compared, only text.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
VARIES = "varies"  # the cell tag of a measurement: executed, its outputs not compared
REFRESH_HINT = "refresh the stored outputs with `.venv/bin/python -m tests.test_notebooks --refresh` " \
    "(or `make notebooks-refresh`) and review the diff"


class KernelError(RuntimeError):
    """The ``python3`` kernel is missing, or runs another interpreter than this one."""


def check_kernel() -> str:
    """The venv's ``python3`` kernel (``make setup`` registers it), checked to run this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        raise KernelError(
            "no 'python3' Jupyter kernel: run `.venv/bin/python -m ipykernel install --sys-prefix --name python3`"
        ) from None
    executable = Path(spec.argv[0])
    # jupyter_client starts a kernel whose command is plain 'python' or 'python3' with sys.executable;
    # a kernelspec with an absolute path must point into this environment, or the notebook sees other packages.
    if executable.is_absolute() and executable.parent != Path(sys.executable).parent:
        raise KernelError(
            f"the 'python3' kernel runs {executable}, not this environment's {sys.executable}; "
            "run `.venv/bin/python -m ipykernel install --sys-prefix --name python3`"
        )
    return "python3"


def kernel_name() -> str:
    try:
        return check_kernel()
    except KernelError as err:
        pytest.fail(str(err))


def execute(notebook: Path, kernel: str):
    """Run ``notebook`` top to bottom in a fresh kernel whose working directory is the repository root.

    Returns the executed notebook; raises ``nbclient.exceptions.CellExecutionError`` if a cell raises.
    """
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        record_timing=False,  # no per-cell timestamps in the cells' metadata
        resources={"metadata": {"path": str(REPO_ROOT)}},  # the kernel's working directory
    )
    client.execute(cwd=str(REPO_ROOT))
    return nb


def merge_streams(outputs: list) -> list:
    """Adjacent stream outputs of the same name joined into one: how a print is split is a matter of timing."""
    merged = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1]["name"] == out["name"]:
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
TEMP_DIR = re.compile(r"/(?:private/)?(?:var/folders/[^\s'\"]+|tmp)/[^\s'\"]+")


def normalise(text: str) -> str:
    """Mask what may legitimately differ between runs: memory addresses and temporary paths (ideally none occur)."""
    text = ADDRESS.sub("0x…", text)
    text = TEMP_DIR.sub("<tmp>", text)
    return "\n".join(line.rstrip() for line in text.splitlines())


def text_outputs(cell) -> str:
    """A code cell's text outputs, in order, one labelled block each."""
    blocks = []
    for out in merge_streams([dict(o) for o in cell.get("outputs", [])]):
        kind = out.get("output_type")
        if kind == "stream" and out["name"] == "stderr":
            continue  # the environment's: a kernel being built on first use, a library's warning; never stored
        if kind == "stream":
            blocks.append(f"[{out['name']}]\n{out['text']}")
        elif kind in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
            blocks.append(f"[{kind}]\n{out['data']['text/plain']}")
        elif kind == "error":
            blocks.append(f"[error] {out.get('ename')}: {out.get('evalue')}")
    return normalise("\n".join(blocks))


def compare_outputs(stored, executed, name: str) -> list[str]:
    """One message per code cell whose executed text outputs differ from the stored ones."""
    problems = []
    if len(stored.cells) != len(executed.cells):
        return [f"{name}: {len(stored.cells)} cells stored, {len(executed.cells)} executed"]
    for index, (old, new) in enumerate(zip(stored.cells, executed.cells)):
        if old.cell_type != "code" or VARIES in old.get("metadata", {}).get("tags", []):
            continue  # text is compared in code cells, except measurements (the module's docstring)
        before, after = text_outputs(old), text_outputs(new)
        if before != after:
            diff = list(difflib.unified_diff(before.splitlines(), after.splitlines(), "stored", "executed",
                                             lineterm=""))
            shown = "\n".join(diff[:30]) + ("\n…" if len(diff) > 30 else "")
            problems.append(f"{name}, cell {index}: outputs differ from the stored ones\n{shown}")
    return problems


def tidy(nb):
    """What is stored: outputs with adjacent streams merged, no per-cell execution metadata."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in merge_streams([dict(o) for o in cell.outputs])]
            cell.metadata.pop("execution", None)
    return nb


def refresh(notebooks: list[Path]) -> None:
    """Re-execute ``notebooks`` and write them back with their outputs (sources and notebook metadata kept)."""
    kernel = check_kernel()
    for path in notebooks:
        print(f"executing {path.relative_to(REPO_ROOT)} …", flush=True)
        stored = nbformat.read(path, as_version=4)
        executed = tidy(execute(path, kernel))
        for old, new in zip(stored.cells, executed.cells):
            if old.cell_type == "code":
                old.outputs, old.execution_count = new.outputs, new.execution_count
                old.metadata.pop("execution", None)
        nbformat.write(stored, path)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_notebook_runs_and_stored_outputs_are_current(notebook: Path):
    name = str(notebook.relative_to(REPO_ROOT))
    try:
        executed = execute(notebook, kernel_name())
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{name}: a cell raised\n{err}", pytrace=False)
    stored = nbformat.read(notebook, as_version=4)
    problems = compare_outputs(stored, executed, name)
    if problems:
        pytest.fail("\n\n".join(problems) + f"\n\nIf the new outputs are right, {REFRESH_HINT}.", pytrace=False)


def test_stored_notebooks_are_tidy():
    """Every code cell has been run (the site shows outputs) and carries no per-cell timing metadata."""
    for notebook in NOTEBOOKS:
        nb = nbformat.read(notebook, as_version=4)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            assert cell.execution_count is not None, f"{notebook.name}, cell {index} was never run: {REFRESH_HINT}"
            assert "execution" not in cell.metadata, (
                f"{notebook.name}, cell {index} has timing metadata: {REFRESH_HINT}"
            )


def test_the_outputs_of_a_cell_tagged_varies_are_not_compared():
    """A measurement (tag ``varies``) may print something else on every run; any other code cell may not."""
    def notebook(printed: str, tags: list[str]):
        cell = nbformat.v4.new_code_cell("print(time.perf_counter())", metadata={"tags": tags})
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
        nb = nbformat.v4.new_notebook()
        nb.cells = [cell]
        return nb

    assert compare_outputs(notebook("1.5\n", [VARIES]), notebook("2.5\n", [VARIES]), "nb") == []
    assert compare_outputs(notebook("1.5\n", []), notebook("2.5\n", []), "nb")


def test_there_is_a_notebook():
    assert NOTEBOOKS, "expected at least one notebook under docs/notebooks/"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Re-execute the notebooks and store their outputs.")
    parser.add_argument("--refresh", action="store_true", help="execute and write the notebooks back with outputs")
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to refresh (default: all)")
    args = parser.parse_args()
    if not args.refresh:
        parser.error("nothing to do: pass --refresh (the checks run under pytest)")
    try:
        refresh([p.resolve() for p in args.notebooks] or NOTEBOOKS)
    except KernelError as err:
        sys.exit(str(err))
    except nbclient.exceptions.CellExecutionError as err:
        sys.exit(f"a cell raised; nothing more was written\n{err}")
