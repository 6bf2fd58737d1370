"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (nbclient; any cell error fails the test), on
the embedded tiny snapshot, and is stored without outputs. The performance notebook also runs against a sample
results folder written to a temp dir."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from nb_helpers import NOTEBOOKS, write_benchmark_sample

NAMES = ["01_quickstart", "02_strict_vs_production", "03_ablation_matrix", "04_performance",
         "05_reward_weighted_update"]
CELL_TIMEOUT_S = 300


def _execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    return nb


def _outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(nb) -> str:
    parts = []
    for o in _outputs(nb):
        parts.append(o.get("text", ""))
        parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in _outputs(nb))


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


def test_quickstart_runs():
    nb = _execute("01_quickstart")
    text = _text(nb)
    assert "t2va seed 42, 64x64, 22 frames" in text and "digest" in text
    assert _images(nb) == 3  # latent strip, norms, sigma grids
    html = [o["data"]["text/html"] for o in _outputs(nb) if "text/html" in o.get("data", {})]
    assert any("<video" in h and "data:video/mp4;base64" in h for h in html)
    widgets = [o for o in _outputs(nb) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets, "the Workbench panel was not displayed"


def test_strict_vs_production_runs():
    nb = _execute("02_strict_vs_production")
    text = _text(nb)
    assert "strict repeat: byte-equal at every pass" in text
    assert "first drift:" in text
    assert _images(nb) == 2


def test_ablation_matrix_runs():
    nb = _execute("03_ablation_matrix")
    text = _text(nb)
    assert "rows:" in text and "H-C7" in text
    assert _images(nb) >= 1


def test_performance_runs_on_the_repository_folder():
    nb = _execute("04_performance")  # the committed results, whatever is there (possibly nothing yet)
    assert _images(nb) == 1


def test_performance_runs_on_a_sample_folder(tmp_path, monkeypatch):
    sample = write_benchmark_sample(tmp_path / "results")
    monkeypatch.setenv("H3LAB_BENCHMARK_RESULTS", str(tmp_path / "results"))
    nb = _execute("04_performance")
    text = _text(nb)
    assert "1 benchmark file(s)" in text
    for skipped in sample["skipped"]:
        assert f"skipped: {skipped}" in text
    assert "forward_sample" in text and "1.240" in text  # 0.31 / 0.25, the ratio to Diffusers
    assert _images(nb) == 1


def test_reward_weighted_update_runs():
    nb = _execute("05_reward_weighted_update")
    text = _text(nb)
    assert "8 requests" in text and "no transition log-probabilities" in text
    assert "trajectory hash differs" in text and "verify: OK: 2/2 passes byte-equal" in text
