"""`ExecutionPlan`: where and how runs execute -- device, placement (a device mesh), residency and streaming budget --
in one object with one owner.

Contract
--------
`ExecutionPlan(device, residency="resident", gpu_memory=None, mesh=None, adaln="resident")` (frozen; `check_plan` runs
at construction):

  device      the `torch.device` the components and the inputs live on
  residency   "resident" | "phased" | "streamed" (`RESIDENCIES`): phased releases each component after its phase (the
              store does that), streamed keeps the DiT's blocks in host memory and streams them through two device
              slots (`streaming`)
  gpu_memory  GiB, streamed only: the budget for the DiT's tensors on the device (the blocks that fit stay resident)
  mesh        an `h3lab.distributed` Mesh, or None (one process): every transformer is parallelized on it in place;
              streamed with a mesh streams after `parallelize`, so each rank pins and streams only its TP shard
              (byte-equal to resident on that mesh); refused with cp > 1 (every CP rank holds the whole TP shard:
              each would pin its own host copy, and ranks sharing one pinned arena do not exist)
  adaln       "resident" | "tables": "tables" keeps the blocks' AdaLN weights (about 13B of the released 33B
              parameters) in pinned host memory and serves every forward from AdaLN tables computed ahead
              (`adaln_host.py`, `h3lab.model.adaln_tables`); composes with every residency (streamed blocks then
              stream without their AdaLN weights); refused with a mesh

A bad value is a one-line `ValidationError` naming it and the rule. `replace(**changes)` is a checked copy.

The plan is the one owner of those choices; the component store holds it (`ComponentStore.plan`) and both halves
come from here:
- `place(model, variant)` makes a DiT's placement the plan's: parallelized on the mesh (`h3lab.distributed
  .parallelize`, once per model, named by its variant; a streamed model is made resident first, since sharding
  replaces its tensors), its AdaLN weights kept in host memory (tables) or with the model, then streamed under the
  budget, or resident on the device (a streamer is removed; every other tensor moves to the device). Switching the
  AdaLN placement of a streamed model re-streams it (its units change). `streaming_plan(model)` is the plan of a
  model (a meta model works) under the budget, the AdaLN tables counted (`residency.PLANNED_TABLE_ROWS` rows):
  the streamed plan, or the resident one (nothing streams); it raises when even streaming every block does not
  fit.
- `spec_fields()` -> {"placement": ..., "residency": ...}: the sealed description a `RunSpec` gets
  (`pipeline.build_spec`), and what `trajectory.verify(execution=...)` replays under. `placement_value()` is the
  mesh topology ({} without a mesh), `residency_value()` the streamed policy and the AdaLN placement ({} unless
  streamed or tables). Both are the spec's
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
from . import adaln_host, streaming
from .residency import ADALN, PLANNED_TABLE_ROWS, registered

RESIDENCIES = ("resident", "phased", "streamed")


@dataclass(frozen=True)
class ExecutionPlan:
    """Device, placement, residency and streaming budget of a session's runs (see the module docstring)."""

    device: torch.device
    residency: str = "resident"
    gpu_memory: float | None = None
    mesh: Any = None
    adaln: str = "resident"

    def __post_init__(self) -> None:
        check_plan(self.residency, self.gpu_memory, self.mesh, self.adaln)
        object.__setattr__(self, "device", torch.device(self.device))
        if self.gpu_memory is not None:
            object.__setattr__(self, "gpu_memory", float(self.gpu_memory))

    def replace(self, **changes: Any) -> "ExecutionPlan":
        return dataclasses.replace(self, **changes)

    @property
    def streamed(self) -> bool:
        return self.residency == "streamed"

    @property
    def tables(self) -> bool:
        return self.adaln == "tables"

    # -------------------------------------------------------------------------------------- the spec's half
    def placement_value(self) -> dict[str, Any]:
        """`RunSpec.placement`: the mesh's topology, {} for one process."""
        if self.mesh is None:
            return {}
        t = self.mesh.topology
        return {"tp": t.tp, "cp": t.cp, "sp": t.sp, "row_parallel": t.row_parallel}

    def residency_value(self) -> dict[str, Any]:
        """`RunSpec.residency`: {} unless streamed or AdaLN tables."""
        if not (self.streamed or self.tables):
            return {}
        return streaming.residency_value("streamed" if self.streamed else "resident", self.gpu_memory,
                                         adaln=self.adaln)

    def spec_fields(self) -> dict[str, Any]:
        """What a run spec records of this plan (its run record's placement and residency)."""
        return {"placement": self.placement_value(), "residency": self.residency_value()}

    # -------------------------------------------------------------------------------------- the model's half
    def streaming_plan(self, model: Any, table_rows: int = PLANNED_TABLE_ROWS):
        """The plan of `model` (a model, or a meta-device model built from a config) under the budget: streamed, or
        resident (nothing streams), the AdaLN tables of `table_rows` rows counted when `adaln` is "tables"."""
        return streaming.plan_for_model(model, self.gpu_memory, adaln=self.adaln, table_rows=table_rows,
                                        streamed=self.streamed)

    def place(self, model: Any, variant: str) -> Any:
        """Make a DiT's placement this plan's (see the module docstring); returns the model."""
        if self.mesh is not None:
            from ..distributed import parallelize, placement_of

            if placement_of(model) is None:
                if (streamer := streaming.streamer_of(model)) is not None:
                    streamer.remove(restore=True)
                parallelize(model, self.mesh, name=variant, weights_on_host=self.streamed)
        current = streaming.streamer_of(model)
        if self.tables != (adaln_host.source_of(model) is not None):
            if current is not None:  # its units change: every block's bytes to host memory, re-placed below
                current.remove(restore=False)
                current = None
            if self.tables:
                adaln_host.keep_on_host(model, self.device)
            else:
                adaln_host.release(model, restore=True)
        if self.streamed:
            plan = self.streaming_plan(model)
            if current is None or current.plan != plan or current.device != self.device:
                streaming.stream_blocks(model, self.device, gpu_memory_gib=self.gpu_memory)
        else:
            if current is not None:
                current.remove(restore=True)
            _to_device(model, self.device)
        return model

    def describe(self, models: dict[str, Any] | None = None) -> list[str]:
        """The policy, and per loaded DiT (`models`: variant -> model) what stays on the device."""
        budget = f", budget {self.gpu_memory:g} GiB" if self.gpu_memory is not None else ""
        tables = ", AdaLN tables (AdaLN weights in host memory)" if self.tables else ""
        lines = [f"residency {self.residency}{budget}{tables}"]
        for variant, model in (models or {}).items():
            streamer = streaming.streamer_of(model)
            if streamer is not None and streamer.plan is not None:
                lines.append(f"  {variant}: {streamer.plan.describe()}")
            elif self.tables:
                lines.append(f"  {variant}: {self.streaming_plan(model).describe()}")
        if self.streamed and len(lines) == 1:
            lines.append("  the DiT's blocks stream from host memory once it loads")
        return lines


def _to_device(model: Any, device: torch.device) -> None:
    """Every tensor of `model` on `device`, but the AdaLN weights a host source keeps (a model mapped on the CPU, or
    whose blocks a streamer left in host memory, becomes resident)."""
    keep = adaln_host.adaln_host_ids(model)
    with torch.no_grad():
        for _, owner, key, is_param, t in list(registered(model)):
            if id(t) not in keep and not t.is_meta and t.device != device and not (
                    device.index is None and t.device.type == device.type):
                streaming.bind(owner, key, is_param, t.to(device))


def check_plan(residency: str, gpu_memory: float | None = None, mesh: Any = None, adaln: str = "resident") -> str:
    """The rules of an `ExecutionPlan` (module docstring); returns `residency`."""
    if residency not in RESIDENCIES:
        raise ValidationError(f"residency={residency!r}: must be one of {', '.join(RESIDENCIES)}")
    if adaln not in ADALN:
        raise ValidationError(f"adaln={adaln!r}: must be one of {', '.join(ADALN)}")
    if adaln == "tables" and mesh is not None:
        raise ValidationError("adaln='tables' with a device mesh: not composed (each TP rank holds a shard of the "
                              "AdaLN channels); run the mesh with --adaln resident")
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
