"""The flags of `h3lab encode`, each declared once (`h3lab.schema.program`).

None is sealed by a declaration: the dataset seals what the clips became (their latents, layouts and prompts,
`training.save_dataset`), not the flags that chose them; `h3lab.frontends.encode` reads the values and checks the pair
`--width` / `--height` and the output folder.
"""

from __future__ import annotations

from .program import declare_flag
from .setting import Setting

ENCODE = ("encode",)


def flag(name: str, type_: type, default, help_: str, **kw) -> Setting:
    return declare_flag(Setting(name, type_, default, help_, target="command", programs=ENCODE, **kw))


flag("videos", str, None, "the folder holding the clips", required=True, metavar="DIR")
flag("manifest", str, None, "a .csv (header row) or .jsonl file: a clip column (file_name, video or path, relative to "
     "--videos) and a prompt column (prompt, caption or text)", required=True, metavar="FILE")
flag("out", str, None, "the sealed dataset folder to write", aliases=("-o",), required=True,
     metavar="DATASET")
flag("snapshot", str, None, "snapshot (default: embedded tiny)", flag="--model", aliases=("-d",), metavar="PATH")
flag("device", str, None, "torch device (default cuda if available, else cpu)")
flag("width", int, None, "canvas width (with --height): every clip scaled and centre-cropped to it (default: each "
     "clip's own size, which must be a legal canvas)")
flag("height", int, None, "canvas height (with --width)")
flag("frames", int, None, "frames per clip at 24 fps, snapped up to 17n+5 (default: the longest 17n+5 each clip "
     "holds)")
flag("allow_silent", bool, False, "encode clips without an audio track as silence (default: refused)")
