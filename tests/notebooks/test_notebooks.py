"""Every notebook in notebooks/ is stored without outputs (one file per notebook runs it: test_notebook_*.py,
so pytest-xdist's loadscope spreads the notebooks over the workers)."""

from __future__ import annotations

import nbformat
import pytest

from nb_helpers import NAMES, NOTEBOOKS, with_parameters


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


def test_parameters_are_injected_after_the_tagged_cell_and_must_be_declared():
    nb = nbformat.read(NOTEBOOKS / "02_strict_vs_production.ipynb", as_version=4)
    tagged = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    assert "snapshot = None" in nb.cells[tagged].source
    cells = len(nb.cells)
    with_parameters(nb, {"snapshot": "/some/folder"})
    assert len(nb.cells) == cells + 1
    assert nb.cells[tagged + 1].source == "snapshot = '/some/folder'"
    assert nb.cells[tagged + 1].metadata["tags"] == ["injected-parameters"]
    with pytest.raises(AssertionError, match="'snapshots' is not a parameter"):
        with_parameters(nbformat.read(NOTEBOOKS / "02_strict_vs_production.ipynb", as_version=4), {"snapshots": 1})
    with pytest.raises(AssertionError, match="0 cells tagged"):
        with_parameters(nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4), {"snapshot": 1})
