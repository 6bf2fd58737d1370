"""The GPU GRPO benchmark's logic (full-size-shaped model with LoRA, the batched SDE rollout, one GRPO iteration in
the ratio statistics, the JSON schema) as a CPU dry run on the tiny config, in `off` (the strict side of the same
code is the gate test's, `test_grpo_gate.py`; strict under the interpreter here would cost minutes)."""

import json
import math
import sys
from pathlib import Path


def test_benchmark_grpo_tiny_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_grpo.py"])
    import benchmark_grpo

    out = tmp_path / "grpo.json"
    benchmark_grpo.main(["--tiny", "--group", "2", "--passes", "1", "--rank", "2", "--modes", "off", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    assert doc["grpo"]["group"] == 2 and doc["grpo"]["batch_order"] == [0, 1] and doc["lora"]["rank"] == 2
    rows = {r["impl"]: r for r in doc["results"]}
    assert set(rows) == {"h3lab-off"}
    for r in rows.values():
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r)
        assert r["train_items"] == 2 and r["train_pass_s"] > 0 and r["rollout_pass_median_s"] > 0
        assert len(r["train_item_s"]) == 2 and r["train_pass_median_s"] == r["train_item_s"][1]  # first left out
        assert r["rollout_first_pass_s"] == r["rollout_pass_s"][0] and r["median_excludes"]
        assert r["ratio"]["count"] == 4 and len(r["ratios"]) == 2
    assert math.isfinite(rows["h3lab-off"]["ratio"]["max_abs"])
