"""The GPU attention-view benchmark's logic (layout, regions, the strict baseline, every view case, the JSON schema)
as a CPU smoke on the tiny shape."""

import json
import sys
from pathlib import Path


def test_benchmark_attention_view_tiny_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention_view.py"])
    import benchmark_attention_view

    out = tmp_path / "attention_view.json"
    benchmark_attention_view.main(["--tiny", "--runs", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    impls = [r["impl"] for r in doc["results"]]
    assert impls == ["h3lab-strict", "view-all-heads", "view-all-heads", "view-8-heads", "view-text-queries"]
    for r in doc["results"]:
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    views = doc["results"][1:]
    assert all(r["max_row_sum_error"] < 1e-12 and r["ratio_vs_strict_attention"] > 0 for r in views)
    assert views[0]["query_rows"] == doc["results"][0]["rows"] and views[3]["query_rows"] == 12
