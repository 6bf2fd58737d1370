"""The torchrun front end: `torchrun --nproc-per-node 2 -m h3lab --tp 2 --device cpu --replay FILE` on gloo (rank 0
runs the replay through the command registry, rank 1 follows its forwards; inputs are rank 0's, broadcast). The same
replay run first in one process records its `# expect` line; the torchrun run must match it (exit 0: the distributed
trajectory digest equals the one-process strict digest), seal the run with its topology and verify it on the mesh.
One process then refuses to replay the sealed tp2 run (it names its topology). The REPL's lead / follow path runs
on two gloo ranks in-process (prompt-toolkit pipe input). A rank SIGKILLed mid-generation (one-shot, replay and the
REPL fed through torchrun's stdin; the CLI's one `peers.watch` around every mesh action) ends the survivor with one
line naming it, exit 2, and nothing written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks

from h3lab.frontends import cli
from h3lab.distributed import TopologyError
from h3lab.model import H3Transformer
from h3lab.run.trajectory import load, verify

REPLAY = """\
!size 64x64
!frames 5
!steps 1
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
    assert "OK: 1/1 passes byte-equal" in out  # !trajectory verify replayed the sealed run on tp2
    assert out.count("replay ") == 1  # only rank 0 prints

    sealed = load(tmp_path / "sealed")
    assert sealed.digest == one_digest
    assert dict(sealed.spec.placement) == {"tp": 2, "cp": 1, "sp": False, "row_parallel": "auto"}
    assert sealed.manifest["trace"]["placement"]["topology"]["name"] == "tp2xcp1"
    model = H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer")
    with pytest.raises(TopologyError, match=r"placement tp2xcp1 \(k_chunks\): the run's model is not parallelized"):
        verify(tmp_path / "sealed", model)
    assert Path(tmp_path / "sealed" / "manifest.json").is_file()


def _repl_rank(rank: int, world: int, snapshot: str, out_dir: str) -> dict:
    """The torchrun REPL's code path on 2 gloo ranks: rank 0 runs the REPL (prompt-toolkit pipe input; generations
    in the REPL's worker thread) and leads, rank 1 follows with its own session."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from h3lab.distributed import init_mesh
    from h3lab.distributed.frontend import run_on_mesh
    from h3lab.frontends.repl import run_repl
    from h3lab.app.session import Session
    from h3lab.schema.generation_settings import GenerationSettings

    mesh = init_mesh(tp=2, device="cpu")
    factory = lambda: Session(snapshot, device="cpu", mesh=mesh)  # noqa: E731
    lines: list[str] = []

    def repl() -> int:
        with create_pipe_input() as inp:
            inp.send_text(f"!mesh\na red fox\n!trajectory save {out_dir}/sealed\n!quit\n")
            settings = GenerationSettings(mode="strict", width=64, height=64, steps=1)
            return run_repl(factory, settings, session_dir=out_dir, input=inp, output=DummyOutput(),
                            printer=lines.append)

    return {"rc": str(run_on_mesh(None, mesh, repl, factory)), "lines": "\n".join(lines)}


def test_repl_on_rank_zero_with_a_follower(tmp_path, tiny_snapshot):
    results = run_ranks(_repl_rank, 2, str(tiny_snapshot), str(tmp_path), timeout=240)
    assert [r["rc"] for r in results] == ["0", "0"] and results[1]["lines"] == ""  # rank 1 followed, printed nothing
    out = results[0]["lines"]
    assert "mesh tp2xcp1: 2 rank(s)" in out and re.search(r"ran strict: [\d,]+ strict / 0 torch", out) and "sealed in" in out
    sealed = load(tmp_path / "sealed")
    assert dict(sealed.spec.placement)["tp"] == 2 and sealed.manifest["trace"]["non_strict_calls"] == 0


def _failing_rank(rank: int, world: int, case: str) -> dict:
    """run_on_mesh on 2 gloo ranks where rank 0's action fails ("lead"), or where the follower fails a message
    first and rank 0 fails later ("follower-first")."""
    import time

    from h3lab.distributed import init_mesh
    from h3lab.distributed.follow import leading
    from h3lab.distributed.frontend import MeshFailure, run_on_mesh
    from h3lab.errors import ValidationError

    mesh = init_mesh(tp=2, device="cpu")

    def factory():
        raise RuntimeError(f"rank {rank} cannot build its session")

    def action() -> int:
        if case == "follower-first":
            leading().send(("forward", "transformer", "strict", {}, [], None))  # the follower's models() fails
            time.sleep(0.5)
        raise ValidationError("width=50: must be a multiple of 32")

    try:
        return {"rc": str(run_on_mesh(None, mesh, action, factory)), "error": ""}
    except MeshFailure as exc:
        return {"rc": "raised", "error": str(exc)}


@pytest.mark.parametrize("case, line", [
    ("lead", "width=50: must be a multiple of 32"),
    ("follower-first", "rank 1: internal error: rank 1 cannot build its session (set H3LAB_DEBUG=1 for the traceback)"),
])
def test_every_rank_raises_the_first_failing_ranks_own_line(case, line):
    """The earliest failure of any rank is what every rank reports (the CLI prints it, exit 2),
    never a peer's teardown; no rank leaves early."""
    results = run_ranks(_failing_rank, 2, case, timeout=120)
    assert [r["rc"] for r in results] == ["raised", "raised"]
    assert [r["error"] for r in results] == [line, line]


