"""The settings schema (`h3lab.schema`): one declaration gives a setting its flag, its REPL command, its panel
control, its summary part, its validation and its RunSpec arguments; a preset is one registered `Preset`."""

import contextlib
import types

import pytest

from h3lab.frontends import cli, commands
from h3lab.errors import ValidationError
from h3lab.schema import SETTINGS, Control, Repl, Setting, declare
from h3lab.schema.generation_settings import GenerationSettings


@pytest.fixture
def noise_level(monkeypatch):
    """A setting declared through the schema only, withdrawn afterwards (its command lands in a copy of the
    registry)."""
    monkeypatch.setattr(commands, "COMMANDS", dict(commands.COMMANDS))
    setting = declare(Setting(
        "noise_level", float, 0.7, "SDE noise level of the stepper", bounds=(0.0, 2.0), order=130,
        rule=lambda v, s: ["notice: noise_level above 1 is loud"] if v > 1 else [],
        command=Repl(), control=Control("noise", row="stepper"),
        summary=lambda v: f"noise {v:g}" if v != 0.7 else None,
        spec=lambda v, s: {"label": f"noise={v:g}"} if v != 0.7 else {},
    ))
    yield setting
    SETTINGS.withdraw("noise_level")


def test_a_new_setting_reaches_every_front_end(noise_level):
    # argparse and the flag -> settings conversion
    args = cli.build_parser().parse_args(["-p", "a fox", "--noise-level", "0.5"])
    assert cli.check_flags(args) == "one-shot"
    s = cli.settings_from_args(args)
    assert s.noise_level == 0.5 and GenerationSettings().noise_level == 0.7
    assert s.summary().endswith(", mode auto, noise 0.5") and "noise" not in GenerationSettings().summary()
    assert s.to_dict()["noise_level"] == 0.5
    assert SETTINGS.spec_fields(s) == {"label": "noise=0.5"} and SETTINGS.spec_fields(GenerationSettings()) == {}
    # a flag the action ignores is refused like every other
    with pytest.raises(cli.CliError, match=r"--noise-level with --replay 'x.h3'"):
        cli.check_flags(cli.build_parser().parse_args(["--replay", "x.h3", "--noise-level", "0.5"]))
    # the REPL registry: usage, help, parser, handler
    state = commands.SessionState(session=lambda: pytest.fail("no session needed"))
    assert "noise-level" in commands.COMMANDS and any(
        line.split()[:2] == ["!noise-level", "X"] for line in commands.help_lines())
    assert commands.run_line(state, "!noise-level 1.5") == ["noise-level 1.5"]
    assert state.settings.noise_level == 1.5 and "notice: noise_level above 1 is loud" in state.settings.notices
    with pytest.raises(commands.CommandError, match="expected a number"):
        commands.run_line(state, "!noise-level loud")
    with pytest.raises(ValidationError, match=r"noise_level=3\.0: must be between 0 and 2"):
        commands.run_line(state, "!noise-level 3")
    assert state.settings.noise_level == 1.5  # a rejected line changed nothing
    # a default value is not stored: equal settings, equal summaries
    assert state.settings.replace(noise_level=0.7) == GenerationSettings()


def test_a_new_setting_gets_a_panel_control(noise_level, tmp_path):
    from h3lab.frontends.widgets import Workbench

    session = types.SimpleNamespace(keep=(), device="cpu", model_name="fake")
    wb = Workbench(session, out_dir=tmp_path, prompt="a fox")
    control = wb.controls["noise_level"]
    assert wb.noise_level is control and control.description == "noise" and control.value == 0.7
    assert any(control in row.children for row in wb.panel.children if hasattr(row, "children"))
    control.value = 0.25
    assert wb.current_settings().noise_level == 0.25
    wb.command("!noise-level 1.25")
    assert control.value == 1.25  # the control follows the settings a command changed
    control.value = 5.0
    with pytest.raises(ValidationError, match="noise_level=5.0"):
        wb.current_settings()


def test_declaration_errors_and_extras():
    with pytest.raises(ValueError, match="already declared"):
        declare(Setting("steps", int, 20, "again"))
    with pytest.raises(ValueError, match="must be a Python identifier"):
        Setting("noise-level", float, 0.7, "dash")
    with pytest.raises(ValidationError, match="unknown setting"):
        GenerationSettings().replace(no_such_setting=1)
    with pytest.raises(AttributeError):
        GenerationSettings().no_such_setting  # noqa: B018


def test_a_new_preset_is_one_registered_object():
    from h3lab.presets import preset_lines, validate_preset
    from h3lab.presets import registry
    from h3lab.presets.field import apply_preset

    applied = []

    @contextlib.contextmanager
    def apply(value, run):
        applied.append(value["dither"])
        yield run

    preset = registry.Preset(
        "dither", validate=lambda v: {"dither": int(v["dither"])} if "dither" in v else {}, apply=apply,
        from_settings=lambda s, model, layout: {}, describe=lambda p: [f"dither {p['dither']}"], order=50,
        apply_order=50)
    registry.register_preset(preset)
    try:
        assert registry.keys()[-1] == "dither"
        assert validate_preset({"dither": 3, "core_reuse": 1}) == {"dither": 3}
        assert preset_lines({"dither": 3}) == ["preset dither 3"]
        run = types.SimpleNamespace(reuse=1, schedule=None)
        with apply_preset({"dither": 3}, run) as out:
            assert out is run and applied == [3]
        with pytest.raises(ValueError, match="belongs to another preset"):
            registry.register_preset(registry.Preset("other", preset.validate, apply, preset.from_settings,
                                                     preset.describe, 60, 60, keys=("other", "blocks")))
    finally:
        registry._PRESETS.pop("dither")
    with pytest.raises(Exception, match="preset key 'dither'"):
        validate_preset({"dither": 3})


def test_help_lists_every_generated_flag_once():
    """`h3lab --help` formats (an unused empty mutually exclusive group made argparse raise 'empty group')."""
    import contextlib
    import io

    from h3lab.frontends.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        build_parser().print_help()
    text = out.getvalue()
    assert "[--seconds SECONDS | --frames FRAMES]" in text
    assert text.count("--share-device") == 2  # usage line and its help line
