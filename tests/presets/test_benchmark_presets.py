"""benchmarks/benchmark_presets.py's CPU smoke run (`--tiny`): every configuration runs, the JSON has the DESIGN.md
schema, the full path is the reference (relative L2 0), every preset moves the latents, and the thinned runs
happen with the dropped blocks released."""

import json
import sys
from pathlib import Path


def test_tiny_run_writes_the_schema(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_presets.py"])
    import benchmark_presets

    out = tmp_path / "presets.json"
    benchmark_presets.main(["--tiny", "--passes", "5", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    assert doc["mode"] == "off" and doc["layers"] == 7 and len(doc["dropped"]) == 1 and "random weights" in doc["note"]
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["full", "core-reuse-4", "token-reduction", "layers-45", "layers-45+reuse-2",
                          "layers-45+reuse-2+token-reduction"]
    for r in rows.values():
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    full = rows["full"]
    assert full["latent_rel_l2_video_vs_full"] == 0 and full["forwards"] == 5 and full["blocks_run"] == 8
    for name, r in rows.items():
        if name != "full":
            assert r["latent_rel_l2_video_vs_full"] > 0, name
    assert rows["core-reuse-4"]["core_passes"] == 2 and rows["layers-45+reuse-2"]["forwards"] == 3
    assert rows["token-reduction"]["reduced_rows"] < full["rows"]
    assert rows["layers-45"]["resident_weight_bytes"] < full["resident_weight_bytes"]  # released, not just skipped
