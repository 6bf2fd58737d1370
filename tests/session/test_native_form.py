"""A snapshot's native form (`h3lab_native.json`): the embedded default declares 64x64, 22 frames and its prompt
template; the CLI, the Python session, the REPL banner and `--info` start from it; a request on another canvas gets a
one-line notice; a broken declaration is one line naming the file, the key and the rule."""

from __future__ import annotations

import json

import pytest

from h3lab.frontends import cli
from h3lab.checkpoint.native import NATIVE, native_form
from h3lab.checkpoint.tiny import default_snapshot
from h3lab.errors import CheckpointError


def test_the_embedded_default_declares_what_it_was_trained_on():
    form = native_form(default_snapshot())
    seal = json.loads((default_snapshot() / "h3lab_training.json").read_text())
    assert (form.width, form.height, form.frames) == (seal["geometry"]["width"], seal["geometry"]["height"],
                                                      seal["geometry"]["frames"]) == (64, 64, 22)
    assert form.example == "a blue square moves right, a middle tone" and "<colour>" in form.prompt_form
    assert form.off_canvas(64, 64) == ""
    notice = form.off_canvas(512, 512)
    assert "512x512 is not the canvas h3-shapes was trained on (64x64)" in notice and "\n" not in notice


def test_the_cli_starts_on_the_native_canvas_unless_told_otherwise(tiny_snapshot):
    args = cli.build_parser().parse_args(["-p", "a blue square moves up, a middle tone"])
    s = cli.settings_from_args(args)
    assert (s.width, s.height, s.num_frames) == (64, 64, 22)
    args = cli.build_parser().parse_args(["-p", "x", "--width", "128", "--height", "96"])
    assert (cli.settings_from_args(args).width, cli.settings_from_args(args).height) == (128, 96)
    args = cli.build_parser().parse_args(["-p", "x", "--seconds", "2"])
    assert cli.settings_from_args(args).num_frames != 22  # --seconds replaces the native length
    args = cli.build_parser().parse_args(["-d", str(tiny_snapshot), "-p", "x"])  # declares nothing: the schema's
    assert (cli.settings_from_args(args).width, cli.settings_from_args(args).height) == (512, 512)


def test_info_names_the_native_form():
    from h3lab.checkpoint.info import format_info, snapshot_info

    text = format_info(snapshot_info(default_snapshot()))
    assert "native       64x64, 22 frames" in text and "a blue square moves right, a middle tone" in text
    assert "[h3lab trained snapshot shapes-v1]" in text


def test_a_generation_off_the_native_canvas_says_so(tmp_path):
    from h3lab.app.session import Session

    session = Session(None, device="cpu")
    assert session.default_settings().width == 64 and session.settings("a red circle moves up").num_frames == 22
    result = session.generate("a red circle moves up, a low tone", width=96, height=64, steps=1, mode="off")
    assert any("96x64 is not the canvas h3-shapes was trained on (64x64)" in n for n in result.settings.notices)
    native = session.generate("a red circle moves up, a low tone", steps=1, mode="off")
    assert not any("trained on" in n for n in native.settings.notices)


@pytest.mark.parametrize("change, message", [
    ({"width": 50}, "width=50: must be a positive multiple of 16"),
    ({"frames": 0}, "frames=0: must be a positive integer"),
    ({"example": ""}, "example='': must be a non-empty one-line string"),
    ({"prompt_form": "two\nlines"}, "prompt_form='two\\nlines': must be a non-empty one-line string"),
])
def test_a_broken_declaration_is_one_line(tmp_path, change, message):
    root = tmp_path / "snap"
    root.mkdir()
    declared = {"width": 64, "height": 64, "frames": 22, "prompt_form": "a <thing>", "example": "a thing"}
    (root / NATIVE).write_text(json.dumps({**declared, **change}))
    with pytest.raises(CheckpointError, match=message.replace("\\", "\\\\").replace("(", r"\(")) as err:
        native_form(root)
    assert str(root / NATIVE) in str(err.value) and "\n" not in str(err.value)
    (root / NATIVE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        native_form(root)
    assert native_form(tmp_path / "nothing-here") is None
