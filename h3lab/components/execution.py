"""`ExecutionPlan`: where and how runs execute -- device, placement (a device mesh), residency and streaming budget --
in one object with one owner.

Contract
--------
`ExecutionPlan(device, residency="resident", gpu_memory=None, mesh=None)` (frozen; `check_plan` runs at construction):

  device      the `torch.device` the components and the inputs live on
  residency   "resident" | "phased" | "streamed" (`RESIDENCIES`): phased releases each component after its phase (the
              store does that), streamed keeps the DiT's blocks in host memory and streams them through two device
              slots (`streaming`)
  gpu_memory  GiB, streamed only: the budget for the DiT's tensors on the device (the blocks that fit stay resident)
  mesh        an `h3lab.distributed` Mesh, or None (one process): every transformer is parallelized on it in place;
              streamed with a mesh streams after `parallelize`, so each rank pins and streams only its TP shard
              (byte-equal to resident on that mesh); refused with cp > 1 (every CP rank holds the whole TP shard:
              each would pin its own host copy, and ranks sharing one pinned arena do not exist)

A bad value is a one-line `ValidationError` naming it and the rule. `replace(**changes)` is a checked copy.

The plan is the one owner of those choices; the component store holds it (`ComponentStore.plan`) and both halves
come from here:
- `place(model, variant)` makes a DiT's placement the plan's: parallelized on the mesh (`h3lab.distributed
  .parallelize`, once per model, named by its variant; a streamed model is made resident first, since sharding
  replaces its tensors), then streamed under the budget, or resident on the device (a streamer is removed). `streaming_plan(model_or_config)` is the streaming plan of a model under the budget (raises
  when even streaming every block does not fit).
- `spec_fields()` -> {"placement": ..., "residency": ...}: the sealed description a `RunSpec` gets
  (`pipeline.build_spec`), and what `trajectory.verify(execution=...)` replays under. `placement_value()` is the
  mesh topology ({} without a mesh), `residency_value()` the streamed policy ({} unless streamed). Both are the spec's
  run record (`RunSpec.run_record`), never its result hash: no choice of this plan changes a result byte.
- `describe()`: the policy, and per given model what stays on the device.

May import: streaming / residency (this room), `h3lab.distributed` lazily (only with a mesh), errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ValidationError
from . import streaming

RESIDENCIES = ("resident", "phased", "streamed")


@dataclass(frozen=True)
class ExecutionPlan:
    """Device, placement, residency and streaming budget of a session's runs (see the module docstring)."""

    device: torch.device
    residency: str = "resident"
    gpu_memory: float | None = None
    mesh: Any = None

    def __post_init__(self) -> None:
        check_plan(self.residency, self.gpu_memory, self.mesh)
        object.__setattr__(self, "device", torch.device(self.device))
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", float(self.gpu_memory))

    def replace(self, **changes: Any) -> "ExecutionPlan":
        return dataclasses.replace(self, **changes)

    @property
    def streamed(self) -> bool:
        return self.residency == "streamed"

    # -------------------------------------------------------------------------------------- the spec's half
    def placement_value(self) -> dict[str, Any]:
        """`RunSpec.placement`: the mesh's topology, {} for one process."""
        if self.mesh is None:
            return {}
        t = self.mesh.topology
        return {"tp": t.tp, "cp": t.cp, "sp": t.sp, "row_parallel": t.row_parallel}

    def residency_value(self) -> dict[str, Any]:
        """`RunSpec.residency`: {} unless streamed."""
        if not self.streamed:
            return {}
        return streaming.residency_value("streamed", self.gpu_memory)

    def spec_fields(self) -> dict[str, Any]:
        """What a run spec records of this plan (its run record's placement and residency)."""
        return {"placement": self.placement_value(), "residency": self.residency_value()}

    # -------------------------------------------------------------------------------------- the model's half
    def streaming_plan(self, model: Any):
        """The streaming plan of `model` (a model, or a meta-device model built from a config) under the budget."""
        return streaming.plan_for_model(model, self.gpu_memory)

    def place(self, model: Any, variant: str) -> Any:
        """Make a DiT's placement this plan's (see the module docstring); returns the model."""
        if self.mesh is not None:
            from ..distributed import parallelize, placement_of

            if placement_of(model) is None:
                if (streamer := streaming.streamer_of(model)) is not None:
                    streamer.remove(restore=True)
                parallelize(model, self.mesh, name=variant, weights_on_host=self.streamed)
        current = streaming.streamer_of(model)
        if self.streamed:
            plan = self.streaming_plan(model)
            if current is None or current.plan != plan or current.device != self.device:
                streaming.stream_blocks(model, self.device, gpu_memory_gib=self.gpu_memory)
        elif current is not None:
            current.remove(restore=True)
        return model

    def describe(self, models: dict[str, Any] | None = None) -> list[str]:
        """The policy, and per loaded DiT (`models`: variant -> model) what stays on the device."""
        budget = f", budget {self.gpu_memory:g} GiB" if self.gpu_memory is not None else ""
        lines = [f"residency {self.residency}{budget}"]
        for variant, model in (models or {}).items():
            streamer = streaming.streamer_of(model)
            if streamer is not None and streamer.plan is not None:
                lines.append(f"  {variant}: {streamer.plan.describe()}")
        if self.streamed and len(lines) == 1:
            lines.append("  the DiT's blocks stream from host memory once it loads")
        return lines


def check_plan(residency: str, gpu_memory: float | None = None, mesh: Any = None) -> str:
    """The rules of an `ExecutionPlan` (module docstring); returns `residency`."""
    if residency not in RESIDENCIES:
        raise ValidationError(f"residency={residency!r}: must be one of {', '.join(RESIDENCIES)}")
    if gpu_memory is not None:
        if residency != "streamed":
            raise ValidationError(f"gpu_memory={gpu_memory!r}: a GPU memory budget needs residency='streamed' (the "
                                  f"blocks that do not fit stream), not {residency!r}")
        streaming.check_gpu_memory(gpu_memory)
    if mesh is not None and residency == "streamed" and mesh.topology.cp > 1:
        raise ValidationError(f"residency='streamed' with cp={mesh.topology.cp}: every CP rank holds the whole TP "
                              "shard, so each would pin its own host copy (no shared pinned arena exists); stream "
                              "on a TP mesh (cp 1), or run context parallel resident")
    return residency
