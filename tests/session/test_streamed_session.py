"""A session with streamed residency (`--residency streamed`, `!streaming on|off`, `--gpu-memory`): the same bytes as
a resident session, the residency sealed in the run spec and replayed by `verify` in either session, the copy
statistics in `--profile`, switching in place, and one-line refusals that change nothing."""

from __future__ import annotations

import pytest
import torch

from h3lab.frontends import cli, commands
from h3lab.components import streaming
from h3lab.errors import H3Error, ValidationError
from h3lab.app.session import Session

REQUEST = dict(width=64, height=64, frames=22, steps=2, mode="off", seed=5)


@pytest.fixture(scope="module")
def streamed_session(snapshot):
    return Session(snapshot, device="cpu", residency="streamed")


def test_streamed_generation_equals_resident(session, streamed_session, tmp_path):
    a = session.generate("a fox in the snow", **REQUEST)
    b = streamed_session.generate("a fox in the snow", **REQUEST)
    assert b.trajectory_hash == a.trajectory_hash
    assert torch.equal(b.latents, a.latents) and torch.equal(b.audio, a.audio) and (b.frames == a.frames).all()
    assert dict(b.arm.residency) == {"policy": "streamed", "slots": 2} and not a.arm.residency
    assert a.streaming is None and b.streaming.uses == 2 * len(b.streaming.plan["streamed"]) > 0
    assert any(line.lstrip().startswith("streamed") for line in b.timing_lines())
    assert b.to_dict()["streaming"]["bytes_moved"] == b.streaming.bytes_moved
    model = streamed_session.transformer()
    assert streaming.streamer_of(model) is not None and streaming.streamer_of(session.transformer()) is None
    st = streamed_session.status()
    assert st["residency"] == "streamed" and "DiT blocks streamed" in st["streaming"][0]
    # verify replays the streamed run in a resident session (resident: the session's execution plan) and vice versa:
    # one result hash, the run record's residency reported as the difference.
    assert b.trajectory.spec.sha256 == a.trajectory.spec.sha256
    path = b.trajectory.seal(tmp_path / "streamed")
    report = session.verify(path)
    assert report.ok and report.record_differences == ["residency"] and "-> resident" in str(report)
    assert streaming.streamer_of(session.transformer()) is None
    report = streamed_session.verify(a.trajectory.seal(tmp_path / "resident"))
    assert report.ok and report.record_differences == ["residency"]


def test_switching_in_place(snapshot, assets):
    session = Session(snapshot, device="cpu")
    state = commands.SessionState(session=session, base_dir=assets)
    ref = session.generate("a fox", **REQUEST)
    model = session.transformer()
    lines = commands.run_line(state, "!streaming on")
    assert lines[0] == "residency streamed" and "streamed through 2 slots" in lines[1]
    assert session.transformer() is model and streaming.streamer_of(model) is not None  # re-placed, not reloaded
    assert any("DiT blocks streamed" in line for line in commands.run_line(state, "!status"))
    on = session.generate("a fox", **REQUEST)
    assert on.trajectory_hash == ref.trajectory_hash and on.streaming is not None
    assert commands.run_line(state, "!streaming off") == ["residency resident"]
    assert streaming.streamer_of(model) is None and session.transformer() is model
    assert session.generate("a fox", **REQUEST).trajectory_hash == ref.trajectory_hash


def test_gpu_memory_budget(snapshot):
    plan = streaming.plan_for_model(Session(snapshot, device="cpu").transformer())
    gib = (plan.device_bytes + plan.slot_bytes) / streaming.GiB  # one block resident beyond the streamed minimum
    session = Session(snapshot, device="cpu", residency="streamed", gpu_memory=gib)
    model = session.transformer()
    mixed = streaming.streamer_of(model).plan
    assert mixed.resident and mixed.streamed and mixed.device_bytes <= gib * streaming.GiB
    result = session.generate("a fox", **REQUEST)
    assert dict(result.arm.residency) == {"policy": "streamed", "slots": 2, "gpu_memory_gib": gib}


@pytest.mark.parametrize("kwargs, message", [
    (dict(residency="resident", gpu_memory=8), "needs residency='streamed'"),
    (dict(residency="streamed", gpu_memory=0), "gpu_memory_gib=0"),
    (dict(residency="streamed", gpu_memory=1e-9), "the streamed DiT needs at least"),
    (dict(residency="swapped"), "residency='swapped'"),
])
def test_refusals_before_anything_loads(snapshot, kwargs, message):
    with pytest.raises(H3Error, match=message) as err:
        Session(snapshot, device="cpu", **kwargs)
    assert len(str(err.value).splitlines()) == 1


def test_a_refused_switch_changes_nothing(snapshot):
    session = Session(snapshot, device="cpu")
    session.transformer()
    with pytest.raises(ValidationError, match="the streamed DiT needs at least"):
        session.set_residency("streamed", gpu_memory=1e-9)
    assert session.residency == "resident" and streaming.streamer_of(session.transformer()) is None
    with pytest.raises(ValidationError, match="needs residency='streamed'"):
        session.set_residency("phased", gpu_memory=4)
    assert session.residency == "resident" and session.gpu_memory is None


def test_cli_flags(snapshot):
    args = cli.build_parser().parse_args(["-d", str(snapshot), "--device", "cpu", "--gpu-memory", "40"])
    session = cli.session_from_args(args)
    assert session.residency == "streamed" and session.gpu_memory == 40.0
    args = cli.build_parser().parse_args(["-d", str(snapshot), "--device", "cpu", "--residency", "streamed"])
    assert cli.session_from_args(args).gpu_memory is None
    args = cli.build_parser().parse_args(["-d", str(snapshot), "--device", "cpu", "--residency", "phased",
                                          "--gpu-memory", "40"])
    with pytest.raises(ValidationError, match="needs residency='streamed'"):
        cli.session_from_args(args)
