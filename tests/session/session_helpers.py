"""Shared constants and helpers of the session tests (imported by name: pytest puts this folder on sys.path)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "replays" / "assets"
TINY_GEOMETRY = {"canvas_short_edge": 64, "canvas_max_pixels": 64 * 112, "reference_image_short_edge": 64}
GEN = ["!size 64x64", "!frames 22", "!steps 2", "!mode off"]  # the small generation every test uses


def subprocess_env(**extra) -> dict:
    """Environment for running `h3lab` in a child process: the repository importable from any cwd, one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env
