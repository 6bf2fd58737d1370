"""Terminal image preview for `!show` / `--show`: one RGB frame, shown inline or written as a PNG.

Protocol detection (`detect_protocol`, environment only, no terminal query):
- ``kitty``: the Kitty graphics protocol (APC `ESC _ G ... ESC \\`, PNG payload `f=100`, base64 in 4096-byte chunks)
  when `KITTY_WINDOW_ID` is set, `TERM` is `xterm-kitty` or `xterm-ghostty`, `TERM_PROGRAM` is `ghostty`, or
  `KONSOLE_VERSION` is set (Konsole implements the Kitty protocol);
- ``iterm``: the iTerm2 inline-image protocol (OSC 1337 `File=...;inline=1`) when `TERM_PROGRAM` is `iTerm.app` or
  `WezTerm`, or `LC_TERMINAL` is `iTerm2`;
- none otherwise, and always inside tmux/screen (`TMUX` set, or `TERM` starting with `screen`/`tmux`), which drop
  graphics escapes without passthrough. `H3LAB_IMAGE_PROTOCOL=kitty|iterm|none` overrides the detection.

Without a protocol the frame is written atomically as `<dir>/<name>.png` and the path is returned for printing.

Display size (`zoom`, the seed's `--zoom N`, default 2 like Iris): the terminal is asked to show a W x H frame over
zoom*W x zoom*H pixels, so it has its intended logical size on a Retina (2x) screen; `--zoom 1` on a non-HiDPI
display. Neither the generated video nor the encoded PNG changes. iTerm2: `width=<zoom*W>px;height=<zoom*H>px`.
Kitty: columns and rows (`c=`, `r=`) from the terminal's cell size in pixels (`TIOCGWINSZ`); when the terminal does
not report one (or the stream is not a terminal) the size is left to the terminal. Zoom is an integer in 1..8.
What frame to show is the session's business (`Session.preview_frame`); this module only displays pixels.
"""

from __future__ import annotations

import base64
import io
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

import numpy as np

from ..errors import ValidationError
from ..io_utils import atomic_write_bytes

PROTOCOLS = ("kitty", "iterm")
KITTY_CHUNK = 4096
DEFAULT_ZOOM, MAX_ZOOM = 2, 8


def check_zoom(zoom: Any, what: str = "zoom") -> int:
    """A display zoom factor: an integer in 1..MAX_ZOOM (one-line `ValidationError`)."""
    if isinstance(zoom, bool) or not isinstance(zoom, int) or not 1 <= zoom <= MAX_ZOOM:
        raise ValidationError(f"{what}={zoom!r}: must be an integer between 1 and {MAX_ZOOM} (display pixels per "
                              "image pixel; 2 for Retina screens, 1 for others)")
    return zoom


def cell_pixels(stream: Any) -> tuple[float, float] | None:
    """(width, height) of one terminal cell in pixels, from TIOCGWINSZ on `stream`; None when not reported."""
    try:
        import fcntl
        import struct
        import termios

        rows, cols, xpix, ypix = struct.unpack("HHHH", fcntl.ioctl(stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
    except (AttributeError, OSError, ValueError, ImportError, io.UnsupportedOperation):
        return None
    if not (rows and cols and xpix and ypix):
        return None
    return xpix / cols, ypix / rows


def detect_protocol(env: Mapping[str, str] | None = None) -> str | None:
    """"kitty", "iterm" or None for the terminal described by `env` (default `os.environ`)."""
    env = os.environ if env is None else env
    forced = env.get("H3LAB_IMAGE_PROTOCOL", "").strip().lower()
    if forced:
        return forced if forced in PROTOCOLS else None
    term = env.get("TERM", "")
    if env.get("TMUX") or term.startswith(("screen", "tmux")):
        return None
    program = env.get("TERM_PROGRAM", "")
    if env.get("KITTY_WINDOW_ID") or term in ("xterm-kitty", "xterm-ghostty") or program == "ghostty":
        return "kitty"
    if env.get("KONSOLE_VERSION"):
        return "kitty"
    if program in ("iTerm.app", "WezTerm") or env.get("LC_TERMINAL") == "iTerm2":
        return "iterm"
    return None


def png_bytes(frame: Any) -> bytes:
    """uint8 (H, W, 3) RGB -> PNG file bytes."""
    from PIL import Image

    arr = np.asarray(frame.detach().cpu().numpy() if hasattr(frame, "detach") else frame)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValidationError(f"preview frame {arr.dtype} {tuple(arr.shape)}: must be uint8 (height, width, 3)")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr), mode="RGB").save(buf, "PNG")
    return buf.getvalue()


def kitty_escape(png: bytes, cells: tuple[int, int] | None = None) -> str:
    """Kitty graphics: transmit-and-display a PNG (a=T, f=100), base64 split into 4096-byte chunks (m=1 more);
    `cells` = (columns, rows) to display it over (`c=`, `r=`), None for the terminal's default size."""
    data = base64.standard_b64encode(png).decode("ascii")
    chunks = [data[i : i + KITTY_CHUNK] for i in range(0, len(data), KITTY_CHUNK)] or [""]
    size = "" if cells is None else f",c={cells[0]},r={cells[1]}"
    out = []
    for i, chunk in enumerate(chunks):
        more = 1 if i < len(chunks) - 1 else 0
        head = f"a=T,f=100{size},m={more}" if i == 0 else f"m={more}"
        out.append(f"\x1b_G{head};{chunk}\x1b\\")
    return "".join(out) + "\n"


def iterm_escape(png: bytes, name: str = "preview.png", pixels: tuple[int, int] | None = None) -> str:
    """iTerm2 inline image (OSC 1337 File=...;inline=1), also understood by WezTerm; `pixels` = (width, height) to
    display it over, None for the image's own size."""
    b64name = base64.standard_b64encode(name.encode("utf-8")).decode("ascii")
    data = base64.standard_b64encode(png).decode("ascii")
    size = "" if pixels is None else f";width={pixels[0]}px;height={pixels[1]}px"
    return f"\x1b]1337;File=name={b64name};size={len(png)}{size};inline=1:{data}\x07\n"


class TerminalPreview:
    """Shows frames inline when the terminal speaks an image protocol, else writes PNGs into `directory`."""

    def __init__(self, directory: str | Path, stream: TextIO | None = None, protocol: str | None = "auto",
                 zoom: int = DEFAULT_ZOOM):
        self.directory = Path(directory)
        self.stream = stream
        self.zoom = check_zoom(zoom)
        self.protocol = detect_protocol() if protocol == "auto" else protocol
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ValidationError(f"image protocol {self.protocol!r}: must be one of {', '.join(PROTOCOLS)} or None")

    def show(self, frame: Any, name: str, zoom: int | None = None) -> str:
        """Display or write `frame` (displayed at `zoom`, default `self.zoom`); returns the line to print (the PNG
        path when written)."""
        png = png_bytes(frame)
        if self.protocol is not None:
            stream = self.stream or sys.stdout
            zoom = self.zoom if zoom is None else check_zoom(zoom)
            height, width = (int(d) for d in frame.shape[:2])
            if self.protocol == "kitty":
                cell = cell_pixels(stream)
                cells = None if cell is None else (math.ceil(width * zoom / cell[0]),
                                                   math.ceil(height * zoom / cell[1]))
                stream.write(kitty_escape(png, cells))
            else:
                stream.write(iterm_escape(png, f"{name}.png", (width * zoom, height * zoom)))
            stream.flush()
            return f"preview {name} ({self.protocol})"
        path = atomic_write_bytes(self.directory / f"{name}.png", png)
        return f"preview {name}: {path}"
