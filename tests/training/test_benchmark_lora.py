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
