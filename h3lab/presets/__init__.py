"""Speed presets (the seed's h3-metal presets), each a declared transform of a run, sealed with it.

  layer_thinning.py   --layers N: run N blocks chosen by the checkpoint's AdaLN gates; release the others' weights
  core_reuse.py       --core-reuse K: the block stack every K passes, patch projections and heads every pass
  token_reduction.py  --token-reduction: paired horizontal target-video tokens in the middle blocks, with a bypass
  rope_adaptation.py  the 256x256 RoPE halving (--use-reference-rope restores the released coordinates)
  registry.py         `Preset` (key, validate, apply, from_settings, describe, order) and `register_preset`
  field.py            the `RunSpec.preset` provider: loops over the registered presets; `preset_for(settings)`
  rules.py            request-level rules and the seed's warnings (what `GenerationSettings` checks)
  _blocks.py          skipping blocks from outside the model (shared by layer thinning and core reuse)
  errors.py           PresetError

Each preset file ends by registering its `Preset` and declaring its user setting (`h3lab.schema`: flag, REPL
command, panel control, summary part), so a new preset is one file (plus its import here) and its test.
Each preset is an `apply_X(run, ...)` context manager that changes the run's inputs, wraps its forward or attaches
torch hooks / forward overrides to the model's blocks for the run's duration, and undoes it on exit; the model has
no special case for any of them. Importing this package registers the `preset` field provider
(`h3lab.run.fields.FIELDS` names this module).

May import: the foundations, `execution`, `run` (spec, layout, sampler), `schema`.
"""

from ..run import FieldProvider, register_field
from .core_reuse import MAX_CORE_REUSE, apply_core_reuse, core_plan
from .errors import PresetError
from .field import KEYS, apply_preset, preset_for, preset_lines, validate_preset
from .layer_thinning import (
    apply_layer_thinning,
    choose_blocks,
    gate_scores,
    layer_range,
    missing_blocks,
    needed_blocks,
    needs_reload,
    release_dropped,
    released_blocks,
)
from .rope_adaptation import apply_rope_halving, is_native_256
from .rules import check_depth, check_settings
from .token_reduction import DEFAULT_SCHEDULE, apply_token_reduction

register_field("preset", FieldProvider(validate=validate_preset, apply=apply_preset), replace=True)

__all__ = [
    "DEFAULT_SCHEDULE", "KEYS", "MAX_CORE_REUSE", "PresetError", "apply_core_reuse", "apply_layer_thinning",
    "apply_preset", "apply_rope_halving", "apply_token_reduction", "check_depth", "check_settings", "choose_blocks",
    "core_plan", "gate_scores", "is_native_256", "layer_range", "missing_blocks", "needed_blocks", "needs_reload",
    "preset_for",
    "preset_lines", "release_dropped", "released_blocks", "validate_preset",
]
