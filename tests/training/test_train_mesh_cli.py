"""`h3lab train --cp 2` under torchrun (two gloo ranks on the CPU, strict under the interpreter): the sealed training
run, the adapter and the final weights equal the one-process run's (only rank 0 writes and prints); and the mesh
flags' bad values, each refused with exit 2 and one stderr line before any model loads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from training_cases import make_clip

from h3lab import H3Config, train
from h3lab.layout import build_layout
from h3lab.training.dataset import save_dataset

TINY = H3Config.tiny()  # the clips' widths; the default snapshot (h3-shapes) trains on them: 4 heads, cp 2 gives each rank 2


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """One clip over 11 rows (t2va: 4 text, one 4x4 frame = 4 video rows, 3 audio; CP2 shards 6 + 5)."""
    layout = build_layout("t2va", [1] * 4, 1, 4, 4, 3, patch_size=TINY.patch_size)
    path = tmp_path_factory.mktemp("mesh-data") / "clips"
    save_dataset(path, [make_clip(TINY, layout, seed=9)])
    return path


def _argv(clips, out, *extra) -> list[str]:
    return ["--clips", str(clips), "--out", str(out), "--steps", "1", "--rank", "2", "--alpha", "3", "--device",
            "cpu", "--seed", "4", *extra]


@pytest.mark.parametrize("extra, said", [
    (("--tp", "2"), "--tp 2: training on a mesh is defined for context parallelism only (--cp C, --tp 1)"),
    (("--cp", "0"), "cp=0: must be a positive integer"),
    (("--cp", "2", "--gradient-checkpointing"), "--gradient-checkpointing with --cp 2: it recomputes blocks"),
    (("--cp", "3"), "cp=3: must divide the 4 heads of one tp rank"),
    (("--cp", "2"), "--tp 1 --cp 2 needs 2 rank(s), this launch has 1: run torchrun --nproc-per-node 2"),
])
def test_bad_mesh_values_exit_2_with_one_line(clips, tmp_path, capsys, extra, said):
    code = train.main(_argv(clips, tmp_path / "out", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and said in err[0], err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manifest(out) -> dict:
    return json.loads((out / "run" / "manifest.json").read_text())


def test_cp2_training_run_under_torchrun_equals_one_process(clips, tmp_path, capsys, tiny_snapshot):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    mesh_out, one_out = tmp_path / "mesh", tmp_path / "one"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "h3lab", "train", *_argv(clips, mesh_out, "--cp", "2")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("trained 1 steps") == 1  # rank 0 alone reports
    assert train.main(_argv(clips, one_out)) == 0
    capsys.readouterr()
    mesh, one = _manifest(mesh_out), _manifest(one_out)
    assert mesh["digest"] == one["digest"]  # losses, every gradient, weights and optimiser state, step by step
    assert mesh["adapter"]["final_sha256"] == one["adapter"]["final_sha256"]
    assert mesh["weights_file"] == one["weights_file"]
    assert mesh["meta"]["mesh"]["topology"]["name"] == "tp1xcp2" and "mesh" not in one["meta"]
    assert mesh["meta"]["job"] == one["meta"]["job"]  # the topology is no part of the job (resume may change it)
