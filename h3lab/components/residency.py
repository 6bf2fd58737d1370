"""Where the DiT's blocks live: the `RunSpec.residency` value, the units a streamer moves, the GPU-budget plan and
the pinned arena layout. Plain arithmetic over shapes (a meta model plans too); `streaming.py` does the moving.

Contract
--------
- `residency_value(policy, gpu_memory_gib=None, slots=2, adaln="resident")` / `check_residency_value(value)`: the JSON
  value of `RunSpec.residency`, normalised -- `{}` for resident, `{"policy": "streamed", "slots": N[, "gpu_memory_gib":
  G]}` (slots 2..8, G a finite number of GiB > 0), either with `"adaln": "tables"` when the AdaLN weights stay in host
  memory and the run is served from tables computed ahead (`{"policy": "resident", "adaln": "tables"}` for resident
  blocks); anything else is a one-line `ResidencyError`.
- `block_units(model)`: the units, the blocks the forward calls as modules -- `token_refiner.refiner_blocks.*`, then
  `transformer_blocks.*`, in execution order. A unit's tensors are packed at `ALIGN`-byte aligned offsets.
- Released blocks: in a model that holds real tensors, a block whose tensors are all on the meta device (layer
  thinning released its weights, `h3lab.presets.release_dropped`) holds no bytes: it is no unit, and its meta tensors
  count for nothing in `fixed_bytes` (`holds_bytes`). A model made wholly on the meta device (for planning) counts
  every tensor.
- `plan_residency(units, fixed_bytes, gpu_memory_gib=None, slots=2, tables=None, streamed=True) -> Plan`
  (`plan_for_model(model, ...)` reads the sizes from a model): without a budget every unit streams (`streamed=False`:
  none does, the resident plan); with one, the fewest streamed units whose plan fits the budget -- the DiT's tensors
  on the device = the tensors outside the units + the resident units + `slots` slots of the largest streamed unit +
  the AdaLN tables (activations, encoders and VAEs are outside it).
- AdaLN tables (`tables`: a `TablesPlan`): the blocks' `adaln_proj` tensors leave the units and the fixed bytes (they
  sit in host memory, `adaln_host.py`) and the device holds the tables instead: `table_bytes(config, rows)` = rows x
  18 x hidden x the AdaLN weight's element size x live blocks, rows = the sum over the evaluated passes of each
  pass's distinct timesteps (`table_rows`; a placement reserves `PLANNED_TABLE_ROWS`). While they are computed, `staging_bytes` (2 device slots of one block's
  AdaLN weights) are in use too; they are freed before the forwards (the activations reuse them). Refiner blocks stay resident first (they
  run on the text rows only, too little compute to hide a copy), then the streamed transformer blocks are spread
  evenly, so each copy overlaps the resident blocks before it. A budget that holds everything streams nothing; one
  below the outside-unit tensors plus the slots is refused, naming the least that works.
- `arena_layout(sizes)`: how pinned host memory holds the streamed units (torch's pinned allocator rounds each
  allocation up to a power of two, so units share power-of-two arenas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..errors import ValidationError

ALIGN = 512  # bytes: each tensor's offset inside a unit (>= the caching allocator's block alignment)
POLICIES = ("resident", "streamed")
ADALN = ("resident", "tables")
ADALN_MODULE = "adaln_proj"  # a block's AdaLN projection: what `--adaln tables` keeps in host memory
PLANNED_TABLE_ROWS = 200  # a placement's reserve for tables: 50 passes x 4 distinct timesteps (the most a pass has)
STAGING_SLOTS = 2  # device slots of one block's AdaLN weights while tables are computed (adaln_host.SLOTS)
DEFAULT_SLOTS = 2
MAX_SLOTS = 8
UNIT_LISTS = ("token_refiner.refiner_blocks", "transformer_blocks")  # execution order
GiB = 2**30


class ResidencyError(ValidationError):
    """A residency value, plan or streamed run breaks a rule; the message names the value and the rule."""


# ------------------------------------------------------------------------------------------------ the value
def residency_value(policy: str = "resident", gpu_memory_gib: float | None = None,
                    slots: int = DEFAULT_SLOTS, adaln: str = "resident") -> dict[str, Any]:
    """The `RunSpec.residency` JSON value of a policy (checked)."""
    value: dict[str, Any] = {"policy": policy}
    if policy != "resident":
        value["slots"] = slots
    if gpu_memory_gib is not None:
        value["gpu_memory_gib"] = gpu_memory_gib
    if adaln != "resident":
        value["adaln"] = adaln
    return check_residency_value(value)


def check_residency_value(value: Any) -> dict[str, Any]:
    """`RunSpec.residency` normalised: {} for resident, {"policy": "streamed", "slots": N[, "gpu_memory_gib": G]},
    either with "adaln": "tables" ({"policy": "resident", "adaln": "tables"} for resident blocks)."""
    if not isinstance(value, Mapping):
        raise ResidencyError(f"residency={value!r}: must be an object like {{'policy': 'streamed'}}")
    allowed = ("policy", "slots", "gpu_memory_gib", "adaln")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ResidencyError(f"residency key {unknown[0]!r}: must be one of {', '.join(allowed)}")
    policy = value.get("policy")
    if policy not in POLICIES:
        raise ResidencyError(f"residency policy={policy!r}: must be one of {', '.join(POLICIES)}")
    adaln = check_adaln(value.get("adaln", "resident"))
    tables = {"adaln": adaln} if adaln != "resident" else {}
    if policy == "resident":
        extra = sorted(set(value) - {"policy", "adaln"})
        if extra:
            raise ResidencyError(f"residency {extra[0]}={value[extra[0]]!r}: applies to policy 'streamed' only")
        return {"policy": "resident", **tables} if tables else {}
    slots = value.get("slots", DEFAULT_SLOTS)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 2 <= slots <= MAX_SLOTS:
        raise ResidencyError(f"residency slots={slots!r}: must be an integer from 2 to {MAX_SLOTS}")
    out: dict[str, Any] = {"policy": "streamed", "slots": slots}
    gib = value.get("gpu_memory_gib")
    if gib is not None:
        out["gpu_memory_gib"] = check_gpu_memory(gib)
    return {**out, **tables}


def check_adaln(adaln: Any) -> str:
    """Where the blocks' AdaLN weights live: "resident" (with their blocks) or "tables" (host memory; the device
    holds the tables computed ahead)."""
    if adaln not in ADALN:
        raise ResidencyError(f"adaln={adaln!r}: must be one of {', '.join(ADALN)}")
    return adaln


def check_gpu_memory(gib: Any) -> float:
    """A GPU memory budget in GiB: a finite number > 0."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ResidencyError(f"gpu_memory_gib={gib!r}: must be a number of GiB > 0")
    return float(gib)


