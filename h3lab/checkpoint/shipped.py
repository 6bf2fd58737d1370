"""The embedded default snapshot: "h3-shapes", a tiny MiniMax-H3 trained on procedural shapes and tones, shipped
inside the package (`h3lab/assets/h3-shapes/`, a few MB) in the released layout.

Contract
- `shapes_snapshot() -> Path`: the shipped folder, after checking it against its `h3lab_manifest.json` (format
  version `TRAINED_VERSION`, SHA-256 of every other file; no missing, extra or altered file). A folder that does not
  verify raises `CheckpointError` naming the first differing file -- it is never silently replaced by a random
  build. Checked once per process (the result is cached by the folder's file sizes and mtimes).
- The folder is what `scripts/train_shapes.py` wrote: the random seed-0 tiny snapshot's tokenizer, processor,
  schedulers and Qwen3-VL text encoder, and the trained `transformer/`, `vae/`, `audio_vae/` (their training run
  sealed in `h3lab_training.json`: command, device, data digest, steps, losses, weight hashes); `transformer_ref/`
  has the trained transformer's config and seeded random weights.
- Nothing here writes: the folder is read-only package data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import CheckpointError

TRAINED_VERSION = "shapes-v1"
NAME = "h3-shapes"
MANIFEST = "h3lab_manifest.json"
SEAL = "h3lab_training.json"
SHIPPED = Path(__file__).resolve().parent.parent / "assets" / NAME

_verified: dict[Path, tuple] = {}


def _stat_key(root: Path) -> tuple:
    return tuple((p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file())


def check_trained(root: Path) -> None:
    """Raise `CheckpointError` unless `root` matches its manifest exactly (module docstring)."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{root}: no readable {MANIFEST} ({exc.__class__.__name__}); reinstall h3lab") from None
    if not isinstance(manifest, dict) or manifest.get("version") != TRAINED_VERSION:
        raise CheckpointError(f"{root / MANIFEST}: version {manifest.get('version')!r}, expected {TRAINED_VERSION!r}")
    want = manifest.get("files") or {}
    have = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
    for rel in sorted(set(want) | set(have)):
        if rel not in have:
            raise CheckpointError(f"{root}: {rel} is missing (listed in {MANIFEST}); reinstall h3lab")
        if rel not in want:
            raise CheckpointError(f"{root}: {rel} is not in {MANIFEST} (an extra file); remove it or reinstall h3lab")
        if hashlib.sha256(have[rel].read_bytes()).hexdigest() != want[rel]:
            raise CheckpointError(f"{root}: {rel} does not match its SHA-256 in {MANIFEST}; reinstall h3lab")


def shapes_snapshot(root: Path | None = None) -> Path:
    """The shipped trained snapshot, verified (module docstring)."""
    root = SHIPPED if root is None else Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: the shipped {NAME} snapshot is missing; reinstall h3lab")
    key = _stat_key(root)
    if _verified.get(root) != key:
        check_trained(root)
        _verified[root] = key
    return root
