"""`h3lab.checkpoint` public API and import cost: importing the package pulls in neither diffusers nor transformers
(checked in a fresh interpreter); the tiny-snapshot maker and the processor loader resolve lazily."""

from __future__ import annotations

import subprocess
import sys

_PROBE = r"""
import sys
import h3lab.checkpoint as ckpt
heavy = sorted(m for m in ("diffusers", "transformers", "tokenizers") if m in sys.modules)
assert not heavy, heavy
assert callable(ckpt.load_state_dict) and callable(ckpt.load_transformer) and callable(ckpt.snapshot_info)
assert ckpt.make_tiny_snapshot.__module__ == "h3lab.checkpoint.tiny"
assert "diffusers" not in sys.modules  # resolving the name imports tiny.py, which imports diffusers only to build
print("ok")
"""


def test_import_is_light_and_api_resolves():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_public_names():
    import h3lab.checkpoint as ckpt

    for name in ckpt.__all__:
        assert getattr(ckpt, name) is not None, name
