"""scripts/kernel_resources.py: the strict GEMM contract tiles, compiled for sm_90 without a GPU (a subprocess
without TRITON_INTERPRET), fit the H200's shared memory and the 255-register limit; a tile that does not fit is
reported as not fitting; bad requests are refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from h3kernels import gemm

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kernel_resources.py"
H200_SHARED_BYTES = 232_448


def _run(tmp_path, *args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "res.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_contract_tiles_fit_the_h200(tmp_path):
    done, rows = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    tiles = {"linear": gemm.LINEAR_TILES[torch.bfloat16], "linear_tree": gemm.TREE_TILES[torch.bfloat16]}
    assert [r["op"] for r in rows] == ["linear", "linear_tree"]
    for r in rows:
        assert r["tile"] == tiles[r["op"]].describe() and r["target"] == "sm_90"
        assert r["fits_h200"] and 0 < r["shared_bytes"] <= H200_SHARED_BYTES
        assert 0 < r["registers"] <= 255 and r["spill_stores"] >= 0 and r["spill_loads"] >= 0


def test_a_tile_past_the_shared_memory_is_reported(tmp_path):
    """TMA slots with the paired chunks at 3 stages: 3 x 64 KB of operands plus a 64 KB slot exceed 227 KB."""
    done, rows = _run(tmp_path, "--ops", "linear_tree", "--tile", "paired=1", "num_stages=3", "slot_tma=1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not rows[0]["fits_h200"] and rows[0]["shared_bytes"] > H200_SHARED_BYTES
    assert "-slottma" in rows[0]["tile"] and "w8s3" in rows[0]["tile"]


def test_bad_requests_are_refused(tmp_path):
    done, rows = _run(tmp_path, "--tile", "no_such_field=3")
    assert done.returncode == 2 and rows is None and "want FIELD=INT" in done.stderr
    done, rows = _run(tmp_path, interpret=True)
    assert done.returncode == 2 and rows is None and "TRITON_INTERPRET=1 is set" in done.stderr
