"""CPU smoke of benchmarks/benchmark_distributed.py (the GPU script the lead runs): tiny config, its two refiner blocks
and no transformer block (`--layers 0`: the script's path -- parallelize, the timed and the communication-timed
forwards, byte equality, the schema -- is the same for any block count, and the blocks' TP / CP / SP bytes are
test_model_parallel.py's and test_shard_load.py's), one timed forward, under the interpreter -- on 2 gloo ranks (tp2:
the multi-GPU path) and in one process (tp1 through the distributed code path beside plain strict: the single-H200
run). Timings are not checked, only the schema, the byte equality with TP1 and that communication was timed apart
from compute. The two 2-rank runs (tp2, and tp2 --share-device) are one launch, one run after the other."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness import run_ranks

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ARGS = ["--tiny", "--layers", "0", "--runs", "1"]
SCHEMA = {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"}


def _bench(rank: int, world: int, out: str, shared_out: str) -> dict:
    """Both 2-rank runs of the script on the same ranks: tp2 (and tp2xcp2, skipped), then --share-device."""
    sys.path.insert(0, str(BENCHMARKS))
    import benchmark_distributed

    benchmark_distributed.main([*ARGS, "--topologies", "tp2,tp2xcp2", "--out", out])
    benchmark_distributed.main([*ARGS, "--share-device", "--topologies", "tp2", "--trajectory-passes", "1",
                                "--out", shared_out])
    return {}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The two 2-rank result files (one launch): {"dist": the tp2 run's, "shared": the --share-device run's}."""
    root = tmp_path_factory.mktemp("bench-2")
    out = {"dist": root / "dist.json", "shared": root / "shared.json"}
    run_ranks(_bench, 2, str(out["dist"]), str(out["shared"]), timeout=600)
    return out


def _check(doc: dict, topology: str, world: int) -> dict:
    assert SCHEMA <= set(doc) and doc["world_size"] == world
    plain = [r for r in doc["results"] if r["topology"] == "plain"]
    (placed,) = [r for r in doc["results"] if r["topology"] == topology]
    assert plain and {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(placed)
    assert placed["bytes_equal_tp1"] is True and placed["output_sha256"] == plain[0]["output_sha256"]
    assert len(placed["peak_mem_gib_ranks"]) == world and placed["median_s"] > 0
    return placed


def test_two_gloo_ranks(two_ranks):
    doc = json.loads(two_ranks["dist"].read_text())
    placed = _check(doc, "tp2", 2)
    assert placed["comm_median_s"] > 0 and placed["compute_median_s"] > 0
    # O-proj and FFN down of the tiny config's 2 refiner blocks (--layers 0)
    assert placed["collectives"]["row_parallel_tree"] == {"all_gather + tree": 4}
    assert [r["skipped"] for r in doc["results"] if r["topology"] == "tp2xcp2"] == [
        "world size 4 != launch world size 2"]


def test_world_size_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["benchmark_distributed.py"])
    import benchmark_distributed

    out = tmp_path / "ws1.json"
    benchmark_distributed.main([*ARGS, "--out", str(out)])
    placed = _check(json.loads(out.read_text()), "tp1", 1)
    assert placed["comm_median_s"] == 0 and placed["collectives"] == {} and placed["ratio_vs_plain"] > 0


def test_shared_device_two_ranks(two_ranks):
    """--share-device (the one-GPU bytes-only run) on 2 gloo ranks: rank 0's full-model reference, each rank's own
    counter-random shard, bytes and a 1-pass trajectory digest equal to one process, labelled bytes only."""
    doc = json.loads(two_ranks["shared"].read_text())
    assert SCHEMA <= set(doc) and doc["label"].startswith("bytes only")
    plain, placed = doc["results"]
    assert plain["topology"].startswith("plain") and plain["trajectory_digest"]
    assert placed["bytes_equal_tp1"] is True and placed["digest_equal_one_gpu"] is True
    assert placed["output_sha256"] == plain["output_sha256"] and placed["trajectory_digest"] == plain["trajectory_digest"]
    assert placed["timing_label"].startswith("bytes only") and "ratio_vs_plain" not in placed
    assert placed["share_device"] is True and placed["transport"] == "shared memory (host)" and len(placed["peak_mem_gib_ranks"]) == 2
