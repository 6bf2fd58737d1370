"""Every notebook in notebooks/ is stored without outputs (one file per notebook runs it: test_notebook_*.py,
so pytest-xdist's loadscope spreads the notebooks over the workers)."""

from __future__ import annotations

import nbformat

from nb_helpers import NAMES, NOTEBOOKS


def test_notebooks_are_stored_without_outputs():
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == NAMES
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name}: cell {cell.id} has outputs"
