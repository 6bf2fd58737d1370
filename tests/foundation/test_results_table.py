"""The README's headline numbers are generated from `benchmarks/results/` (`scripts/results_table.py`): its block
equals the script's output, and every result file the README and the guides name exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
# JSON files the documents name as parts of a folder's format (a job, a sealed artifact, a snapshot), not results
FORMATS = {"manifest.json", "job.json", "config.json", "adapter_config.json", "state.json",
           "modular_model_index.json", "h3lab_native.json"}


def _script():
    spec = importlib.util.spec_from_file_location("results_table", REPO / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_the_scripts_output():
    table = _script()
    assert table.readme_block(table.README.read_text(encoding="utf-8")) == table.render(), (
        "README.md's results table differs from benchmarks/results/: run python scripts/results_table.py")


def test_the_check_mode_agrees():
    assert _script().main(["--check"]) == 0


def test_every_result_file_the_documents_name_exists():
    documents = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    named = re.compile(r"(?<![\w./-])((?:archive/)?[a-z0-9_]+(?:-[0-9a-f]{7})?\.json)\b")
    missing = []
    for doc in documents:
        for name in set(named.findall(doc.read_text(encoding="utf-8"))) - FORMATS:
            if not (RESULTS / name).is_file() and not (REPO / "docs" / name).is_file():
                missing.append(f"{doc.relative_to(REPO)}: {name}")
    assert not missing, "named result files that do not exist: " + ", ".join(sorted(set(missing)))
