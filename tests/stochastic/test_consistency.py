"""The consistency gate, rollout side: the log-density a batched rollout records for a request at
a non-zero batch position (position 1 of 2) equals, byte for byte in strict mode, the one recomputed from a batch-1
forward of that request at the same inputs; in `off` mode the same measurement is printed (whatever it is here).

The gate runs in a child process on one thread so its bytes do not depend on this test session's state. Position
independence on the CPU rests on `kernels/_interpreter_dot.py` (the interpreter's dot would otherwise be numpy's
matmul, whose OpenBLAS Haswell kernel rounds rows 6-11 of every 12 one ulp apart on AMD EPYC); no OpenBLAS kernel is
pinned here, so the test fails if that fix regresses.
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
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
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
