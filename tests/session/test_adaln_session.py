"""A session whose DiT keeps its AdaLN weights in host memory (`--adaln tables`, `!adaln`, `Session(adaln=)`): the
same bytes as a resident session, the placement in the run record (never the result hash) and replayed by `verify`
either way, switching in place, and the memory plan (`--info --plan`, `!plan`) with the one-line refusal of a
request that does not fit the card, before any work."""

from __future__ import annotations

import json

import pytest
import torch

from h3lab.frontends import cli, commands
from h3lab.components import adaln_host, streaming
from h3lab.app.memory_plan import MemoryPlanError
from h3lab.model.adaln_tables import tables_of
from h3lab.app.session import Session

REQUEST = dict(width=64, height=64, frames=22, steps=2, mode="off", seed=5)


def test_tables_generation_equals_resident(session, snapshot, tmp_path):
    tables = Session(snapshot, device="cpu", adaln="tables")
    a = session.generate("a fox in the snow", **REQUEST)
    b = tables.generate("a fox in the snow", **REQUEST)
    assert b.trajectory_hash == a.trajectory_hash and torch.equal(b.latents, a.latents)
    assert dict(b.arm.residency) == {"policy": "resident", "adaln": "tables"} and not a.arm.residency
    assert b.trajectory.spec.sha256 == a.trajectory.spec.sha256 and b.streaming is None
    model = tables.transformer()
    assert adaln_host.source_of(model) is not None and tables_of(model).stats.served > 0
    assert tables.status()["adaln"] == "tables"
    report = session.verify(b.trajectory.seal(tmp_path / "tables"))
    assert report.ok and report.record_differences == ["residency"]
    report = tables.verify(a.trajectory.seal(tmp_path / "resident"))
    assert report.ok and report.record_differences == ["residency"]


def test_switching_in_place(snapshot, assets):
    session = Session(snapshot, device="cpu")
    state = commands.SessionState(session=session, base_dir=assets)
    ref = session.generate("a fox", **REQUEST)
    model = session.transformer()
    lines = commands.run_line(state, "!adaln tables")
    assert lines[0].startswith("residency resident, AdaLN tables") and "AdaLN tables" in lines[1]
    assert session.transformer() is model and adaln_host.source_of(model) is not None
    on = session.generate("a fox", **REQUEST)
    assert on.trajectory_hash == ref.trajectory_hash and dict(on.arm.residency)["adaln"] == "tables"
    commands.run_line(state, "!streaming on")  # streamed blocks without their AdaLN weights
    streamer = streaming.streamer_of(model)
    assert streamer is not None and streamer.skip == adaln_host.adaln_host_ids(model)
    assert not {id(e.get()) for u in streamer.units for e in u.entries} & streamer.skip
    assert session.generate("a fox", **REQUEST).trajectory_hash == ref.trajectory_hash
    commands.run_line(state, "!streaming off")
    commands.run_line(state, "!adaln resident")
    assert adaln_host.source_of(model) is None and streaming.streamer_of(model) is None
    assert session.generate("a fox", **REQUEST).trajectory_hash == ref.trajectory_hash
    with pytest.raises(commands.CommandError, match="tables|resident"):
        commands.run_line(state, "!adaln maybe")


# ============================================================================================== the memory plan
@pytest.fixture(scope="module")
def full_config_snapshot(snapshot, tmp_path_factory):
    """The tiny snapshot with the released 33B transformer config: plans read configs only, nothing loads."""
    import shutil

    from h3lab import H3Config

    root = tmp_path_factory.mktemp("full-config") / "h3-full-config"
    shutil.copytree(snapshot, root)
    (root / "transformer" / "config.json").write_text(json.dumps(H3Config.full().to_diffusers()))
    return root


def test_plan_lines_and_refusal_before_any_work(full_config_snapshot, assets):
    session = Session(full_config_snapshot, device="cpu", adaln="tables", card_memory=80)
    plan = session.plan(width=1344, height=768, frames=362, steps=50, mode="strict")
    assert plan.fits and plan.card_gib == 80.0 and plan.shape.rows > 109_000
    text = "\n".join(plan.lines())
    assert "AdaLN tables" in text and "peak (estimate)" in text and ": fits" in text
    state = commands.SessionState(session=session, base_dir=assets)
    assert commands.run_line(state, "!plan")[0].startswith("plan for t2va 512x512 22f")
    resident = Session(full_config_snapshot, device="cpu", card_memory=40)
    with pytest.raises(MemoryPlanError, match=r"needs about 6\d\.\d GiB .* try --adaln tables"):
        resident.generate("a fox", width=512, height=512, frames=22, steps=2)
    assert resident.loaded == []  # refused before anything loaded


def test_cli_info_plan(full_config_snapshot, capsys):
    argv = ["--info", "--plan", "-d", str(full_config_snapshot), "--width", "1344", "--height", "768", "--frames",
            "124", "--steps", "50", "--adaln", "tables", "--card-memory", "80", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["adaln"] == "tables" and doc["plan"]["table_rows"] == doc["request"]["table_rows"]
    assert (doc["weights_bytes"] + doc["tables_bytes"]) / 2**30 <= 42
    assert cli.main(["--plan"]) == 2
    assert "--plan only goes with --info" in capsys.readouterr().err
    assert cli.main(["--info", "--plan", "-d", str(full_config_snapshot), "-o", "x.mp4"]) == 2
    assert "--info --plan" in capsys.readouterr().err


def test_layer_thinning_under_tables(deep_snapshot):
    """A thinned run ranks the blocks on AdaLN weights that live in host memory, releases the dropped block (its
    host buffer too) and keeps the resident session's bytes."""
    small = dict(REQUEST, steps=2)
    want = Session(deep_snapshot, device="cpu").generate("a fox", layers=5, **small)
    tables = Session(deep_snapshot, device="cpu", adaln="tables")
    got = tables.generate("a fox", layers=5, **small)
    assert got.trajectory_hash == want.trajectory_hash and got.arm.preset == want.arm.preset
    source = adaln_host.source_of(tables.transformer())
    assert sorted(source.host) == sorted(got.arm.preset["blocks"])  # the released block's host buffer is gone
