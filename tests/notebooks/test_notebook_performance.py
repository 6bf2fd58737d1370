"""04_performance runs against the committed results folder and against a sample folder written to a temp dir."""

from __future__ import annotations

import inspect
import math

from nb_helpers import NOTEBOOKS, execute, images, long_lines, stderr, text_of, write_benchmark_sample


def test_performance_runs_on_the_repository_folder():
    from h3lab.research import plots

    nb = execute("04_performance")  # the committed results, whatever is there (possibly nothing yet)
    docs, problems = plots.load_benchmarks(NOTEBOOKS.parent / "benchmarks" / "results")
    # the summary, one figure per file and page of at most `max_cases` cases, counted from the rows (building every
    # figure again here only to count them cost ~11 s CPU and trusted benchmark_figures' own paging)
    per_page = inspect.signature(plots.benchmark_figures).parameters["max_cases"].default
    pages = [max(1, math.ceil(len({r["case"].split(" #")[0] for r in plots.benchmark_rows([d])}) / per_page))
             for d in docs]
    assert images(nb) == 1 + sum(pages)
    text = text_of(nb)
    assert text.count("skipped") <= 1 and "nan" not in text.split()
    assert stderr(nb) == [] and long_lines(nb) == []


def test_performance_runs_on_a_sample_folder(tmp_path, monkeypatch):
    sample = write_benchmark_sample(tmp_path / "results")
    monkeypatch.setenv("H3LAB_BENCHMARK_RESULTS", str(tmp_path / "results"))
    nb = execute("04_performance")
    text = text_of(nb)
    assert "1 benchmark file(s)" in text
    skipped = [line for line in text.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("skipped (not in the DESIGN schema): ")  # one line
    assert all(name in skipped[0] for name in sample["skipped"])
    assert "forward_sample.json (baseline: diffusers)" in text and "1.240" in text  # 0.31 / 0.25, same run
    assert "nan" not in text.split()
    assert images(nb) == 2  # the summary and the one file's figure
    assert stderr(nb) == []