DIES = """\
import os, signal, sys
if os.environ["RANK"] == "1":  # SIGKILL mid-generation: at the first TP gather of a forward, rank 0 computing its own
    import h3lab.distributed.collectives as collectives
    collectives._all_gather = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
from h3lab.frontends.cli import main
sys.exit(main(sys.argv[1:]))
"""
KILLED_REPLAY = """\
!size 32x32
!steps 1
!mode strict
a red fox
!trajectory save out/sealed
"""


KILLED_REPL = """\
!size 32x32
!steps 1
a red fox
!trajectory save out/sealed
a red fox
!quit
"""


@pytest.mark.parametrize("action, what", [("one-shot", "generation"), ("replay", "replay"), ("repl", "session")])
def test_a_rank_killed_mid_generation_is_named_by_the_survivor(tmp_path, tiny_snapshot, action, what):
    """Rank 1 SIGKILLed at its first TP gather. The REPL: its generation runs in the worker thread, fed
    through torchrun's stdin; the broken mesh ends the session (no line's `error:`, no second generation)."""
    script, out, logs, session = tmp_path / "dies.py", tmp_path / "out", tmp_path / "logs", tmp_path / "session"
    script.write_text(DIES)
    out.mkdir()
    stdin = None
    if action == "replay":
        (tmp_path / "killed.h3").write_text(KILLED_REPLAY)
        tail = ["--replay", str(tmp_path / "killed.h3"), "--allow-unchecked"]
    elif action == "repl":
        tail, stdin = ["--session-dir", str(session)], KILLED_REPL
    else:
        tail = ["-p", "a red fox", "--width", "32", "--height", "32", "--steps", "1", "-o", str(out / "fox.mp4"),
                "--trajectory", str(out / "sealed")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
           str(logs), "--redirects", "3", str(script), "--tp", "2", "--device", "cpu", "-d", str(tiny_snapshot), *tail]
    run = subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]  # torchrun's own status; the ranks' are in its report
    exits = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (-?\d+)", run.stderr))
    assert exits == {"0": "2", "1": "-9"}, run.stderr[-3000:]
    (err,) = [p for p in logs.rglob("stderr.log") if p.parent.name == "0"]
    (said_out,) = [p for p in logs.rglob("stdout.log") if p.parent.name == "0"]
    text, printed = err.read_text(), said_out.read_text()
    said = [line for line in text.splitlines() if line.startswith("h3lab:")]
    assert said == [f"h3lab: error: rank 1 died mid-{what} (no word from it after the process group broke); every "
                    "other rank stopped"], text[-3000:]
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    assert "error:" not in printed and "Connection closed" not in printed, printed[-3000:]
    assert not list(out.iterdir())  # no output, no sealed trajectory, no temp file or hidden directory
    if action == "repl":
        assert "h3lab h3-tiny" in printed and "size 32x32" in printed  # the REPL ran its lines up to the generation
        assert sorted(p.name for p in session.rglob("*")) == ["history"]  # no numbered video, no temp file
