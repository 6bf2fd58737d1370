"""Terminal image preview: protocol detection from the environment, the Kitty / iTerm2 escape sequences, the PNG
fallback, and `--show` end to end."""

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from h3lab.frontends import cli
from h3lab.errors import ValidationError
from h3lab.frontends.preview import TerminalPreview, detect_protocol, iterm_escape, kitty_escape, png_bytes


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"KITTY_WINDOW_ID": "1", "TERM": "xterm-kitty"}, "kitty"),
        ({"TERM": "xterm-kitty"}, "kitty"),
        ({"TERM": "xterm-ghostty"}, "kitty"),
        ({"TERM_PROGRAM": "ghostty"}, "kitty"),
        ({"KONSOLE_VERSION": "230800", "TERM": "xterm-256color"}, "kitty"),
        ({"TERM_PROGRAM": "iTerm.app", "TERM": "xterm-256color"}, "iterm"),
        ({"TERM_PROGRAM": "WezTerm"}, "iterm"),
        ({"LC_TERMINAL": "iTerm2"}, "iterm"),
        ({"TERM": "xterm-256color"}, None),
        ({}, None),
        ({"TMUX": "/tmp/tmux-0/default,1,0", "KITTY_WINDOW_ID": "1"}, None),  # tmux drops graphics escapes
        ({"TERM": "screen-256color", "TERM_PROGRAM": "iTerm.app"}, None),
        ({"H3LAB_IMAGE_PROTOCOL": "iterm", "TERM": "dumb"}, "iterm"),
        ({"H3LAB_IMAGE_PROTOCOL": "none", "KITTY_WINDOW_ID": "1"}, None),
    ],
)
def test_detect_protocol(env, expected):
    assert detect_protocol(env) == expected


def frame(seed=0, h=40, w=48):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_png_bytes_round_trip():
    f = frame()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png_bytes(f)))), f)
    with pytest.raises(ValidationError, match="uint8 \\(height, width, 3\\)"):
        png_bytes(f.astype(np.float32))


def test_kitty_escape_chunks_a_png():
    png = png_bytes(frame(1, 128, 128))  # noise: > 4096 base64 bytes, several chunks
    seq = kitty_escape(png)
    chunks = re.findall(r"\x1b_G([^;]*);([^\x1b]*)\x1b\\", seq)
    assert len(chunks) > 1 and chunks[0][0] == "a=T,f=100,m=1" and chunks[-1][0] == "m=0"
    assert all(c[0] == "m=1" for c in chunks[1:-1]) and all(len(c[1]) <= 4096 for c in chunks)
    assert base64.standard_b64decode("".join(c[1] for c in chunks)) == png


def test_iterm_escape():
    png = png_bytes(frame(2))
    seq = iterm_escape(png, "p.png")
    m = re.fullmatch(r"\x1b\]1337;File=name=([^;]*);size=(\d+);inline=1:([^\x07]*)\x07\n", seq)
    assert m and int(m.group(2)) == len(png) and base64.standard_b64decode(m.group(3)) == png
    assert base64.standard_b64decode(m.group(1)) == b"p.png"


def test_terminal_preview_inline_or_png(tmp_path):
    stream = io.StringIO()
    inline = TerminalPreview(tmp_path, stream=stream, protocol="kitty")
    assert inline.show(frame(3), "step001") == "preview step001 (kitty)"
    assert stream.getvalue().startswith("\x1b_Ga=T,f=100") and not list(tmp_path.iterdir())
    fallback = TerminalPreview(tmp_path / "p", protocol=None)
    line = fallback.show(frame(3), "step001")
    path = tmp_path / "p" / "step001.png"
    assert line == f"preview step001: {path}" and np.array_equal(np.asarray(Image.open(path)), frame(3))
    with pytest.raises(ValidationError, match="image protocol 'sixel'"):
        TerminalPreview(tmp_path, protocol="sixel")


def test_show_writes_a_preview_per_pass(snapshot, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("H3LAB_IMAGE_PROTOCOL", "none")
    rc = cli.main(["-d", str(snapshot), "-p", "show me", "-o", "", "--width", "64", "--height", "64", "--frames",
                   "22", "--steps", "2", "--mode", "off", "--show", "--session-dir", "sess"])
    assert rc == 0
    err = capsys.readouterr().err
    previews = sorted((tmp_path / "sess" / "previews").glob("*.png"))
    assert [p.name for p in previews] == ["step001-of-002.png", "step002-of-002.png"]
    assert all(f"preview {p.stem}: " in err for p in previews)
    assert np.asarray(Image.open(previews[0])).shape == (64, 64, 3)
