"""The torchrun front end: `torchrun --nproc-per-node 2 -m h3lab --tp 2 --device cpu --replay FILE` on gloo (rank 0
runs the replay through the command registry, rank 1 follows its forwards; inputs are rank 0's, broadcast). The same
replay run first in one process records its `# expect` line; the torchrun run must match it (exit 0: the distributed
trajectory digest equals the one-process strict digest), seal the run with its topology and verify it on the mesh.
One process then refuses to replay the sealed tp2 run (it names its topology)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3lab import cli
from h3lab.distributed import TopologyError
from h3lab.model import H3Transformer
from h3lab.trajectory import load, verify

REPLAY = """\
!size 64x64
!frames 5
!steps 2
!mode strict
!mesh
A red fox walks through fresh snow.
"""
ON_THE_MESH = """\
!trajectory save sealed
!trajectory verify sealed
"""


def test_torchrun_replay_equals_one_process_and_replays_its_topology(tmp_path, tiny_snapshot, capsys):
    replay = tmp_path / "dist.h3"
    replay.write_text(REPLAY)
    assert cli.main(["-d", str(tiny_snapshot), "--replay", str(replay), "--update"]) == 0
    one = capsys.readouterr().out
    assert "one process, no mesh" in one
    expect = [line for line in replay.read_text().splitlines() if line.startswith("# expect")]
    assert len(expect) == 1
    one_digest = expect[0].split()[-1]
    replay.write_text(replay.read_text() + ON_THE_MESH)

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "h3lab",
           "--tp", "2", "--device", "cpu", "-d", str(tiny_snapshot), "--replay", str(replay)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "mesh tp2xcp1: 2 rank(s), row-parallel k_chunks" in out and "rank 0 on cpu (gloo)" in out
    assert "1 checked, 0 mismatches" in out  # the one-process expect line holds on the mesh
    assert "OK: 2/2 passes byte-equal" in out  # !trajectory verify replayed the sealed run on tp2
    assert out.count("replay ") == 1  # only rank 0 prints

    sealed = load(tmp_path / "sealed")
    assert sealed.digest == one_digest
    assert dict(sealed.spec.placement) == {"tp": 2, "cp": 1, "sp": False, "row_parallel": "auto"}
    assert sealed.manifest["trace"]["placement"]["topology"]["name"] == "tp2xcp1"
    model = H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer")
    with pytest.raises(TopologyError, match=r"placement tp2xcp1 \(k_chunks\): the run's model is not parallelized"):
        verify(tmp_path / "sealed", model)
    assert Path(tmp_path / "sealed" / "manifest.json").is_file()
