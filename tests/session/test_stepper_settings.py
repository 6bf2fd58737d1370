"""The stochastic steppers as generation settings (`h3lab/stochastic/settings.py`): one declaration each of
`stepper`, `level`, `window` gives the flags, the REPL commands, the panel's "stepper" row and the summary; the
choice is sealed in the RunSpec exactly as a rollout seals it and `verify` replays it; bad values are one line,
exit 2, before any session starts."""

import types

import pytest

from h3lab.frontends import cli, commands
from h3lab.run import trajectory as T
from h3lab.errors import ValidationError
from h3lab.schema import SETTINGS
from h3lab.schema.generation_settings import GenerationSettings
from h3lab.stochastic.steppers import check_params

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


def test_flags_summary_and_spec_come_from_the_declarations():
    args = cli.build_parser().parse_args(["-p", "a fox", "--stepper", "flow_sde", "--level", "0.5", "--window",
                                          "1,2", "--seed", "9"])
    s = cli.settings_from_args(args)
    assert (s.stepper, s.level, s.window) == ("flow_sde", 0.5, "1,2")
    assert s.summary().endswith(", stepper flow_sde, level 0.5, window 1,2")
    assert SETTINGS.spec_fields(s) == {"stepper": "flow_sde", "stepper_params": check_params(
        "flow_sde", {"level": 0.5, "seed": 9, "requests": None, "window": {"start": 1, "size": 2}})}
    default = GenerationSettings()
    assert (default.stepper, default.level, default.window) == ("euler", 0.7, None)
    assert SETTINGS.spec_fields(default) == {} and "stepper" not in default.summary()  # replays keep their hashes
    assert default.replace(stepper="euler", level=0.7) == default
    noted = default.replace(level=0.3)
    assert SETTINGS.spec_fields(noted) == {} and any("takes effect with an SDE stepper" in n for n in noted.notices)


@pytest.mark.parametrize("argv,match", [
    (["--stepper", "ode"], "invalid choice: 'ode'"),
    (["--stepper", "cps", "--level", "1.5"], "cps level=1.5: must be in [0, 1]"),
    (["--stepper", "dance_sde", "--level", "0"], "level 0 for both modalities is the Euler step"),
    (["--level", "-0.1"], "level=-0.1: must be at least 0"),
    (["--level", "loud"], "invalid float value: 'loud'"),
    (["--stepper", "flow_sde", "--window", "2,3", "--steps", "4"], "SDE passes 2..4 exceed the 4 passes"),
    (["--window", "2"], "window='2': must be S,W"),
])
def test_bad_values_are_one_line_exit_2(argv, match, snapshot, capsys, monkeypatch):
    import h3lab.app.session as session_module

    monkeypatch.setattr(session_module, "Session", lambda *a, **k: pytest.fail("a session was built"))
    assert cli.main(["-d", str(snapshot), "-p", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("h3lab: error: ") and match in err, err


def test_repl_commands_and_panel_controls():
    from h3lab.frontends.widgets import Workbench

    state = commands.SessionState(session=lambda: pytest.fail("no session needed"))
    assert commands.run_line(state, "!stepper dance_sde") == ["stepper dance_sde level 0.7, noise seed 42"]
    assert commands.run_line(state, "!level 0.3") == ["stepper dance_sde level 0.3, noise seed 42"]
    assert commands.run_line(state, "!window 0,1")[0].endswith("SDE passes 0..0 (Euler elsewhere), noise seed 42")
    with pytest.raises(ValidationError, match="window='5,30'"):
        commands.run_line(state, "!window 5,30")
    with pytest.raises(ValidationError, match="dance_sde level=-1.0|level=-1.0"):
        commands.run_line(state, "!level -1")
    assert (state.settings.stepper, state.settings.level, state.settings.window) == ("dance_sde", 0.3, "0,1")
    assert commands.run_line(state, "!window off")[0] == "stepper dance_sde level 0.3, noise seed 42"
    with pytest.raises(commands.CommandError):
        commands.run_line(state, "!stepper ode")

    wb = Workbench(types.SimpleNamespace(keep=(), device="cpu", model_name="fake"), prompt="a fox")
    row = next(r for r in wb.panel.children if hasattr(r, "children") and wb.controls["stepper"] in r.children)
    assert wb.controls["level"] in row.children and wb.controls["window"] in row.children
    wb.controls["stepper"].value = "cps"
    wb.controls["level"].value = 0.25
    wb.controls["window"].value = "1,1"
    s = wb.current_settings()
    assert (s.stepper, s.level, s.window) == ("cps", 0.25, "1,1")
    wb.controls["window"].value = ""
    assert wb.current_settings().window is None
    wb.controls["level"].value = 2.0
    with pytest.raises(ValidationError, match="cps level=2.0: must be in"):
        wb.current_settings()


def test_a_generation_seals_the_stepper_and_verifies(session):
    result = session.generate("a red ball", stepper="flow_sde", level=0.7, window="1,1", seed=4, **SMALL)
    spec = result.trajectory.spec
    assert spec.stepper == "flow_sde" and spec.stepper_params["window"] == {"start": 1, "size": 1}
    assert spec.stepper_params["seed"] == 4
    steps = result.trajectory.steps
    assert not steps[0]["transition"]["video"]["sde"] and steps[1]["transition"]["video"]["sde"]
    assert T.verify(result.trajectory, session.transformer("transformer")).ok
    plain = session.generate("a red ball", seed=4, **SMALL)
    assert plain.trajectory.spec.stepper == "euler" and not plain.trajectory.spec.stepper_params
    from h3lab.frontends.commands import generation_lines

    summary = [line for line in generation_lines(result) if line.startswith("t2va ")]
    assert summary and " stepper flow_sde window 1,1:" in summary[0], summary  # a non-Euler stepper is named
    assert "stepper" not in next(line for line in generation_lines(plain) if line.startswith("t2va "))
