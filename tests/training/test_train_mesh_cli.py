"""`h3lab train` on a mesh under torchrun (gloo ranks on the CPU, strict under the interpreter), one step of a batch of
two different clips: `--tp 2 --dp 2` (four ranks) and `--cp 2` (two) each seal the run, the adapter and the final
weights of the one-process run (only rank 0 writes and prints), and the sealed four-rank run verifies on one process;
a rank SIGKILLed mid-step under `--cp 2` ends the survivor with one line naming it, a non-zero exit and nothing
half-written in the job folder; and the mesh flags' bad values, each refused with exit 2 and one stderr line before
any model loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ports import free_port
from training_cases import make_clip

from h3lab import H3Config, H3Transformer
from h3lab.frontends import train
from h3lab.run.layout import build_layout
from h3lab.training import add_lora, verify
from h3lab.training.dataset import save_dataset

TINY = H3Config.tiny()  # 2 heads: cp 2 gives each rank one head


@pytest.fixture(scope="module")
def clips(tmp_path_factory, tiny_snapshot):
    """Two clips, over 11 rows (t2va: 4 text, one 4x4 frame = 4 video rows, 3 audio; CP2 shards 6 + 5) and 13 rows
    (5 audio; 7 + 6): a batch of 2 gives each data-parallel replica a different request. And the session's tiny
    snapshot (passed with -d: the user cache's default snapshot is shared with other checkouts)."""
    short, long = (build_layout("t2va", [1] * 4, 1, 4, 4, audio, patch_size=TINY.patch_size) for audio in (3, 5))
    path = tmp_path_factory.mktemp("mesh-data") / "clips"
    save_dataset(path, [make_clip(TINY, short, seed=9), make_clip(TINY, long, seed=10)])
    return path, tiny_snapshot


def _argv(clips, out, *extra) -> list[str]:
    path, snapshot = clips
    return ["--clips", str(path), "--out", str(out), "--steps", "1", "--rank", "2", "--alpha", "3", "--device",
            "cpu", "--seed", "4", "-d", str(snapshot), *extra]


@pytest.mark.parametrize("extra, said", [
    (("--cp", "0"), "cp=0: must be a positive integer"),
    (("--dp", "0"), "--dp 0: must be a positive integer"),
    (("--dp", "2"), "--dp 2 with --batch-size 1: every data-parallel replica needs a request of each step"),
    (("--cp", "2", "--gradient-checkpointing"), "--gradient-checkpointing with --cp 2: it recomputes blocks"),
    (("--tp", "2", "--gradient-checkpointing"), "--gradient-checkpointing with --tp 2: it recomputes blocks"),
    (("--cp", "3"), "cp=3: must divide the 2 heads of one tp rank"),
    (("--cp", "2"), "--tp 1 --cp 2 needs 2 rank(s), this launch has 1: run torchrun --nproc-per-node 2"),
    (("--tp", "2", "--dp", "2", "--batch-size", "2"),
     "--tp 2 --cp 1 --dp 2 needs 4 rank(s), this launch has 1: run torchrun --nproc-per-node 4"),
])
def test_bad_mesh_values_exit_2_with_one_line(clips, tmp_path, capsys, extra, said):
    code = train.main(_argv(clips, tmp_path / "out", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and said in err[0], err



def _manifest(out) -> dict:
    return json.loads((out / "run" / "manifest.json").read_text())


ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _torchrun(n: int, *tail: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *tail]


@pytest.fixture(scope="module")
def one_process(clips, tmp_path_factory) -> dict:
    """The job's one-process run (batch 2), the manifest every mesh run must equal."""
    out = tmp_path_factory.mktemp("one-process") / "job"
    assert train.main(_argv(clips, out, "--batch-size", "2")) == 0
    return _manifest(out)


def _trains_on_a_mesh(clips, out, n: int, *mesh_flags: str) -> dict:
    """`torchrun --nproc-per-node n -m h3lab train ... --batch-size 2 <mesh_flags>`: exit 0, rank 0 alone reports."""
    cmd = _torchrun(n, "-m", "h3lab", "train", *_argv(clips, out, "--batch-size", "2", *mesh_flags))
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("trained 1 steps") == 1
    return _manifest(out)


def _same_run(mesh: dict, one: dict, topology: str) -> None:
    assert mesh["digest"] == one["digest"]  # losses, every gradient, weights and optimiser state, step by step
    assert mesh["adapter"]["final_sha256"] == one["adapter"]["final_sha256"]
    assert mesh["weights_file"] == one["weights_file"]
    assert mesh["meta"]["mesh"]["topology"]["name"] == topology and "mesh" not in one["meta"]
    assert mesh["meta"]["job"] == one["meta"]["job"]  # the topology is no part of the job (resume may change it)


def test_tp2_dp2_training_run_under_torchrun_equals_one_process(clips, one_process, tmp_path):
    """Four ranks: two TP2 replicas, each computing one of the batch's two requests."""
    mesh = _trains_on_a_mesh(clips, tmp_path / "mesh", 4, "--tp", "2", "--dp", "2")
    _same_run(mesh, one_process, "tp2xcp1")
    assert mesh["meta"]["mesh"]["data_parallel"] == {"dp": 2, "dp_rank": 0} and mesh["data_parallel"]
    # the mesh-trained run verifies on one process, step by step (a model carrying the job's adapter)
    model = H3Transformer.from_pretrained(str(clips[1]), subfolder="transformer", device="cpu")
    add_lora(model, 2, 3.0)
    assert verify(tmp_path / "mesh" / "run", model).ok


def test_cp2_training_run_under_torchrun_equals_one_process(clips, one_process, tmp_path):
    """Two ranks, each holding half of every request's rows (Ulysses): the sealed digest is the one-process run's."""
    mesh = _trains_on_a_mesh(clips, tmp_path / "mesh", 2, "--cp", "2")
    _same_run(mesh, one_process, "tp1xcp2")
    assert not mesh["data_parallel"] and "data_parallel" not in mesh["meta"]["mesh"]


DIES = """\
import os, signal, sys
if os.environ["RANK"] == "1":  # SIGKILL mid-step: at block 0's Ulysses exchange, rank 0 waiting in its own
    import h3lab.distributed.collectives as collectives
    collectives._all_to_all = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
from h3lab.frontends.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_killed_mid_step_is_named_by_the_survivor(clips, tmp_path, tiny_snapshot):
    script, out, logs = tmp_path / "dies.py", tmp_path / "job", tmp_path / "logs"
    script.write_text(DIES)
    cmd = _torchrun(2, "--log-dir", str(logs), "--redirects", "3", str(script), *_argv(clips, out, "--cp", "2"))
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode != 0
    (err,) = [p for p in logs.rglob("stderr.log") if p.parent.name == "0"]
    said = [line for line in err.read_text().splitlines() if line.startswith("h3lab train:")]
    assert said == ["h3lab train: error: rank 1 died mid-step (no word from it after the process group broke); "
                    "every other rank stopped"], err.read_text()[-3000:]
    assert "Traceback" not in err.read_text()
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert not [p for p in left if p.endswith(".tmp") or "/." in f"/{p}"], left  # no temp file left behind
    assert "job.json" in left and not (out / "run").exists() and not (out / "adapter").exists(), left
