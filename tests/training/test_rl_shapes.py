"""`scripts/rl_shapes.py` end to end in its smallest form on the CPU (one prompt, G = 2, 2-pass evaluations of two
held-out triples): both algorithms train (GRPO stopped by its training budget after one iteration), evaluate before
and after, seal and verify the run, and write one benchmarks-schema file with both learning curves and the on-policy
counts."""

import importlib.util
import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def script():
    spec = importlib.util.spec_from_file_location("rl_shapes", ROOT / "scripts" / "rl_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompt_choice_is_seeded_round_robin_over_the_training_triples():
    rl = script()
    everything = rl.training_prompts(48)
    assert len(everything) == 48 and "a yellow triangle moves down, a low tone" not in everything  # held out
    quick = rl.training_prompts(6, "yellow,white", "triangle")
    assert quick == [p for p in everything if p.split()[1] in ("yellow", "white") and "triangle" in p]
    walk = [rl.prompts_of(k, quick, 4, seed=3) for k in range(3)]
    assert all(len(w) == 4 for w in walk) and sorted(set(sum(walk, []))) == sorted(quick)
    assert walk == [rl.prompts_of(k, quick, 4, seed=3) for k in range(3)]


def test_the_smallest_runs_write_verified_learning_curves_into_one_file(tmp_path):
    out = tmp_path / "rl.json"
    small = ["--quick", "--device", "cpu", "--prompts", "1", "--per-iteration", "1", "--group", "2", "--steps", "2",
             "--eval-steps", "2", "--training-eval", "1", "--held-out", "2", "--window", "0,1", "--draws", "1",
             "--out", str(out)]
    assert script().main(["--algorithm", "grpo", *small, "--iterations", "2", "--budget-s", "0",
                          "--run-dir", str(tmp_path / "grpo")]) == 0
    assert script().main(["--algorithm", "nft", *small, "--iterations", "1", "--run-dir", str(tmp_path / "nft")]) == 0
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    assert doc["name"] == "rl_shapes_quick" and [r["algorithm"] for r in doc["results"]] == ["grpo", "nft"]
    for result in doc["results"]:
        assert result["verify_ok"] and result["runs"] == 1 and result["held_out_clips"] == 2  # budget 0: one
        assert result["on_policy"]["count"] > 0 and result["on_policy"]["exact"] == result["on_policy"]["count"]
        curve = doc["runs_by_algorithm"][result["algorithm"]]["curve"]
        assert curve[0]["iteration"] == 0 and 0 <= curve[0]["reward_mean"] <= 1
    assert (tmp_path / "grpo" / "run" / "manifest.json").is_file() and (tmp_path / "nft" / "run").is_dir()
