"""The notebooks under notebooks/ are stored clean and run top to bottom without an error.

Each notebook is executed in a fresh Jupyter kernel (nbclient, kernel "python3") on a copy, from a
temporary working directory; the stored file is never modified. On CPU the Triton kernels run in
the interpreter, so the notebooks use tiny shapes; each takes well under a minute.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_quickstart.ipynb", "02_kernel_playground.ipynb", "03_scheduler_timeline.ipynb"]


def test_all_notebooks_found() -> None:
    assert [p.name for p in NOTEBOOKS][:len(EXPECTED)] == EXPECTED


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)

    # Stored clean: no outputs, no execution counts (strip them before committing).
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has stored outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"

    # The kernel must import this checkout of pocketllm even where it is not pip-installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))

    executed = copy.deepcopy(nb)
    client = nbclient.NotebookClient(executed, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first cell that errors
    elapsed = time.perf_counter() - start
    print(f"{path.name}: executed in {elapsed:.1f} s")

    for i, cell in enumerate(executed.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, f"{path.name} cell {i}: {errors[0].ename}: {errors[0].evalue}"
