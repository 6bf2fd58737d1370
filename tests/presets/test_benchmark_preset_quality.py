"""benchmarks/benchmark_preset_quality.py: its SSIM is 1 on identical frames and falls with noise (never above 1),
and its CPU smoke run (`--dry-run`, random tiny snapshot) writes a reference row and one row per configuration with
an SSIM, its per-prompt scores and the all-four count of the decoded clips."""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_ssim_is_one_on_identical_frames_and_falls_with_noise():
    import benchmark_preset_quality as bpq

    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    assert bpq.ssim(frames, frames) == 1.0
    noisy = np.clip(frames.astype(np.int16) + rng.integers(-40, 41, size=frames.shape), 0, 255).astype(np.uint8)
    worse = np.clip(frames.astype(np.int16) + rng.integers(-120, 121, size=frames.shape), 0, 255).astype(np.uint8)
    assert 1.0 > bpq.ssim(frames, noisy) > bpq.ssim(frames, worse)


def test_dry_run_writes_every_configuration(tmp_path):
    import benchmark_preset_quality as bpq

    out = tmp_path / "q.json"
    assert bpq.main(["--dry-run", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["reference", "steps-3", "reuse-2"]
    assert rows["reference"]["ssim_vs_reference"] == 1.0
    for name in ("steps-3", "reuse-2"):
        r = rows[name]
        assert len(r["per_prompt"]) == 2 and all(-1.0 <= s <= 1.0 for s in r["per_prompt"])
        assert 0 <= r["all_four"] <= 2 and r["mean_s"] > 0
