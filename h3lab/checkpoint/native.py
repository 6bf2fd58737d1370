"""A snapshot's native form: the canvas, clip length and prompt form it was trained on.

Contract
- A snapshot may declare its native form in `h3lab_native.json` at its root:
      {"width": 64, "height": 64, "frames": 22,
       "prompt_form": "a <colour> <shape> moves <direction>, a <tone> tone",
       "example": "a blue square moves right, a middle tone"}
  `width` / `height` are positive multiples of 16 (the canvas rule), `frames` a positive integer, `prompt_form` and
  `example` non-empty one-line strings. The embedded default declares its own; the released snapshot has no such
  file (a user may add one).
- `native_form(root) -> NativeForm | None`: the declaration, or None when the snapshot declares none (or `root` is not
  a snapshot folder: a component folder or single file declares nothing). A declaration that breaks a rule raises
  `CheckpointError` naming the file, the key and the rule. Only this small JSON file is read (no weights).
- `NativeForm.defaults()`: the generation settings it changes ({"width", "height", "frames"}): the CLI, the REPL, the
  panel and replays start from them unless told otherwise. `off_canvas(width, height)`: the one-line notice for a
  request on another canvas ("" on the native one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

NATIVE = "h3lab_native.json"


@dataclass(frozen=True)
class NativeForm:
    """What a snapshot was trained on (module docstring)."""

    width: int
    height: int
    frames: int
    prompt_form: str
    example: str
    name: str = ""  # the snapshot's folder name, for messages

    def defaults(self) -> dict[str, int]:
        return {"width": self.width, "height": self.height, "frames": self.frames}

    def off_canvas(self, width: int, height: int) -> str:
        if (width, height) == (self.width, self.height):
            return ""
        return (f"{width}x{height} is not the canvas {self.name or 'this snapshot'} was trained on "
                f"({self.width}x{self.height}): expect little of what the prompt says (--width {self.width} "
                f"--height {self.height}, !size {self.width}x{self.height})")

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "height": self.height, "frames": self.frames, "prompt_form": self.prompt_form,
                "example": self.example}


def native_form(root: str | Path | None) -> NativeForm | None:
    """The snapshot's declared native form, or None (module docstring)."""
    if root is None:
        return None
    path = Path(root) / NATIVE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object with width, height, frames, prompt_form, example")
    for key in ("width", "height"):
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
            raise CheckpointError(f"{path}: {key}={value!r}: must be a positive multiple of 16")
    frames = data.get("frames")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames <= 0:
        raise CheckpointError(f"{path}: frames={frames!r}: must be a positive integer")
    for key in ("prompt_form", "example"):
        value = data.get(key)
        if not isinstance(value, str) or not value.strip() or "\n" in value:
            raise CheckpointError(f"{path}: {key}={value!r}: must be a non-empty one-line string")
    return NativeForm(data["width"], data["height"], frames, data["prompt_form"], data["example"],
                      name=Path(root).resolve().name)
