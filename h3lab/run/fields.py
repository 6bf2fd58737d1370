"""The extension fields of a `RunSpec`: values another room validates and applies, registered by field name.

Fields, their JSON defaults, the room that provides them, in the order they are applied to a run:

  adapters   ()  LoRA adapters, e.g. [{"name": ..., "sha256": ..., "scale": 1.0}]    h3lab.adapters.field
  lora_scale {}  the adapter's strength per block and per modality of the output
                 rows, e.g. {"blocks": [[0, 19, 0.0]], "audio": 0.3}                 h3lab.adapters.lora_scale
  factors    ()  ablation factor names, e.g. ["A2", "H5"]                              h3lab.research.ablation
  preset     {}  speed preset: layer thinning, core reuse, token reduction, RoPE
                 adaptation, residency, e.g. {"layers": 45, "token_reduction": true}  h3lab.presets
  placement  {}  device topology, e.g. {"tp": 2, "cp": 1, "sp": 1}; {} = one
                 process, on the device of the model and the inputs                   h3lab.distributed
  residency  {}  where the DiT's blocks live during the run, e.g. {"policy":
                 "streamed", "slots": 2, "gpu_memory_gib": 40.0}; {} = resident      h3lab.components.store

Adapters first (they define the weights that run), then their per-block and per-modality strength, then the factors (perturbations), then the preset (what a speed
preset changes is applied to the perturbed run), then the placement (sharding wraps the finished model), then the
residency (it moves whatever weights the blocks of the final model hold; it never changes a byte of the result).

A default value is never looked up: a plain run imports none of those rooms. A non-default value needs a provider:

    from h3lab.run import FieldProvider, register_field

    @contextlib.contextmanager
    def apply_placement(value, run):          # value: the thawed JSON value; run: a `ResolvedRun`
        handle = shard(run.model, value)      # change the model / loop for the duration of the run ...
        try:
            yield run.replace(forward=...)    # ... and yield the run to continue with
        finally:
            handle.undo()

    register_field("placement", FieldProvider(validate=check_placement, apply=apply_placement))

`validate(value) -> value` normalises a JSON value or raises an `H3Error` naming the value and the rule; it runs when
a spec is built, so a bad value never reaches a run. `apply(value, run)` is a context manager entered when the run
starts and exited when it ends (also on error), innermost last. The provider's module registers at import and is
declared in `FIELDS.modules` (the one line a new room adds here): the first spec that carries a non-default value
imports it. A non-default value that nobody provides fails closed with a one-line `RunSpecError`.

Values are stored frozen (`freeze`: dicts -> read-only mappings, lists -> tuples) so a spec cannot change after its
hash is taken; `thaw` gives the JSON form back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

from .registry import Registry, RunSpecError

if TYPE_CHECKING:  # pragma: no cover
    from .loop import ResolvedRun

EXTENSION_FIELDS = ("adapters", "lora_scale", "factors", "preset", "placement", "residency")  # application order
DEFAULTS: dict[str, Any] = {"adapters": (), "lora_scale": MappingProxyType({}), "factors": (),
                            "preset": MappingProxyType({}), "placement": MappingProxyType({}),
                            "residency": MappingProxyType({})}

FIELDS = Registry("run-spec field", {
    "adapters": "h3lab.adapters.field",
    "lora_scale": "h3lab.adapters.lora_scale",
    "factors": "h3lab.research.ablation",
    "preset": "h3lab.presets",
    "placement": "h3lab.distributed",
    "residency": "h3lab.components.store",
})


@dataclass(frozen=True)
class FieldProvider:
    """How a room validates (`validate(value) -> value`) and applies (`apply(value, run) -> context manager yielding
    the run to continue with`) a non-default value of one extension field (see the module docstring). Optional
    `locate(value, point, packed_row, seq_len) -> dict` says where a packed row lives under the value (the placement:
    which rank holds it, with a `text` for reports), so a report names it without importing the providing room."""

    validate: Callable[[Any], Any]
    apply: Callable[[Any, "ResolvedRun"], ContextManager["ResolvedRun"]]
    locate: Callable[[Any, str, int, int], dict] | None = None


def register_field(name: str, provider: FieldProvider, *, replace: bool = False) -> None:
    """Provide the extension field `name` (one of `EXTENSION_FIELDS`)."""
    if name not in EXTENSION_FIELDS:
        raise RunSpecError(f"field {name!r}: extension fields are {', '.join(EXTENSION_FIELDS)}")
    if not isinstance(provider, FieldProvider):
        raise RunSpecError(f"field {name!r}: the provider must be a FieldProvider, got {type(provider).__name__}")
    FIELDS.register(name, provider, replace=replace)


def provider(name: str) -> FieldProvider:
    found = FIELDS.get(name)
    if found is None:
        raise RunSpecError(f"RunSpec.{name}: no provider is registered ({FIELDS.where(name)} is missing or "
                           "registers none)")
    return found


# ---------------------------------------------------------------------------------------------- JSON values
def freeze(value: Any, where: str = "value") -> Any:
    """JSON value -> immutable equivalent (read-only mappings with string keys, tuples); refuses anything else."""
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise RunSpecError(f"{where}: key {bad[0]!r} is not a string (JSON objects have string keys)")
        return MappingProxyType({k: freeze(v, f"{where}.{k}") for k, v in sorted(value.items())})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, float) and not math.isfinite(value):
        raise RunSpecError(f"{where}={value!r}: must be a finite number (JSON has no NaN or infinity)")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise RunSpecError(f"{where} is a {type(value).__name__}: must be JSON (objects, arrays, strings, numbers, "
                       "booleans, null)")


def thaw(value: Any) -> Any:
    """The JSON form of a frozen value (dicts and lists)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def is_default(name: str, value: Any) -> bool:
    return thaw(value) == thaw(DEFAULTS[name])


def check_field(name: str, value: Any) -> Any:
    """The frozen, provider-normalised value of field `name` (default for None); raises a one-line RunSpecError."""
    if value is None:
        return DEFAULTS[name]
    frozen = freeze(value, name)
    if isinstance(DEFAULTS[name], tuple) != isinstance(frozen, tuple):
        kind = "an array" if isinstance(DEFAULTS[name], tuple) else "an object"
        raise RunSpecError(f"{name}={thaw(frozen)!r}: must be {kind}")
    if is_default(name, frozen):
        return DEFAULTS[name]
    found = FIELDS.get(name)
    if found is None:
        raise RunSpecError(
            f"{name}={json.dumps(thaw(frozen), sort_keys=True)}: no provider is registered for RunSpec.{name} "
            f"({FIELDS.where(name)} is missing or registers none), so nothing could apply it"
        )
    return freeze(found.validate(thaw(frozen)), name)
