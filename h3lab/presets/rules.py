"""The presets' request-level rules: what `GenerationSettings` checks before anything loads, and the seed's warnings.

Settings fields (h3lab.schema.generation_settings): `layers` (None = all blocks), `core_reuse` (1 = off), `token_reduction`,
`reference_rope`. `check_settings(s)` raises a one-line `PresetError` or returns notices:

- layers: None or an integer >= 1; its range depends on the transformer's depth, which the session checks against
  the snapshot's (or the injected model's) config before any model loads (`check_depth`, which also refuses token
  reduction on a transformer with no block after the schedule's start).
- core_reuse: 1..6, and mutually exclusive with whole-velocity reuse (`reuse` > 1).
- token_reduction: refused when the canvas the model runs on is exactly 256x256.
- Warnings, the seed's text: token reduction together with `--layers 40` (or fewer) and `--reuse 3` (or more);
  `--core-reuse 6`. A notice when `reference_rope` is set at a size where the RoPE adaptation does not apply.
"""

from __future__ import annotations

from typing import Any

from .core_reuse import check_core_reuse, check_exclusive
from .errors import PresetError
from .layer_thinning import check_layers
from .token_reduction import DEFAULT_SCHEDULE

WARN_TOKEN_REDUCTION = ("warning (seed): do not add --token-reduction to both --layers 40 and --reuse 3: that tested "
                        "combination produced color ringing, outlines, and ghosted limbs")
WARN_CORE_REUSE_6 = "warning (seed): use --core-reuse 6 only as an aggressive preview"
NOTE_REFERENCE_ROPE = ("notice: --use-reference-rope changes nothing at {w}x{h}: the RoPE adaptation applies only at "
                       "exactly 256x256")


def _bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise PresetError(f"{what}={value!r}: must be true or false")
    return value


def check_settings(s: Any) -> list[str]:
    """The rules above on a `GenerationSettings` (duck-typed); returns the notices."""
    if s.layers is not None and (isinstance(s.layers, bool) or not isinstance(s.layers, int) or s.layers < 1):
        raise PresetError(f"layers={s.layers!r}: must be a positive integer number of transformer blocks (or off)")
    check_core_reuse(s.core_reuse)
    check_exclusive(s.core_reuse, s.reuse)
    _bool(s.token_reduction, "token_reduction")
    _bool(s.reference_rope, "reference_rope")
    w, h = s.canvas
    if s.token_reduction and (w, h) == (256, 256):
        raise PresetError("token_reduction at 256x256: refused (an 8x8 token grid; the seed keeps token reduction "
                          "off at this size)")
    notices = []
    if s.token_reduction and s.layers is not None and s.layers <= 40 and s.reuse >= 3:
        notices.append(WARN_TOKEN_REDUCTION)
    if s.core_reuse == 6:
        notices.append(WARN_CORE_REUSE_6)
    if s.reference_rope and (w, h) != (256, 256):
        notices.append(NOTE_REFERENCE_ROPE.format(w=w, h=h))
    return notices


def check_depth(s: Any, num_layers: int) -> None:
    """`s.layers` against a transformer of `num_layers` blocks (`layer_thinning.layer_range`); token reduction needs
    a block after its start (the seed's schedule reduces from block 4 on)."""
    if s.layers is not None:
        check_layers(s.layers, num_layers)
    start = DEFAULT_SCHEDULE["start"]
    if s.token_reduction and num_layers <= start:
        raise PresetError(f"token_reduction: starts after block {start - 1}, and this transformer has {num_layers} "
                          "blocks (no middle blocks to reduce)")
