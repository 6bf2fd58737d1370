"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (nbclient; any cell error fails the test), on
the embedded tiny snapshot, and is stored without outputs. The performance notebook also runs against a sample
results folder written to a temp dir."""

from __future__ import annotations

import inspect
import math

import nbformat
from nbclient import NotebookClient

from nb_helpers import NOTEBOOKS, write_benchmark_sample

NAMES = ["01_quickstart", "02_strict_vs_production", "03_ablation_matrix", "04_performance",
         "05_reward_weighted_update", "06_grpo"]
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


def _stderr(nb) -> list[str]:
    """What a reader would see in red: stderr streams (warnings included) and error outputs."""
    return [o.get("text", "") or o.get("ename", "") for o in _outputs(nb)
            if o.get("name") == "stderr" or o.get("output_type") == "error"]


def _long_lines(nb, width: int = 110) -> list[str]:
    """Printed lines a notebook cell would wrap."""
    return [line for o in _outputs(nb) for line in o.get("text", "").splitlines()
            if len(line) > width and not line.startswith("skipped (")]  # the one summary line names every file


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
    assert "what ran: off: 0 strict / " in text and "strict on cpu: Triton's interpreter" in text
    assert any('width="384"' in h for h in html)  # a 64 px clip shown at a size where its controls fit
    assert _stderr(nb) == []  # no FutureWarning in red


def test_strict_vs_production_runs():
    nb = _execute("02_strict_vs_production")
    text = _text(nb)
    assert "strict repeat: byte-equal at every pass" in text
    assert "first drift:" in text
    assert _images(nb) == 2
    assert "strict: " in text and " strict / 0 torch op calls" in text and "off: 0 strict / " in text
    assert _stderr(nb) == []


def test_ablation_matrix_runs():
    nb = _execute("03_ablation_matrix")
    text = _text(nb)
    assert "rows:" in text and "H-C7" in text
    assert _images(nb) == 2  # the table, one row's drift heatmaps
    assert _long_lines(nb) == [] and _stderr(nb) == []


def test_performance_runs_on_the_repository_folder():
    from h3lab import plots

    nb = _execute("04_performance")  # the committed results, whatever is there (possibly nothing yet)
    docs, problems = plots.load_benchmarks(NOTEBOOKS.parent / "benchmarks" / "results")
    # the summary, one figure per file and page of at most `max_cases` cases, counted from the rows (building every
    # figure again here only to count them cost ~11 s CPU and trusted benchmark_figures' own paging)
    per_page = inspect.signature(plots.benchmark_figures).parameters["max_cases"].default
    pages = [max(1, math.ceil(len({r["case"].split(" #")[0] for r in plots.benchmark_rows([d])}) / per_page))
             for d in docs]
    assert _images(nb) == 1 + sum(pages)
    text = _text(nb)
    assert text.count("skipped") <= 1 and "nan" not in text.split()
    assert _stderr(nb) == [] and _long_lines(nb) == []


def test_performance_runs_on_a_sample_folder(tmp_path, monkeypatch):
    sample = write_benchmark_sample(tmp_path / "results")
    monkeypatch.setenv("H3LAB_BENCHMARK_RESULTS", str(tmp_path / "results"))
    nb = _execute("04_performance")
    text = _text(nb)
    assert "1 benchmark file(s)" in text
    skipped = [line for line in text.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("skipped (not in the DESIGN schema): ")  # one line
    assert all(name in skipped[0] for name in sample["skipped"])
    assert "forward_sample.json (baseline: diffusers)" in text and "1.240" in text  # 0.31 / 0.25, same run
    assert "nan" not in text.split()
    assert _images(nb) == 2  # the summary and the one file's figure
    assert _stderr(nb) == []


def test_reward_weighted_update_runs():
    nb = _execute("05_reward_weighted_update")
    text = _text(nb)
    assert "8 requests" in text and "no transition log-probabilities" in text
    assert "trajectory hash differs" in text and "verify: OK: 2/2 passes byte-equal" in text


def test_grpo_runs():
    nb = _execute("06_grpo")
    text = _text(nb)
    assert "iteration 0: on-policy ratio - 1 in [0, 0] (8/8 exactly 1)" in text
    assert "verify: OK: 3/3 GRPO iterations byte-equal" in text
    assert _images(nb) == 1 and _stderr(nb) == [] and _long_lines(nb) == []
