"""The `RunSpec.preset` field: one provider validates and applies the whole preset JSON.

Keys (every one optional; `{}` is the full path and is never looked up):

  layers           N, the blocks layer thinning runs (`layer_thinning`)
  blocks           the sealed choice: N block indices in increasing order (the session fills it by ranking the
                   checkpoint's AdaLN gates; without it a run ranks the model it is given)
  core_reuse       K in 2..6 (`core_reuse`; 1 is the default and is dropped)
  token_reduction  true (the seed's schedule, sealed as the dict) or {start, end, early_end, early_evaluations}
  rope             "halved" (the 256x256 adaptation, automatic at that size) or "reference" (--use-reference-rope
                   at 256x256: the released coordinates, sealed as the user's choice); absent elsewhere

`validate_preset(value)` normalises it (one-line `PresetError` otherwise). `apply_preset(value, run)` applies, in
this order, each on the run the previous one yielded: RoPE halving (the inputs' positions), token reduction (block
hooks, on those positions), layer thinning (dropped blocks skip), core reuse (outermost: it decides per pass whether
the stack runs at all); core reuse with whole-velocity reuse is refused. `preset_for(settings, model, layout)` is
the preset a session request seals; `preset_lines(preset)` says what it chose.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..sampler import reuse_plan
from .core_reuse import apply_core_reuse, check_core_reuse, check_exclusive, core_plan
from .errors import PresetError
from .layer_thinning import apply_layer_thinning, check_blocks, check_layers, choose_blocks, dropped
from .rope_adaptation import ROPE_CHOICES, apply_rope_halving, check_native_256, is_native_256
from .token_reduction import DEFAULT_SCHEDULE, apply_token_reduction, check_schedule

KEYS = ("layers", "blocks", "core_reuse", "token_reduction", "rope")


def validate_preset(value: Any) -> dict[str, Any]:
    """The normalised preset JSON (module docstring)."""
    if not isinstance(value, dict):
        raise PresetError(f"preset={value!r}: must be an object")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise PresetError(f"preset key {unknown[0]!r}: must be one of {', '.join(KEYS)}")
    out: dict[str, Any] = {}
    if "blocks" in value and "layers" not in value:
        raise PresetError("preset blocks without layers: the sealed block list goes with layers=N")
    if "layers" in value:
        n = value["layers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PresetError(f"layers={n!r}: must be a positive integer number of transformer blocks")
        out["layers"] = n
        if "blocks" in value:
            out["blocks"] = list(check_blocks(value["blocks"], n))
    k = check_core_reuse(value.get("core_reuse", 1))
    if k > 1:
        out["core_reuse"] = k
    if "token_reduction" in value:
        schedule = check_schedule(value["token_reduction"])
        if schedule is not None:
            out["token_reduction"] = schedule
    if "rope" in value:
        if value["rope"] not in ROPE_CHOICES:
            raise PresetError(f"rope={value['rope']!r}: must be one of {', '.join(ROPE_CHOICES)}")
        out["rope"] = value["rope"]
    return out


@contextlib.contextmanager
def apply_preset(value: dict[str, Any], run: Any) -> Iterator[Any]:
    """Apply a validated preset to `run` for the duration of the `with` (module docstring)."""
    value = validate_preset(dict(value))
    k = value.get("core_reuse", 1)
    check_exclusive(k, run.reuse)
    n = run.schedule.num_passes
    stack_runs = [a and b for a, b in zip(reuse_plan(n, run.reuse), core_plan(n, k))]
    with contextlib.ExitStack() as stack:
        if value.get("rope") == "halved":
            run = stack.enter_context(apply_rope_halving(run))
        elif value.get("rope") == "reference":
            check_native_256(run, "rope='reference'")
        if "token_reduction" in value:
            run = stack.enter_context(apply_token_reduction(run, value["token_reduction"], stack_runs))
        if "layers" in value:
            num_layers = len(run.model.transformer_blocks)
            check_layers(value["layers"], num_layers)
            blocks = value.get("blocks") or choose_blocks(run.model, value["layers"])
            run = stack.enter_context(apply_layer_thinning(run, blocks))
        if k > 1:
            run = stack.enter_context(apply_core_reuse(run, k))
        yield run


def preset_for(settings: Any, model: Any, layout: Any) -> dict[str, Any]:
    """The preset a request seals: `settings` (layers, core_reuse, token_reduction, reference_rope), the model it
    runs on (layer thinning ranks its gates) and its layout (the 256x256 rule)."""
    preset: dict[str, Any] = {}
    num_layers = len(model.transformer_blocks)
    if settings.layers is not None and settings.layers != num_layers:
        n = check_layers(settings.layers, num_layers)
        preset.update(layers=n, blocks=list(choose_blocks(model, n)))
    if settings.core_reuse > 1:
        preset["core_reuse"] = settings.core_reuse
    if settings.token_reduction:
        preset["token_reduction"] = dict(DEFAULT_SCHEDULE)
    if is_native_256(layout):
        preset["rope"] = "reference" if settings.reference_rope else "halved"
    return validate_preset(preset)


def preset_lines(preset: Any) -> list[str]:
    """What a sealed preset does, one line per part (printed after a generation)."""
    p = dict(preset or {})
    lines = []
    if "layers" in p:
        blocks = p.get("blocks")
        if blocks:
            gone = dropped(blocks[-1] + 1, blocks)  # the final block is protected: its index + 1 is the depth
            lines.append(f"layers {p['layers']} of {blocks[-1] + 1}: dropped blocks {', '.join(map(str, gone))} "
                         "(lowest mean |AdaLN gate|; first and final protected)")
        else:
            lines.append(f"layers {p['layers']} (blocks ranked by the model's AdaLN gates at run time)")
    if "core_reuse" in p:
        lines.append(f"core reuse {p['core_reuse']}: the block stack every {p['core_reuse']} passes and on the last; "
                     "patch projections and heads every pass")
    if "token_reduction" in p:
        s = p["token_reduction"]
        lines.append(f"token reduction: blocks {s['start']}..{s['early_end'] - 1} for the first "
                     f"{s['early_evaluations']} evaluations, {s['start']}..{s['end'] - 1} after")
    if p.get("rope") == "halved":
        lines.append("rope: spatial coordinates halved at 256x256 (--use-reference-rope restores the released ones)")
    elif p.get("rope") == "reference":
        lines.append("rope: released coordinates at 256x256 (--use-reference-rope)")
    return [f"preset {line}" for line in lines]


__all__ = ["KEYS", "PresetError", "apply_preset", "preset_for", "preset_lines", "validate_preset"]
