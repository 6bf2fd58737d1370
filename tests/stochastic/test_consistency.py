"""The consistency gate, rollout side (issue 21 item 3): the log-density a batched rollout records for a request at
a non-zero batch position (position 1 of 2) equals, byte for byte in strict mode, the one recomputed from a batch-1
forward of that request at the same inputs; in `off` mode the same measurement is printed (whatever it is here).

Why a child process with OPENBLAS_CORETYPE=Sandybridge: under TRITON_INTERPRET=1 every tile `tl.dot` is numpy's
float32 matmul, and the OpenBLAS Haswell/Zen sgemm kernel numpy picks on this machine rounds identical rows of one
product differently by their position in the tile (rows 6-11 of every 12), so a request's bytes on the CPU would
depend on its batch position through the interpreter, not through the kernels' declared order. The Sandybridge
kernel has no such position dependence; OpenBLAS reads the variable when numpy loads, so it must be a new process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("consistency_worker.py")
REPO = Path(__file__).resolve().parents[2]


def test_rollout_logp_equals_the_batch_one_recomputation(tiny_snapshot, tmp_path):
    out = tmp_path / "consistency.json"
    env = {**os.environ, "OPENBLAS_CORETYPE": "Sandybridge", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(WORKER), str(tiny_snapshot), str(out)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    strict, off = result["strict"]["rows"], result["off"]["rows"]
    assert len(strict) == len(off) == 4  # 2 passes x 2 modalities
    for row in strict:
        assert row["request"] == 1
        assert row["velocity_equal"], row
        assert row["batch1"] == row["rollout"], row  # logp mean and sum: the same float32 values
    worst = max(abs(r["batch1"][0] - r["rollout"][0]) for r in off)
    print(f"\noff mode: batch-1 vs position 1 of 2, max |logp_mean diff| = |log ratio| {worst:.3g}; velocities "
          f"byte-equal on {sum(r['velocity_equal'] for r in off)}/{len(off)} (pass, modality)")