# ------------------------------------------------------------------------------------------------ units, plan
def block_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit the streamer can move, in execution order (`UNIT_LISTS`); released blocks are
    left out (module docstring)."""
    out = []
    materialised = _materialised(model)
    for path in UNIT_LISTS:
        owner: Any = model
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, nn.ModuleList):
            out += [(f"{path}.{i}", block) for i, block in enumerate(owner)
                    if not (materialised and _all_meta(block))]
    return out


def _materialised(model: nn.Module) -> bool:
    """The model holds at least one real (non-meta) tensor."""
    return any(not t.is_meta for *_, t in registered(model))


def _all_meta(module: nn.Module) -> bool:
    tensors = [t for *_, t in registered(module)]
    return bool(tensors) and all(t.is_meta for t in tensors)


def holds_bytes(t: torch.Tensor, materialised: bool) -> bool:
    """Whether `t` occupies memory where the model is placed: a meta tensor of a materialised model does not."""
    return not (materialised and t.is_meta)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Entry:
    """One tensor of a unit: where it is registered and where its bytes sit inside the unit."""

    owner: nn.Module
    key: str
    is_param: bool
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    nbytes: int

    def get(self) -> torch.Tensor:
        return (self.owner._parameters if self.is_param else self.owner._buffers)[self.key]

    def bind(self, tensor: torch.Tensor) -> None:
        bind(self.owner, self.key, self.is_param, tensor)


def bind(owner: nn.Module, key: str, is_param: bool, tensor: torch.Tensor) -> None:
    """Point a registered tensor at `tensor`'s storage: a parameter keeps its object (`.data`), a buffer is replaced."""
    if is_param:
        owner._parameters[key].data = tensor
    else:
        owner._buffers[key] = tensor


def registered(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool, torch.Tensor]]:
    """(module path, module, key, is_param, tensor) of every parameter and buffer, each tensor once."""
    seen = set()
    for path, mod in model.named_modules():
        for is_param, table in ((True, mod._parameters), (False, mod._buffers)):
            for key, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield path, mod, key, is_param, t


def unit_entries(module: nn.Module, check: bool = True, skip: set[int] = frozenset()) -> tuple[list[Entry], int]:
    """Every parameter and buffer of `module` (recursively) but those whose id is in `skip`, with its aligned
    offset; (entries, packed bytes). `check=False` reads shapes only (a meta model, for planning)."""
    out, offset = [], 0
    for path, mod, key, is_param, t in registered(module):
        if id(t) in skip:
            continue
        where = f"{path + '.' if path else ''}{key}"
        if check and t.is_meta:
            raise ResidencyError(f"{where} is a meta tensor: materialise the model before streaming it")
        if check and not t.is_contiguous():
            raise ResidencyError(f"{where} is not contiguous: a streamed tensor keeps its strides")
        nbytes = t.numel() * t.element_size()
        out.append(Entry(mod, key, is_param, t.shape, t.dtype, offset, nbytes))
        offset = aligned(offset + nbytes)
    return out, offset


