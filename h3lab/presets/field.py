"""The `RunSpec.preset` field: one provider validates and applies the whole preset JSON.

Keys (every one optional; `{}` is the full path and is never looked up):

  layers           N, the blocks layer thinning runs (`layer_thinning`)
  blocks           the sealed choice: N block indices in increasing order (the session fills it by ranking the
                   checkpoint's AdaLN gates; without it a run ranks the model it is given)
  core_reuse       K in 2..6 (`core_reuse`; 1 is the default and is dropped)
  token_reduction  true (the seed's schedule, sealed as the dict) or {start, end, early_end, early_evaluations}
  rope             "halved" (the 256x256 adaptation, automatic at that size) or "reference" (--use-reference-rope
                   at 256x256: the released coordinates, sealed as the user's choice); absent elsewhere

Each key belongs to one `Preset` of `presets.registry` (one per preset file); this module only loops over them.
`validate_preset(value)` normalises it (one-line `PresetError` otherwise). `apply_preset(value, run)` runs every
preset's run check, then applies, in `apply_order`, each on the run the previous one yielded: RoPE halving (the
inputs' positions), token reduction (block hooks, on those positions), layer thinning (dropped blocks skip), core
reuse (outermost: it decides per pass whether the stack runs at all); core reuse with whole-velocity reuse is
refused. `preset_for(settings, model, layout)` is the preset a session request seals; `preset_lines(preset)` says
what it chose.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import core_reuse, layer_thinning, rope_adaptation, token_reduction  # noqa: F401 - each registers its Preset
from .errors import PresetError
from .registry import keys, presets

KEYS = keys()


def validate_preset(value: Any) -> dict[str, Any]:
    """The normalised preset JSON (module docstring)."""
    if not isinstance(value, dict):
        raise PresetError(f"preset={value!r}: must be an object")
    known = keys()
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise PresetError(f"preset key {unknown[0]!r}: must be one of {', '.join(known)}")
    out: dict[str, Any] = {}
    for preset in presets():
        out.update(preset.validate(value))
    return out


@contextlib.contextmanager
def apply_preset(value: dict[str, Any], run: Any) -> Iterator[Any]:
    """Apply a validated preset to `run` for the duration of the `with` (module docstring)."""
    value = validate_preset(dict(value))
    for preset in presets():
        if preset.check is not None:
            preset.check(value, run)
    with contextlib.ExitStack() as stack:
        for preset in sorted(presets(), key=lambda p: p.apply_order):
            if preset.key in value:
                run = stack.enter_context(preset.apply(value, run))
        yield run


def preset_for(settings: Any, model: Any, layout: Any) -> dict[str, Any]:
    """The preset a request seals: each preset's part of `settings` (layers, core_reuse, token_reduction,
    reference_rope, ...), given the model it runs on (layer thinning ranks its gates) and its layout (the 256x256
    rule)."""
    preset: dict[str, Any] = {}
    for p in presets():
        preset.update(p.from_settings(settings, model, layout))
    return validate_preset(preset)


def preset_lines(preset: Any) -> list[str]:
    """What a sealed preset does, one line per part (printed after a generation)."""
    p = dict(preset or {})
    return [f"preset {line}" for each in presets() if each.key in p for line in each.describe(p)]


__all__ = ["KEYS", "PresetError", "apply_preset", "preset_for", "preset_lines", "validate_preset"]
