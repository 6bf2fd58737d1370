"""The presets through the session and its front ends: a snapshot whose DiT has 6 blocks; layer thinning seals its
choice, prints it and releases the dropped block's weights, a later full request reloads the DiT, `verify` replays
the thinned trajectory; the REPL commands (validated before any model loads, state unchanged on error) and the
one-shot CLI; a pinned (injected) model is never released."""

import re

import pytest
from preset_cases import deep_model

from h3lab.frontends import commands
from h3lab import presets
from h3lab.errors import H3Error
from h3lab.run.fields import thaw
from h3lab.app.session import Session
from h3lab.schema.generation_settings import GenerationSettings

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


@pytest.fixture(scope="module")
def session(deep_snapshot):
    from h3lab.frontends.cli import quiet_libraries

    quiet_libraries()
    return Session(deep_snapshot, device="cpu")


def test_thinning_seals_prints_releases_and_reloads(session, tmp_path):
    result = session.generate("a fox", layers=5, **SMALL)
    preset = thaw(result.arm.preset)
    model = session.transformer()
    assert preset["layers"] == 5 and len(preset["blocks"]) == 5 and {0, 5} <= set(preset["blocks"])
    (gone,) = set(range(6)) - set(preset["blocks"])
    assert presets.released_blocks(model) == (gone,)  # its weights are not resident any more
    lines = commands.generation_lines(result)
    assert f"preset layers 5 of 6: dropped blocks {gone} (lowest mean |AdaLN gate|; first and final protected)" in lines
    assert result.trajectory.manifest["spec"]["preset"] == preset
    sealed = result.trajectory.seal(tmp_path / "thin")
    assert session.verify(sealed).ok and session.transformer() is model  # no reload needed for the thinned replay
    again = session.generate("a fox", layers=5, seed=43, **SMALL)
    assert session.transformer() is model and thaw(again.arm.preset) == preset
    full = session.generate("a fox", **SMALL)  # needs every block: the DiT is loaded again
    reloaded = session.transformer()
    assert reloaded is not model and presets.released_blocks(reloaded) == () and "layers" not in full.arm.preset
    assert session.verify(sealed).ok  # the thinned trajectory replays on the whole model too
    assert full.trajectory_hash != result.trajectory_hash


def test_a_pinned_model_is_never_released(session):
    injected = deep_model(6, seed=11, refiner=2)
    session.set_transformer(injected)
    try:
        result = session.generate("a fox", layers=5, **SMALL)
        assert "blocks" in result.arm.preset and presets.released_blocks(injected) == ()
    finally:
        session.set_transformer(None)


def test_repl_commands_validate_before_anything_loads(deep_snapshot):
    loads = []

    class Watched(Session):
        def component(self, name):
            loads.append(name)
            return super().component(name)

    state = commands.SessionState(session=lambda: Watched(deep_snapshot, device="cpu"))
    run = lambda line: commands.run_line(state, line)  # noqa: E731
    assert run("!layers 5") == ["layers 5"] and state.settings.layers == 5
    for line, rule in (("!layers 4", "between 5 and 6 for this 6-block transformer"),
                       ("!layers x", "expected N (transformer blocks to run) or 'off'"),
                       ("!core-reuse 7", "between 1 and 6"), ("!zoom 0", "between 1 and 8"),
                       ("!token-reduction maybe", "expected one of on|off")):
        before = state.settings
        with pytest.raises(H3Error, match=re.escape(rule)) as err:
            run(line)
        assert state.settings is before and "\n" not in str(err.value)
    assert run("!layers off") == ["layers off (every block runs)"] and state.settings.layers is None
    assert run("!core-reuse 6") == ["core reuse 6", "warning (seed): use --core-reuse 6 only as an aggressive preview"]
    with pytest.raises(H3Error, match="mutually exclusive"):
        run("!reuse 2")
    run("!core-reuse 1")
    run("!size 256x256")
    with pytest.raises(H3Error, match="token_reduction at 256x256: refused"):
        run("!token-reduction on")
    assert run("!reference-rope on") == ["reference rope on"] and state.settings.reference_rope
    run("!size 512x512")
    out = run("!token-reduction on")
    assert out[0] == "token reduction on" and "changes nothing at 512x512" in out[-1]
    assert run("!zoom 1") == ["zoom 1"] and state.zoom == 1
    assert "layers" in " ".join(commands.help_lines()) and loads == []


def test_one_shot_cli_prints_the_preset(deep_snapshot, tmp_path, capsys, monkeypatch):
    from h3lab.frontends import cli

    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-d", str(deep_snapshot), "-p", "a fox", "--width", "64", "--height", "64", "--steps", "3",
                   "--mode", "off", "--core-reuse", "2", "--layers", "5", "-o", str(tmp_path / "fox.mp4")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "preset layers 5 of 6: dropped blocks" in out and "preset core reuse 2" in out
    assert GenerationSettings(layers=5, core_reuse=2).summary().endswith("layers 5, core reuse 2")


def test_a_streamed_session_runs_every_preset_byte_equal_to_resident(session, deep_snapshot):
    """A streamed session with a layer preset (the released block's streaming hooks must not bind slot views into
    its meta parameters). Each preset alone and all together: the same bytes as resident, and the
    streamer forgets the released block (no hook, no host bytes) and plans the rest."""
    import torch

    from h3lab.components import streaming

    streamed = Session(deep_snapshot, device="cpu", residency="streamed")
    cases = [dict(layers=5), dict(core_reuse=2), dict(token_reduction=True),
             dict(layers=5, core_reuse=2, token_reduction=True), dict(width=256, height=256, steps=1),
             dict(width=256, height=256, steps=1, reference_rope=True)]
    for case in cases:
        request = {**SMALL, "frames": 22, **case}
        a = session.generate("a fox", **request)
        b = streamed.generate("a fox", **request)
        assert b.trajectory_hash == a.trajectory_hash, case
        assert torch.equal(b.latents, a.latents) and torch.equal(b.audio, a.audio), case
        assert thaw(b.arm.preset) == thaw(a.arm.preset) and b.streaming is not None, case
        model = streamed.transformer()
        streamer = streaming.streamer_of(model)
        gone = presets.released_blocks(model)
        assert gone == presets.released_blocks(session.transformer()) and bool(gone) == ("layers" in case)
        names = {u.name for u in streamer.units}
        assert not names & {f"transformer_blocks.{i}" for i in gone}
        assert set(streamer.plan.streamed) | set(streamer.plan.resident) == names