def fixed_bytes(model: nn.Module, per_unit: list[list[Entry]], skip: set[int] = frozenset()) -> int:
    """Bytes of the model's tensors outside the units (`per_unit`: each unit's entries) and outside `skip` (ids)."""
    inside = {id(e.get()) for group in per_unit for e in group} | set(skip)
    materialised = _materialised(model)
    return sum(t.numel() * t.element_size() for *_, t in registered(model)
               if id(t) not in inside and holds_bytes(t, materialised))


def adaln_ids(model: nn.Module) -> set[int]:
    """ids of every tensor of the blocks' AdaLN projections (`transformer_blocks.*.adaln_proj`), by name: what
    `--adaln tables` keeps in host memory (a meta model too)."""
    return {id(t) for path, _, _, _, t in registered(model)
            if path.startswith("transformer_blocks.") and path.split(".")[2:3] == [ADALN_MODULE]}


@dataclass(frozen=True)
class TablesPlan:
    """The AdaLN tables' side of a plan (bytes): the tables on the device, the AdaLN weights in host memory, the
    staging slots used while the tables are computed, and the table rows planned for."""

    table_bytes: int
    host_bytes: int
    staging_bytes: int
    rows: int


def table_bytes(config: Any, rows: int, blocks: int | None = None, element_size: int = 2) -> int:
    """Device bytes of the AdaLN tables of `rows` timestep rows: rows x 18*hidden x element size x blocks."""
    blocks = config.num_layers if blocks is None else blocks
    return rows * config.adaln_dim * element_size * blocks


def tables_plan(model: nn.Module, rows: int) -> TablesPlan:
    """`TablesPlan` of a model (a meta model works) for tables of `rows` timestep rows."""
    per_block = []
    size = 2
    for i, block in enumerate(getattr(model, "transformer_blocks", [])):
        lin = block.adaln_proj.linear
        if _materialised(model) and lin.weight.is_meta:
            continue  # a released block
        per_block.append(unit_entries(lin, check=False)[1])
        size = lin.weight.element_size()
    config = model.config
    return TablesPlan(table_bytes(config, rows, len(per_block), size), sum(per_block),
                      STAGING_SLOTS * max(per_block, default=0), rows)


@dataclass(frozen=True)
class Plan:
    """Which units stream and what the DiT keeps on the device (bytes)."""

    streamed: tuple[str, ...]
    resident: tuple[str, ...]
    slots: int
    slot_bytes: int  # the largest streamed unit (0 when nothing streams)
    fixed_bytes: int  # tensors outside the units
    unit_bytes: Mapping[str, int]
    gpu_memory_gib: float | None = None
    tables: TablesPlan | None = None  # AdaLN weights in host memory, tables on the device

    @property
    def adaln(self) -> str:
        return "tables" if self.tables is not None else "resident"

    @property
    def device_bytes(self) -> int:
        """The DiT's tensors on the device: fixed + resident units + the slots + the AdaLN tables."""
        resident = sum(self.unit_bytes[n] for n in self.resident)
        tables = self.tables.table_bytes if self.tables is not None else 0
        return self.fixed_bytes + resident + (self.slots * self.slot_bytes if self.streamed else 0) + tables

    @property
    def streamed_bytes(self) -> int:
        """Bytes one forward copies in (every streamed unit once)."""
        return sum(self.unit_bytes[n] for n in self.streamed)

    def describe(self) -> str:
        n = len(self.streamed) + len(self.resident)
        t = self.tables
        tables = (f"; AdaLN tables {t.table_bytes / GiB:.2f} GiB on the GPU ({t.rows} timestep rows), AdaLN weights "
                  f"{t.host_bytes / GiB:.2f} GiB in host memory" if t is not None else "")
        return (f"{len(self.streamed)} of {n} DiT blocks streamed through {self.slots if self.streamed else 0} "
                f"slots, {self.device_bytes / GiB:.2f} GiB of DiT weights on the GPU"
                + (f" (budget {self.gpu_memory_gib:g} GiB)" if self.gpu_memory_gib is not None else "") + tables)

    def to_dict(self) -> dict[str, Any]:
        out = {"streamed": list(self.streamed), "resident": list(self.resident), "slots": self.slots,
               "slot_bytes": self.slot_bytes, "fixed_bytes": self.fixed_bytes, "device_bytes": self.device_bytes,
               "streamed_bytes": self.streamed_bytes, "gpu_memory_gib": self.gpu_memory_gib, "adaln": self.adaln}
        if self.tables is not None:
            out.update(table_bytes=self.tables.table_bytes, adaln_host_bytes=self.tables.host_bytes,
                       adaln_staging_bytes=self.tables.staging_bytes, table_rows=self.tables.rows)
        return out


