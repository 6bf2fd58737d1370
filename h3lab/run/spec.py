"""`RunSpec`: one immutable, serialisable description of a denoise run -- the one record session, verify, drift, the
ablation matrix and the arms build, run and seal.

Contract
--------
`RunSpec(inputs, schedule, mode="off", variant="transformer", fingerprint="", layout=None, factors=(),
stepper="euler", reuse=1, reuse_mode="linear", preset={}, placement={}, adapters=(), residency={}, lora_scale={},
stepper_params={}, custom=None, label="")`

  inputs       `DenoiseInputs`, the sealed tensors (text, initial rows, layout index tensors, per-pass plan)
  schedule     the sealed `DualSchedule` (its plan must match the inputs' pass count)
  mode         runtime mode the forwards run in ("strict" | "audit" | "auto" | "off")
  variant      model identity: "transformer" / "transformer_ref" (the snapshot partition), "diffusers" (the P side
               of the arms); `fingerprint` the checkpoint fingerprint ("" = not pinned; the recorder fills it in)
  layout       the `PackedLayout` the inputs were sealed from (None: factors that rebuild the layout or the plan --
               H1, H10, H11, H12 -- cannot apply); must hash to `inputs.layout_sha256` when both are given
  factors      ablation factor names (provided by `h3lab.research.ablation`; canonical order; see `fields.py`)
  stepper      registered stepper name (`steppers.py`): "euler", "diffusers", "negated_velocity", "flow_sde", ...
  stepper_params  the stepper's parameters (a JSON object, validated by its provider; {} for steppers without
               any), e.g. {"level": {"video": 0.7, "audio": 0.7}, "seed": 5, "requests": [0, 1], "window": null}; in
               the JSON description only when not empty, so specs sealed before it existed keep their sha256
  reuse        whole-denoiser reuse: evaluate every `reuse`-th pass (+ first and last), extrapolate the others
               with `reuse_mode` ("linear" | "hold"), `sampler.reuse_plan` / `extrapolate_velocity`
  preset, placement, adapters, residency, lora_scale   extension fields (speed presets, device topology, LoRA
               adapters, where the DiT's blocks live, the adapter's strength per block and modality -- in the JSON
               description only when not the default): JSON values with empty defaults, validated and applied by
               the rooms that register them (`fields.py`); a non-default value nobody provides fails closed when
               the spec is built.
               `residency` (streamed blocks, `h3lab.components.streaming`) and `placement` never change a result byte:
               they are the run record, not the result hash (see "Identity"); `residency` is in the JSON description
               only when it is not the default, so descriptions sealed before it existed are unchanged
  custom       `Custom` research callables (op overrides, hooks, a stepper object); a spec carrying them is not
               sealable by name (`sealable` is False): its JSON records what was attached but cannot re-create it,
               and `verify` refuses to replay such a trajectory
  label        a display name (drift reports); not part of the identity

Everything but `inputs`, `layout` tensors and `custom` callables is JSON. `to_dict()` is the JSON description: the
scalar fields, the schedule's sigmas and hashes, the layout's description, and the SHA-256 of every sealed tensor
(`tensors()`: the inputs' and `layout.<name>`). `from_dict(data, tensors)` rebuilds a spec from the description and
its sealed tensors and checks each tensor's hash.

Identity
--------
The description splits in two:

  result hash  `sha256` (= `result_sha256`): SHA-256 of `result_identity()`, everything that can change a result
               byte -- weights (variant, fingerprint), inputs (every sealed tensor's SHA-256, the layout), schedule,
               mode, stepper and its parameters, reuse, factors, preset, custom callables, and each LoRA adapter by
               its CONTENT (`sha256`) and `scale`. Stable across processes and devices (bytes, not addresses).
  run record   `run_record()`: where and how it ran -- `placement` (topology: strict forwards are byte-equal on every
               topology), `residency` (streamed blocks never change a byte), each adapter's `name` and `path`.
               The execution plan (`h3lab.components.execution`) hands these values to the spec; a trajectory
               records them beside the result hash, and `verify` reports them.

So moving an adapter file, streaming the blocks or sharding the model keeps the result hash; changing the mode, the
steps or the adapter's bytes changes it. `description_sha256` is the SHA-256 of the whole description without the
label: the single identity of specs sealed before the split (a trajectory's `spec_sha256`, which `load` still
checks on old manifests).

A spec carries factor names, not their effects: `loop.resolve` re-derives a factor's overrides, hooks, stepper,
inputs, schedule or model each time the spec runs, so a replay applies exactly the perturbation that ran.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..execution import runtime
from ..hashing import digest_mismatch, json_sha256, tensor_digest
from .layout import PackedLayout
from .sampler import REUSE_MODES, DualSchedule, Schedule, ScheduleError, timesteps
from .fields import DEFAULTS, EXTENSION_FIELDS, check_field, is_default, thaw
from .inputs import DenoiseInputs
from .registry import RunSpecError
from .steppers import check_stepper_params, make_stepper

FORMAT = "h3lab-runspec/1"
LAYOUT_PREFIX = "layout."
RECORD_FIELDS = ("placement", "residency")  # where and how it ran: the run record, never the result hash
ADAPTER_RESULT_KEYS = ("sha256", "scale")  # an adapter's content and strength; its name and path are the record's


@dataclass(frozen=True)
class Custom:
    """Research callables attached to a run: op `overrides` (name -> fn, as `runtime.use_overrides`), perturbation
    `hooks` (`fn(point, tensor) -> tensor | None`, as `model.add_hook`), a `stepper` object. Not sealable by name.
    `Custom.described(d)` is what a sealed spec holds instead: the description, no callables (it cannot run)."""

    overrides: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    hooks: tuple = ()
    stepper: Any = None
    description: Mapping[str, Any] | None = None  # set only on a Custom rebuilt from JSON

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", dict(self.overrides))
        object.__setattr__(self, "hooks", tuple(self.hooks))

    @classmethod
    def described(cls, description: Mapping[str, Any]) -> "Custom":
        return cls(description=dict(description))

    @property
    def runnable(self) -> bool:
        return self.description is None

    def describe(self) -> dict[str, Any]:
        if self.description is not None:
            return dict(self.description)
        return {"overrides": sorted(self.overrides), "hooks": len(self.hooks),
                "stepper": None if self.stepper is None else type(self.stepper).__name__}

    def merged(self, other: "Custom") -> "Custom":
        clash = sorted(set(self.overrides) & set(other.overrides))
        if clash:
            raise RunSpecError(f"custom overrides of {clash}: already overridden by this spec")
        if self.stepper is not None and other.stepper is not None:
            raise RunSpecError("custom stepper: this spec already carries one")
        return Custom({**self.overrides, **other.overrides}, self.hooks + other.hooks, other.stepper or self.stepper)

    def __bool__(self) -> bool:
        return bool(self.overrides or self.hooks or self.stepper is not None or self.description)


def _layout_tensor_names(layout: PackedLayout) -> list[str]:
    return [f.name for f in dataclasses.fields(layout) if isinstance(getattr(layout, f.name), torch.Tensor)]


def schedule_from_dict(data: Mapping[str, Any]) -> DualSchedule:
    """A `DualSchedule` from its `to_dict()`, rebuilt from the recorded float32 sigmas (any grid, not only the
    built ones: H11's generic grid round-trips too); each grid must reproduce its recorded SHA-256."""
    grids = []
    for name in ("video", "audio"):
        d = data[name]
        sigmas = torch.tensor([float(s) for s in d["sigmas"]], dtype=torch.float32)
        grid = Schedule(float(d["shift"]), int(d["num_points"]), sigmas, timesteps(sigmas))
        if grid.sha256 != d["sha256"]:
            raise RunSpecError(f"{name} sigma grid: its sigmas hash to {grid.sha256}, the record says {d['sha256']}")
        grids.append(grid)
    return DualSchedule(*grids)


@dataclass(frozen=True, eq=False)
class RunSpec:
    """One sealed description of a run (see the module docstring)."""

    inputs: DenoiseInputs
    schedule: DualSchedule
    mode: str = "off"
    variant: str = "transformer"
    fingerprint: str = ""
    layout: PackedLayout | None = None
    factors: tuple[str, ...] = ()
    stepper: str = "euler"
    reuse: int = 1
    reuse_mode: str = "linear"
    preset: Mapping[str, Any] = field(default_factory=lambda: DEFAULTS["preset"])
    placement: Mapping[str, Any] = field(default_factory=lambda: DEFAULTS["placement"])
    adapters: tuple = ()
    residency: Mapping[str, Any] = field(default_factory=lambda: DEFAULTS["residency"])
    lora_scale: Mapping[str, Any] = field(default_factory=lambda: DEFAULTS["lora_scale"])
    stepper_params: Mapping[str, Any] = field(default_factory=dict)
    custom: Custom | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.inputs, DenoiseInputs):
            raise RunSpecError(f"inputs is a {type(self.inputs).__name__}: must be DenoiseInputs")
        if not isinstance(self.schedule, DualSchedule):
            raise RunSpecError(f"schedule is a {type(self.schedule).__name__}: must be a sampler.DualSchedule")
        if self.inputs.num_passes != self.schedule.num_passes:
            raise RunSpecError(
                f"inputs carry a plan for {self.inputs.num_passes} passes but the schedule has "
                f"{self.schedule.num_passes}: seal the inputs for this schedule (DenoiseInputs.from_layout)"
            )
        try:
            runtime.check_mode(self.mode)
        except ValueError as err:
            raise RunSpecError(str(err)) from None
        for name in ("variant", "fingerprint", "label"):
            if not isinstance(getattr(self, name), str):
                raise RunSpecError(f"{name}={getattr(self, name)!r}: must be a string")
        if not self.variant:
            raise RunSpecError("variant='': name the model (transformer, transformer_ref, diffusers, ...)")
        if self.layout is not None:
            if not isinstance(self.layout, PackedLayout):
                raise RunSpecError(f"layout is a {type(self.layout).__name__}: must be a PackedLayout or None")
            if self.inputs.layout_sha256 and self.inputs.layout_sha256 != self.layout.sha256():
                raise RunSpecError(
                    f"layout sha256 {self.layout.sha256()[:16]}: the inputs were sealed from layout "
                    f"{self.inputs.layout_sha256[:16]} (pass the layout the inputs were built from)"
                )
        if isinstance(self.reuse, bool) or not isinstance(self.reuse, int) or self.reuse < 1:
            raise RunSpecError(f"reuse={self.reuse!r}: must be an integer >= 1")
        if self.reuse_mode not in REUSE_MODES:
            raise RunSpecError(f"reuse_mode={self.reuse_mode!r}: must be one of {', '.join(REUSE_MODES)}")
        object.__setattr__(self, "stepper_params", check_stepper_params(self.stepper, self.stepper_params))
        if self.stepper_params:  # rules that need the schedule or the inputs fail here, not mid-run
            stepper = make_stepper(self.stepper, self.schedule, self.stepper_params)
            if hasattr(stepper, "check_inputs"):
                stepper.check_inputs(self.inputs)
        if self.custom is not None and not isinstance(self.custom, Custom):
            raise RunSpecError(f"custom is a {type(self.custom).__name__}: must be a run.Custom or None")
        if self.custom is not None and not self.custom:
            object.__setattr__(self, "custom", None)
        for name in EXTENSION_FIELDS:
            object.__setattr__(self, name, check_field(name, getattr(self, name)))

    # ------------------------------------------------------------------------------------------- changes
    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> "RunSpec":
        """The same spec with its inputs on `device` (the identity does not change: it hashes bytes)."""
        return self.replace(inputs=self.inputs.to(device))

    def with_record(self, **record: Any) -> "RunSpec":
        """The same result in another run record: `placement`, `residency` and `adapters` (the same adapters by
        content and scale, at other paths or names) replaced; the result hash does not change (an adapters value of
        other content raises `RunSpecError`)."""
        unknown = sorted(set(record) - set(RECORD_FIELDS) - {"adapters"})
        if unknown:
            raise RunSpecError(f"run record field {unknown[0]!r}: the record holds {', '.join(RECORD_FIELDS)}, adapters")
        moved = self.replace(**record)
        if moved.sha256 != self.sha256:
            raise RunSpecError("adapters: another adapter content or scale is another result, not another run record "
                               f"(result hash {moved.sha256[:16]} != {self.sha256[:16]})")
        return moved

    def with_factors(self, *names: str) -> "RunSpec":
        return self.replace(factors=tuple(self.factors) + tuple(names))

    def with_custom(self, overrides: Mapping[str, Callable] | None = None, hooks: tuple = (),
                    stepper: Any = None) -> "RunSpec":
        """This spec with research callables attached (merged with any it carries; the result is not sealable)."""
        extra = Custom(overrides or {}, tuple(hooks), stepper)
        return self.replace(custom=extra if self.custom is None else self.custom.merged(extra))

    # ------------------------------------------------------------------------------------------- identity
    @property
    def sealable(self) -> bool:
        """True when the JSON description re-creates this run exactly (no custom callables attached)."""
        return self.custom is None

    @property
    def tag(self) -> str:
        """The label, or mode + factors ("off+H5")."""
        return self.label or "+".join((self.mode,) + tuple(self.factors))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every sealed tensor: the inputs' (their safetensors keys) and the layout's (`layout.<name>`, copies: the
        inputs share the layout's index tensors, and safetensors refuses shared storage)."""
        out = dict(self.inputs.tensors())
        if self.layout is not None:
            out.update({LAYOUT_PREFIX + n: getattr(self.layout, n).clone() for n in _layout_tensor_names(self.layout)})
        return out

    @functools.cached_property
    def tensor_hashes(self) -> dict[str, str]:
        """name -> SHA-256 (scheme "sha256") of every sealed tensor (computed once per spec object)."""
        return {k: tensor_digest(v, "sha256") for k, v in self.tensors().items()}

    def to_dict(self) -> dict[str, Any]:
        """The JSON description (see the module docstring)."""
        layout = None
        if self.layout is not None:
            layout = self.layout.to_dict()
            layout.pop("tensors")
        return {
            "format": FORMAT,
            "label": self.label,
            "model": {"variant": self.variant, "fingerprint": self.fingerprint},
            "mode": self.mode,
            "inputs": {"meta": self.inputs.meta(), "sha256": dict(self.tensor_hashes)},
            "layout": layout,
            "schedule": self.schedule.to_dict(),
            "factors": list(self.factors),
            "stepper": self.stepper,
            "reuse": {"k": self.reuse, "mode": self.reuse_mode},
            **{name: thaw(getattr(self, name)) for name in ("preset", "placement", "adapters")},
            "custom": None if self.custom is None else self.custom.describe(),
            "sealable": self.sealable,
            **({} if is_default("residency", self.residency) else {"residency": thaw(self.residency)}),
            **({"stepper_params": thaw(self.stepper_params)} if self.stepper_params else {}),
            **({} if is_default("lora_scale", self.lora_scale) else {"lora_scale": thaw(self.lora_scale)}),
        }

    def result_identity(self) -> dict[str, Any]:
        """What can change a result byte (see "Identity" in the module docstring): the JSON description without the
        label and the run record's fields, each adapter by its content (sha256) and scale only."""
        identity = self.to_dict()
        identity.pop("label")
        for name in RECORD_FIELDS:
            identity.pop(name, None)
        identity["adapters"] = [{k: a[k] for k in ADAPTER_RESULT_KEYS if k in a} for a in identity["adapters"]]
        return identity

    @functools.cached_property
    def sha256(self) -> str:
        """The result hash: SHA-256 of `result_identity()`. Equal for two specs that must produce the same bytes
        wherever and however they run (another residency, topology or adapter path)."""
        return json_sha256(self.result_identity())

    @property
    def result_sha256(self) -> str:
        """`sha256`, by the name a manifest records it under."""
        return self.sha256

    def run_record(self) -> dict[str, Any]:
        """Where and how the spec runs, beside the result hash and never inside it: the placement (topology), the
        residency (where the DiT's blocks live) and each adapter's name and path (JSON)."""
        record = {name: thaw(getattr(self, name)) for name in RECORD_FIELDS}
        record["adapters"] = [{k: v for k, v in a.items() if k not in ADAPTER_RESULT_KEYS}
                              for a in thaw(self.adapters)]
        return record

    @functools.cached_property
    def description_sha256(self) -> str:
        """SHA-256 of the whole JSON description without the label: the single identity specs were sealed under
        before the result hash / run record split (a trajectory's `spec_sha256`); `load` checks old manifests by it."""
        identity = self.to_dict()
        identity.pop("label")
        return json_sha256(identity)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> "RunSpec":
        """Rebuild a spec from `to_dict()` and its sealed tensors; every tensor must match its recorded hash."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise RunSpecError(f"run spec format {got!r}: expected {FORMAT!r}")
        try:
            problem = digest_mismatch(tensors, data["inputs"]["sha256"])
            if problem is not None:
                raise RunSpecError(f"run spec: sealed {problem}")
            inputs = DenoiseInputs.from_tensors(dict(tensors), data["inputs"]["meta"])
            layout = None
            if data["layout"] is not None:
                lt = {n[len(LAYOUT_PREFIX):]: t.tolist() for n, t in tensors.items() if n.startswith(LAYOUT_PREFIX)}
                layout = PackedLayout.from_dict({**data["layout"], "tensors": lt})
            custom = None if data["custom"] is None else Custom.described(data["custom"])
            return cls(
                inputs=inputs, schedule=schedule_from_dict(data["schedule"]), mode=data["mode"],
                variant=data["model"]["variant"], fingerprint=data["model"]["fingerprint"], layout=layout,
                factors=tuple(data["factors"]), stepper=data["stepper"], reuse=data["reuse"]["k"],
                reuse_mode=data["reuse"]["mode"], preset=data["preset"], placement=data["placement"],
                adapters=data["adapters"], residency=data.get("residency"),
                stepper_params=data.get("stepper_params"), lora_scale=data.get("lora_scale"), custom=custom,
                label=data.get("label", ""),
            )
        except (KeyError, TypeError) as err:
            raise RunSpecError(f"run spec: missing or malformed field ({err})") from None
        except ScheduleError as err:
            raise RunSpecError(f"run spec schedule: {err}") from None
