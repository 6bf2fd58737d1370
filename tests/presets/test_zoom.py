"""`--zoom N` for --show previews: the display size the terminal is asked for is zoom x the frame (2x by default,
the seed's Retina rule), the encoded PNG is the frame itself, and bad factors are refused with one line."""

import io
import re

import numpy as np
import pytest

from h3lab.frontends import preview
from h3lab.errors import H3Error
from h3lab.frontends.preview import TerminalPreview, check_zoom

FRAME = np.random.default_rng(3).integers(0, 255, (48, 80, 3), dtype=np.uint8)  # H 48, W 80


def test_iterm_display_size_is_zoom_times_the_frame(tmp_path):
    for zoom, want in ((None, (160, 96)), (1, (80, 48)), (3, (240, 144))):
        stream = io.StringIO()
        viewer = TerminalPreview(tmp_path, stream=stream, protocol="iterm")
        viewer.show(FRAME, "p", zoom=zoom)
        m = re.search(r"size=(\d+);width=(\d+)px;height=(\d+)px;inline=1:", stream.getvalue())
        assert m and (int(m.group(2)), int(m.group(3))) == want
        assert int(m.group(1)) == len(preview.png_bytes(FRAME))  # the image itself is not resized


def test_kitty_cells_follow_the_terminal_cell_size(tmp_path, monkeypatch):
    stream = io.StringIO()
    viewer = TerminalPreview(tmp_path, stream=stream, protocol="kitty", zoom=2)
    viewer.show(FRAME, "p")
    assert stream.getvalue().startswith("\x1b_Ga=T,f=100,m=")  # no cell size reported: the terminal decides
    monkeypatch.setattr(preview, "cell_pixels", lambda _s: (10.0, 20.0))
    stream.seek(0), stream.truncate()
    viewer.show(FRAME, "p")
    assert stream.getvalue().startswith("\x1b_Ga=T,f=100,c=16,r=5,m=")  # ceil(160/10), ceil(96/20)


def test_bad_zoom_is_refused():
    assert check_zoom(1) == 1 and check_zoom(8) == 8
    for bad in (0, 9, 2.0, True, "2"):
        with pytest.raises(H3Error, match="between 1 and 8") as err:
            check_zoom(bad, "--zoom")
        assert "\n" not in str(err.value)
