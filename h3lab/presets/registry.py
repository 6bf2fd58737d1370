"""`Preset`: one speed preset as one registered object, and `PRESETS`, the table `presets.field` loops over.

A preset owns one or more keys of the `RunSpec.preset` JSON (`keys`, its main `key` first) and says, as plain
callables:

  validate(value) -> dict          its normalised part of the whole preset JSON `value` ({}: absent / the default);
                                   one-line `PresetError` otherwise
  check(value, run)                optional: a rule against the run, checked for every preset before any applies
  apply(value, run) -> cm          a context manager yielding the run to continue with (`value`: the whole validated
                                   preset JSON, so a preset can read another's part, e.g. token reduction the core
                                   reuse interval); entered only when its key is in the preset
  from_settings(s, model, layout)  the part a request (`GenerationSettings`) seals ({}: nothing)
  describe(value) -> lines         what its part does, one line each (printed after a generation)

`order` is the declared order (validation, the preset's keys, the describe lines); `apply_order` the application
order (lower first, each on the run the previous one yielded). A new preset is one file that builds a `Preset`,
calls `register_preset` and declares its user setting (`h3lab.schema`), imported by `presets/__init__.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager


@dataclass(frozen=True)
class Preset:
    key: str
    validate: Callable[[dict], dict]
    apply: Callable[[dict, Any], ContextManager[Any]]
    from_settings: Callable[[Any, Any, Any], dict]
    describe: Callable[[dict], list[str]]
    order: int
    apply_order: int
    keys: tuple[str, ...] = ()
    check: Callable[[dict, Any], None] | None = None

    def __post_init__(self) -> None:
        if not self.keys:
            object.__setattr__(self, "keys", (self.key,))
        if self.keys[0] != self.key:
            raise ValueError(f"preset {self.key!r}: its keys must start with its key, got {self.keys!r}")


_PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add `preset` to the table (a key taken by another preset raises at import)."""
    taken = [k for k in preset.keys if any(k in p.keys for n, p in _PRESETS.items() if n != preset.key)]
    if taken:
        raise ValueError(f"preset {preset.key!r}: the key {taken[0]!r} belongs to another preset")
    _PRESETS[preset.key] = preset
    return preset


def presets() -> list[Preset]:
    """The registered presets in their declared `order`."""
    return sorted(_PRESETS.values(), key=lambda p: p.order)


def keys() -> tuple[str, ...]:
    """Every key of the preset JSON, in declared order."""
    return tuple(k for p in presets() for k in p.keys)
