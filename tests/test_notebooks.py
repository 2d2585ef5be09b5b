"""Execute every notebook under docs/notebooks/, so the walkthroughs can never rot.

The docs build renders the notebooks without running them (``execute: false`` in
mkdocs.yml); this test runs them instead, top to bottom, in a fresh kernel started in
the repository root. Any cell that raises fails the test. The notebooks are stored
without outputs, and executing them here does not write them back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO_ROOT / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def kernel_name() -> str:
    """The venv's ``python3`` kernel (``make setup`` registers it), checked to run this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail(
            "no 'python3' Jupyter kernel: run `.venv/bin/python -m ipykernel install --sys-prefix --name python3`"
        )
    executable = Path(spec.argv[0])
    # jupyter_client starts a kernel whose command is plain 'python' or 'python3' with sys.executable;
    # a kernelspec with an absolute path must point into this environment, or the notebook sees other packages.
    if executable.is_absolute():
        assert executable.parent == Path(sys.executable).parent, (
            f"the 'python3' kernel runs {executable}, not this environment's {sys.executable}; "
            "run `.venv/bin/python -m ipykernel install --sys-prefix --name python3`"
        )
    return "python3"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.name for nb in NOTEBOOKS])
def test_notebook_runs_without_errors(notebook: Path):
    nb = nbformat.read(notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name(),
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(REPO_ROOT)}},  # the kernel's working directory
    )
    try:
        client.execute(cwd=str(REPO_ROOT))
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(f"{notebook.relative_to(REPO_ROOT)}: a cell raised\n{err}", pytrace=False)


def test_there_is_a_notebook():
    assert NOTEBOOKS, "expected at least one notebook under docs/notebooks/"