def _spread(n: int, k: int) -> list[int]:
    """k of range(n), evenly spaced (k <= n)."""
    return sorted({min(n - 1, int((j + 0.5) * n / k)) for j in range(k)}) if k else []


def plan_residency(units: list[tuple[str, int]], fixed_bytes: int, gpu_memory_gib: float | None = None,
                   slots: int = DEFAULT_SLOTS, tables: TablesPlan | None = None, streamed: bool = True) -> Plan:
    """The plan for units (name, bytes) in execution order (see the module docstring). Without a budget every unit
    streams (`streamed=False`: none); with one, the fewest streamed units that fit (refused when even all streamed do
    not fit)."""
    names = [n for n, _ in units]
    sizes = dict(units)
    if not names:
        raise ResidencyError("the model has no blocks to stream (no token_refiner.refiner_blocks or transformer_blocks)")
    blocks = [n for n in names if n.startswith("transformer_blocks.")]
    others = [n for n in names if n not in blocks]

    def make(streamed_set: set[str]) -> Plan:
        streamed = tuple(n for n in names if n in streamed_set)
        resident = tuple(n for n in names if n not in streamed_set)
        slot = max((sizes[n] for n in streamed), default=0)
        return Plan(streamed, resident, slots, slot, fixed_bytes, dict(sizes), gpu_memory_gib, tables)

    if not streamed:
        return make(set())
    if gpu_memory_gib is None:
        return make(set(names))
    budget = gpu_memory_gib * GiB
    for k in range(len(names) + 1):  # fewest streamed first: transformer blocks spread evenly, then the others
        chosen = {blocks[i] for i in _spread(len(blocks), min(k, len(blocks)))}
        chosen |= set(others[: max(0, k - len(blocks))])
        plan = make(chosen)
        if plan.device_bytes <= budget:
            return plan
    least = make(set(names))
    t = f" + AdaLN tables {tables.table_bytes / GiB:.2f} GiB" if tables is not None else ""
    raise ResidencyError(
        f"gpu_memory_gib={gpu_memory_gib:g}: the streamed DiT needs at least {least.device_bytes / GiB:.2f} GiB on the "
        f"GPU ({least.fixed_bytes / GiB:.2f} GiB outside the blocks + {slots} slots of {least.slot_bytes / GiB:.2f} GiB"
        f"{t})"
    )


def plan_for_model(model: nn.Module, gpu_memory_gib: float | None = None, slots: int = DEFAULT_SLOTS,
                   adaln: str = "resident", table_rows: int = 0, streamed: bool = True) -> Plan:
    """`plan_residency` from a model's tensors (a meta model works: only shapes and dtypes are read); with
    `adaln="tables"` the AdaLN projections leave the units and the device holds tables of `table_rows` rows."""
    skip = adaln_ids(model) if check_adaln(adaln) == "tables" else set()
    units = [(name, unit_entries(module, check=False, skip=skip)) for name, module in block_units(model)]
    fixed = fixed_bytes(model, [group for _, (group, _) in units], skip)
    tables = tables_plan(model, table_rows) if skip else None
    return plan_residency([(name, nbytes) for name, (_, nbytes) in units], fixed, gpu_memory_gib, slots, tables,
                          streamed)


def arena_layout(sizes: list[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """How pinned host memory holds units of `sizes` bytes: [(arena bytes, [(unit index, offset), ...]), ...].
    torch's pinned allocator rounds every allocation up to a power of two, so units are packed in order into
    power-of-two arenas (offsets aligned), the arena size chosen to waste least and the last arena sized to its
    contents."""
    def pow2(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    best = None
    for k in range(pow2(max(sizes)).bit_length() - 1, pow2(sum(aligned(n) for n in sizes)).bit_length()):
        arena, groups, used = 1 << k, [[]], 0
        for i, n in enumerate(sizes):
            if used + n > arena:
                groups.append([])
                used = 0
            groups[-1].append((i, used))
            used = aligned(used + n)
        last = groups[-1][-1][1] + sizes[groups[-1][-1][0]]
        layout = [(arena, g) for g in groups[:-1]] + [(pow2(last), groups[-1])]
        total = sum(a for a, _ in layout)
        if best is None or total < best[0]:
            best = (total, layout)
    return best[1]
