"""`h3lab.checkpoint`: snapshot discovery, key mapping, lazy loading, the `--info` fingerprint, the tiny snapshot.

- `discovery.py`  snapshot root / component / weight-file resolution, safetensors header reading (no tensor data)
- `keymap.py`     MiniMax original <-> Diffusers key mapping, fused-QKV split, fc1 half swap, layout detection
- `loader.py`     `load_state_dict` (any layout -> Diffusers keys, memory-mapped) and `load_transformer`
- `fingerprint.py` `component_hash` (headers + 64-byte tensor samples), below both `info.py` and `loader.py`
- `info.py`       `snapshot_info` / `format_info` for `h3lab --info` (headers and configs only)
- `tiny.py`       `make_tiny_snapshot(root, seed)`, `random_snapshot()` (the cached random seed-0 build) and
                  `default_snapshot()` (imports diffusers/transformers lazily)
- `shipped.py`    `shapes_snapshot()`: the embedded default, the trained "h3-shapes" snapshot shipped as package data
- `native.py`     `native_form(root)`: the canvas, length and prompt form a snapshot declares it was trained on
- `processor.py`  the Qwen3-VL processor without torchvision (`load_processor`)

Importing this package pulls in torch and safetensors, never diffusers or transformers. No import cycle: each
module imports only modules left of it in: native, discovery, keymap, fingerprint, loader, processor, shipped, tiny,
info.
"""

from __future__ import annotations

from typing import Any

from .discovery import find_weight_files, open_snapshot, read_header, resolve_component
from .fingerprint import HASH_SCHEME, component_hash
from .info import format_info, snapshot_info
from .loader import DTYPE_POLICIES, StateDict, load_state_dict, load_transformer

__all__ = [
    "load_state_dict", "load_transformer", "StateDict", "DTYPE_POLICIES", "snapshot_info", "format_info",
    "component_hash", "HASH_SCHEME", "open_snapshot", "resolve_component", "find_weight_files", "read_header",
    "make_tiny_snapshot", "default_snapshot", "random_snapshot", "load_processor",
]


def __getattr__(name: str) -> Any:
    # The tiny-snapshot maker and the processor loader import diffusers/transformers: load them on first use.
    if name in ("make_tiny_snapshot", "default_snapshot", "random_snapshot"):
        from . import tiny

        return getattr(tiny, name)
    if name == "load_processor":
        from .processor import load_processor

        return load_processor
    raise AttributeError(f"module 'h3lab.checkpoint' has no attribute {name!r}")
