"""The GPU LoRA benchmark's logic (model, adapter, request, both modes, repeatability, JSON schema) as a CPU smoke."""

import json
import sys
from pathlib import Path


def test_benchmark_lora_tiny_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_lora.py"])
    import benchmark_lora

    out = tmp_path / "lora.json"
    benchmark_lora.main(["--tiny", "--runs", "1", "--rank", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    assert doc["lora"]["rank"] == 2 and doc["lora"]["modules"] == 12 and doc["ratio_strict_over_off"] > 0
    rows = {r["impl"]: r for r in doc["results"]}
    assert set(rows) == {"h3lab-strict", "h3lab-off"}
    for r in rows.values():
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    strict = rows["h3lab-strict"]
    assert strict["grad_repeat_equal"] is True and strict["non_strict_calls"] == 0
    assert strict["op_calls"]["gated_residual"] >= 12  # the LoRA combines ran through the op table


def test_benchmark_lora_step_graph_smoke(tmp_path, monkeypatch):
    """--step-graph on the CPU: the byte check and the three rows run (the graph path says why it is eager here)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_lora.py"])
    import benchmark_lora

    out = tmp_path / "lora.json"
    benchmark_lora.main(["--tiny", "--step-graph", "--check-steps", "3", "--runs", "1", "--rank", "2",
                         "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["impl"] for r in doc["results"]] == ["h3lab-strict-eager", "h3lab-strict", "h3lab-off"]
    assert doc["grad_bytes_equal_graph_vs_eager"] is True and doc["steps_differ"] is True
    assert len(doc["grad_sha256_graph_steps"]) == 3
    assert doc["graph_paths"][0] == {"cuda_graph": "eager", "reason": "inputs not on a CUDA device",
                                     "scope": "training micro-batch"}
    assert doc["ratio_strict_over_off"] > 0 and doc["speedup_graph_over_eager"] > 0
    switch = doc["adapter_switch"]
    assert switch["off_equals_eager_off"] and switch["off_differs_from_on"] and switch["on_graph_equals_eager"]
    assert len(doc["check_step_seconds_graph"]) == 3
