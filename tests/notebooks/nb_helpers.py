"""Helpers of the notebook-room tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = REPO / "test-artifacts"
TINY_REQUEST = dict(width=64, height=64, frames=22, steps=2, mode="off")

NAMES = ["01_quickstart", "02_strict_vs_production", "03_ablation_matrix", "04_performance",
         "05_reward_weighted_update", "06_grpo"]
CELL_TIMEOUT_S = 300


def with_parameters(nb: nbformat.NotebookNode, parameters: dict[str, object]) -> nbformat.NotebookNode:
    """`nb` with a cell assigning `parameters` inserted after its cell tagged "parameters" (papermill's convention:
    the notebook's own defaults stay visible, the injected cell overrides them). Every name must be assigned in the
    tagged cell, so a misspelt parameter fails instead of being ignored."""
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters' (need exactly one)"
    declared = nb.cells[tagged[0]].source
    for key in parameters:
        assert re.search(rf"^{re.escape(key)} = ", declared, re.M), f"{key!r} is not a parameter of this notebook"
    source = "\n".join(f"{key} = {value!r}" for key, value in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, cell)
    return nb


def execute(name: str, **parameters: object) -> nbformat.NotebookNode:
    """Run notebook `name` top to bottom in a fresh kernel; `parameters` override its "parameters" cell."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if parameters:
        nb = with_parameters(nb, parameters)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    return nb


def outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def text_of(nb) -> str:
    parts = []
    for o in outputs(nb):
        parts.append(o.get("text", ""))
        parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb))


def stderr(nb) -> list[str]:
    """What a reader would see in red: stderr streams (warnings included) and error outputs."""
    return [o.get("text", "") or o.get("ename", "") for o in outputs(nb)
            if o.get("name") == "stderr" or o.get("output_type") == "error"]


def long_lines(nb, width: int = 110) -> list[str]:
    """Printed lines a notebook cell would wrap."""
    return [line for o in outputs(nb) for line in o.get("text", "").splitlines()
            if len(line) > width and not line.startswith("skipped (")]  # the one summary line names every file



def write_benchmark_sample(folder: Path) -> dict[str, object]:
    """A results folder as benchmarks/ writes it: one complete document (with a failed entry), one document that
    lacks required keys, and one file that is not JSON. Returns what a reader must find."""
    folder.mkdir(parents=True, exist_ok=True)
    good = {
        "name": "forward_sample", "date": "2025-01-01T00:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11.0",
        "triton": "3.6.0", "git_rev": "abc1234", "command": "python benchmarks/benchmark_forward.py",
        "results": [
            {"shape": "512x512x22f", "rows": 2066, "impl": "diffusers", "median_s": 0.25, "runs": 5,
             "peak_mem_gib": 70.5},
            {"shape": "512x512x22f", "rows": 2066, "impl": "h3lab-strict", "median_s": 0.31, "runs": 5,
             "peak_mem_gib": 71.0},
            {"shape": "768x768x121f", "rows": 21000, "impl": "diffusers", "median_s": 2.5, "runs": 5,
             "peak_mem_gib": 90.0},
            {"shape": "768x768x121f", "rows": 21000, "impl": "h3lab-strict", "error": "StrictError: shape refused"},
        ],
    }
    partial = {"name": "gemm_partial", "date": "2025-01-02", "results": []}
    # A tile sweep: a complete header, but 30 result entries with their own keys (no shape/impl/runs/peak).
    sweep = {**{k: good[k] for k in good if k != "results"}, "name": "gemm_sweep",
             "results": [{"median_s": 1e-4 * (i + 1), "proj": "o_proj", "tile": f"BLOCK={i}"} for i in range(30)]}
    (folder / "forward_sample.json").write_text(json.dumps(good), encoding="utf-8")
    (folder / "gemm_partial.json").write_text(json.dumps(partial), encoding="utf-8")
    (folder / "gemm_sweep.json").write_text(json.dumps(sweep), encoding="utf-8")
    (folder / "broken.json").write_text("{not json", encoding="utf-8")
    return {"good": good, "skipped": ["broken.json", "gemm_partial.json", "gemm_sweep.json"]}
