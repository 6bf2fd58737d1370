"""AdaLN tables computed ahead: every block's modulation table for a set of timestep groups, served to the forwards
through the op table, so the AdaLN weights need not sit on the device while the blocks run.

Contract
--------
A block's AdaLN table (`AdaLNModulation`: `linear(silu(temb).to(weight.dtype))`, (T, 18*hidden) for the T distinct
timesteps of one forward) depends on those timesteps and the weights only. `AdaLNTables(model, source)` computes it
ahead for timestep *groups* -- a group is the (T,) `timestep` tensor one forward receives -- and serves it to every
forward that receives one of them (`attach()`: a forward pre-hook makes the tables current with
`runtime.use_precomputed`, a post-hook ends that). The block still calls its `adaln_proj.linear`; the op-table call
at `blocks.{i}.adaln_table` returns the group's rows instead of multiplying (a fresh tensor), the trace records it as
the computing call recorded it (backend, kernel, tile, accumulator, fallback reason; the forward's own shapes and
dtypes: the record a resident forward writes), and `hook_adaln_table` fires on the same tensor. Hooks, traces, the
ablation matrix and drift see such a forward as they see a resident one. The final table (`norm_out.linear`,
2*hidden wide) is not served: it stays with the model.

Bytes
- The AdaLN input of a group (`silu(temb).to(dtype)`) is computed by the model's own modules with the calls a forward
  makes, one group at a time: `timestep_embedding` at `time_sinusoid`, the cast, `time_embedder`, `silu`, the cast.
- The projection, per block: in mode strict with no override of `linear`, ONE `linear` call over the rows of every
  group at once (a generation's whole schedule). Strict GEMMs are batch-invariant by contract (a row's bytes depend
  on that row and the weights only, whatever the row count or position), so each group's rows equal what a forward
  computes for it alone: the one assumption made here. In every other case (off, audit, auto, an override of
  `linear`) one call per group, the very call a forward makes; nothing is assumed.
- A served call compares the forward's AdaLN input with the rows its table was computed from (on the device; read
  once, when the forward returns): a hook at `time_sinusoid` / `time_mlp`, or anything else that changed the input,
  fails that forward closed with one line (`AdaLNTablesError`) instead of returning a velocity from the wrong table.
- The AdaLN weights may change (an in-place edit, another binding): each forward compares their identity, storage
  and `_version` with those the tables were computed from and drops stale tables (computed again on demand).

Weights: `source` says where the AdaLN weights live and brings them to the device block by block --
`source.weights(blocks)` yields each block index with that block's `adaln_proj.linear` bound to device bytes while
the caller uses it (the next block's copy under way), `source.blocks()` the blocks it holds.
`h3lab.components.adaln_host` keeps them in pinned host memory; `ResidentSource` uses them where they are.

Groups: `prepare(groups) -> batch` computes every group not held yet, in the current mode and op overrides
(`drop(batch)` frees it); the run-spec residency provider prepares a run's evaluated passes at once. A forward whose
group is not held computes it on demand (`stats.on_demand`; kept among the last `ON_DEMAND_KEPT`): one pass over the
AdaLN weights per forward -- a training step's sampled sigmas, a one-off forward. A group is found by identity (the
same tensor object at the same `_version`: no device read), else by value (one device read), among the tables
computed in the forward's mode with the same overrides.

Refused (`AdaLNTablesError`, one line): mode fast (fast keeps FP8 copies keyed by the weights it reads on the
device), a served call whose input or weight records gradients (the tables are constants: train AdaLN resident), a
forward that passes no `timestep`, a served input of another shape than its group's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from ..execution import runtime
from ..errors import H3Error
from .hooks import use_hooks

ON_DEMAND_KEPT = 4  # groups computed on demand that stay held (a training step's, a one-off forward's)
TIMESTEP_ARG = 3  # `timestep`'s position in H3Transformer.forward's signature


class AdaLNTablesError(H3Error):
    """AdaLN tables cannot serve a forward (the message names the value and the rule)."""


class WeightSource(Protocol):
    device: torch.device

    def blocks(self) -> list[int]: ...

    def weights(self, blocks: Sequence[int]) -> Iterator[int]: ...


def adaln_linear(model: nn.Module, index: int) -> nn.Module:
    """Block `index`'s AdaLN projection (`transformer_blocks.{index}.adaln_proj.linear`)."""
    return model.transformer_blocks[index].adaln_proj.linear


def live_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks whose AdaLN weights hold bytes (layer thinning releases blocks to the meta device)."""
    return [i for i, block in enumerate(model.transformer_blocks) if not block.adaln_proj.linear.weight.is_meta]


class ResidentSource:
    """AdaLN weights where they are (the device): tables computed ahead from a resident model (tests, benchmarks)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.device = model.proj_in.weight.device

    def blocks(self) -> list[int]:
        return live_blocks(self.model)

    def weights(self, blocks: Sequence[int]) -> Iterator[int]:
        yield from blocks


# ------------------------------------------------------------------------------------------------- records
@dataclass(eq=False)
class _Batch:
    """Tables computed together: per block (R, 18*hidden) on the device, and per block and group the computing
    call's trace fields."""

    key: tuple  # (mode, overrides) they were computed under
    tables: dict[int, torch.Tensor] = field(default_factory=dict)
    records: dict[int, list[tuple[str, dict, str]]] = field(default_factory=dict)  # block -> per group
    groups: list["_Group"] = field(default_factory=list)
    on_demand: bool = False


@dataclass(eq=False)
class _Group:
    timestep: torch.Tensor  # (T,) as a forward receives it
    version: int | None  # its `_version` (None: an inference tensor)
    inputs: dict[torch.dtype, torch.Tensor]  # AdaLN input rows (T, time_embed_dim) per weight dtype
    batch: _Batch
    index: int  # position in batch.groups
    offset: int  # first row in the batch's tables

    @property
    def rows(self) -> int:
        return self.timestep.shape[0]


@dataclass
class TableStats:
    """What the tables hold and did: groups and rows held, table bytes on the device, AdaLN weight passes (one per
    `prepare` that computed something, and per on-demand group), on-demand groups, served calls."""

    groups: int = 0
    rows: int = 0
    table_bytes: int = 0
    passes: int = 0
    on_demand: int = 0
    served: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _overrides_key(overrides: dict) -> tuple:
    return tuple(sorted((name, id(fn)) for name, fn in overrides.items()))


# ------------------------------------------------------------------------------------------------- the tables
class AdaLNTables:
    """A model's AdaLN tables for some timestep groups, served through the op table (see the module docstring)."""

    def __init__(self, model: nn.Module, source: WeightSource):
        self.model = model
        self.source = source
        self.batches: list[_Batch] = []
        self.stats = TableStats()
        self._points: dict[str, int] = {}
        self._bound: "weakref.WeakKeyDictionary[runtime.Ops, _Group]" = weakref.WeakKeyDictionary()
        self._pending: _Group | None = None
        self._scope: Any = None
        self._mismatch: torch.Tensor | None = None
        self._weights_seen: tuple = ()
        self._handles: list[Any] = []

    # -------------------------------------------------------------------------------------- attach / detach
    def attach(self) -> "AdaLNTables":
        """Serve the model's forwards (hooks on the model) and register as `tables_of(model)`."""
        self.detach()
        self._handles = [
            self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            self.model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True),
        ]
        self.model.__dict__["_h3lab_adaln_tables"] = self
        return self

    def detach(self) -> None:
        """Stop serving: hooks removed, tables dropped."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()
        if self.model.__dict__.get("_h3lab_adaln_tables") is self:
            del self.model.__dict__["_h3lab_adaln_tables"]

    def clear(self) -> None:
        """Drop every table."""
        self.batches = []
        self._bound = weakref.WeakKeyDictionary()
        self._count()

    # -------------------------------------------------------------------------------------- computing
    def prepare(self, groups: Iterable[torch.Tensor], overrides: Mapping[str, Any] | None = None) -> _Batch | None:
        """Compute the tables of every group (a (T,) timestep tensor) not held yet, in the current mode and op
        overrides (and `overrides`, entered for the computation: a run's, which its forwards will see), in one pass
        over the AdaLN weights; returns the new batch (None when all were held)."""
        if overrides:
            with runtime.use_overrides(dict(overrides)):
                return self.prepare(groups)
        mode = runtime.current_mode()
        _refuse_fast(mode)
        key = (mode, _overrides_key(runtime.Ops(mode, runtime.Trace(mode=mode, device=""), record=False).overrides()))
        self._check_weights()
        new: list[torch.Tensor] = []
        for t in groups:
            if self._find(t, key) is None and not any(_same(t, u) for u in new):
                new.append(t)
        if not new:
            return None
        batch = self._compute(new, key)
        self.batches.append(batch)
        self._count()
        return batch

    def drop(self, batch: _Batch | None) -> None:
        """Free one batch's tables (a run's, when it ends)."""
        if batch is not None and batch in self.batches:
            self.batches.remove(batch)
            self._count()

    def _compute(self, timesteps: list[torch.Tensor], key: tuple) -> _Batch:
        mode = key[0]
        device = self.source.device
        ops = runtime.Ops(mode, runtime.Trace(mode=mode, device=str(device)), precomputed=False)
        batch = _Batch(key)
        blocks = self.source.blocks()
        dtypes = {adaln_linear(self.model, i).weight.dtype for i in blocks}
        with torch.no_grad(), runtime.use_ops(ops), use_hooks(None):
            offset = 0
            for j, t in enumerate(timesteps):
                batch.groups.append(_Group(t, _version(t), self._inputs(ops, t, dtypes), batch, j, offset))
                offset += t.shape[0]
            once = mode == "strict" and "linear" not in ops.overrides()
            stacked = {d: torch.cat([g.inputs[d] for g in batch.groups]) for d in dtypes} if once else {}
            for i in self.source.weights(blocks):
                linear = adaln_linear(self.model, i)
                self._points[linear.point] = i
                w, b, d = linear.weight, linear.bias, linear.weight.dtype
                first = len(ops.trace.records)
                if once:  # one GEMM over every group's rows: batch-invariant by the strict contract
                    batch.tables[i] = ops.linear(stacked[d], w, b, point=linear.point)
                    batch.records[i] = [_fields(ops.trace.records[first])] * len(batch.groups)
                else:  # each group's own call, as a forward makes it
                    parts = [ops.linear(g.inputs[d], w, b, point=linear.point) for g in batch.groups]
                    batch.tables[i] = torch.cat(parts) if len(parts) > 1 else parts[0]
                    batch.records[i] = [_fields(r) for r in ops.trace.records[first:]]
        self._weights_seen = self._weights_now()
        self.stats.passes += 1
        return batch

    def _inputs(self, ops: runtime.Ops, t: torch.Tensor, dtypes: set) -> dict[torch.dtype, torch.Tensor]:
        """The AdaLN input rows of one group per weight dtype, by the forward's own calls (transformer.py step 4,
        `AdaLNModulation.forward`'s silu and cast)."""
        model = self.model
        temb = ops.timestep_embedding(t, model.config.freq_dim, point="time_sinusoid")
        temb = model.time_embedder(temb.to(model.time_embedder.linear_1.weight.dtype))
        return {d: ops.silu(temb, point="adaln_input").to(d) for d in dtypes}

    # -------------------------------------------------------------------------------------- finding groups
    def _find(self, t: torch.Tensor, key: tuple) -> _Group | None:
        candidates = [g for b in self.batches if b.key == key for g in b.groups]
        version = _version(t)
        for g in candidates:
            if g.timestep is t and g.version == version and version is not None:
                return g
        for g in candidates:
            if _same(t, g.timestep):
                return g
        return None

    def _group_for(self, t: Any) -> _Group:
        """The held group of a forward's timesteps, computed on demand when none is held."""
        if not isinstance(t, torch.Tensor):
            raise AdaLNTablesError("AdaLN tables: the forward passed no timestep tensor (H3Transformer.forward's "
                                   "fourth argument, `timestep`); a forward served from tables needs it")
        mode = runtime.current_mode()
        _refuse_fast(mode)
        self._check_weights()
        overrides = runtime.Ops(mode, runtime.Trace(mode=mode, device=""), record=False).overrides()
        key = (mode, _overrides_key(overrides))
        group = self._find(t, key)
        if group is None:
            batch = self._compute([t], key)
            batch.on_demand = True
            self.stats.on_demand += 1
            kept = [b for b in self.batches if b.on_demand]
            for old in kept[: max(0, len(kept) + 1 - ON_DEMAND_KEPT)]:
                self.batches.remove(old)
            self.batches.append(batch)
            self._count()
            group = batch.groups[0]
        return group

    def _weights_now(self) -> tuple:
        out = []
        for i in self.source.blocks():
            lin = adaln_linear(self.model, i)
            out += [(id(p), p.data_ptr(), p._version) for p in (lin.weight, lin.bias) if p is not None]
        return tuple(out)

    def _check_weights(self) -> None:
        if self.batches and self._weights_now() != self._weights_seen:
            self.clear()  # the AdaLN weights changed since the tables were computed: stale

    def _count(self) -> None:
        groups = [g for b in self.batches for g in b.groups]
        self.stats.groups = len(groups)
        self.stats.rows = sum(g.rows for g in groups)
        self.stats.table_bytes = sum(t.numel() * t.element_size() for b in self.batches for t in b.tables.values())

    # -------------------------------------------------------------------------------------- serving
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        t = kwargs["timestep"] if "timestep" in kwargs else (args[TIMESTEP_ARG] if len(args) > TIMESTEP_ARG else None)
        group = self._group_for(t)
        if self._mismatch is None or self._mismatch.device != self.source.device:
            self._mismatch = torch.zeros((), dtype=torch.bool, device=self.source.device)
        self._pending = group
        self._scope = runtime.use_precomputed(self)
        self._scope.__enter__()

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        scope, self._scope, self._pending = self._scope, None, None
        if scope is not None:
            scope.__exit__(None, None, None)
        if output is None or self._mismatch is None:
            return  # the forward raised: its own error stands
        if bool(self._mismatch):  # one device read per forward
            self._mismatch.zero_()
            raise AdaLNTablesError(
                "AdaLN tables: this forward's AdaLN input differs from the rows its table was computed from (a hook "
                "at time_sinusoid / time_mlp, or a changed time embedder, replaced it); run with AdaLN resident")

    def serve(self, name: str, point: str, ops: runtime.Ops):
        """The runtime's precomputed layer: a callable for `linear` at a served `blocks.{i}.adaln_table`, else None."""
        if name != "linear":
            return None
        block = self._points.get(point)
        if block is None:
            return None
        group = self._bound.get(ops)
        if group is None:
            group = self._pending
            if group is None or block not in group.batch.tables:
                return None  # not a forward these tables serve (a block they do not hold)
            self._bound[ops] = group  # a checkpoint replay of this forward finds the same rows

        def served(*args: Any, **kwargs: Any) -> torch.Tensor:
            return self._serve(group, block, point, ops, args, kwargs)

        return served

    def _serve(self, group: _Group, block: int, point: str, ops: runtime.Ops, args: tuple, kwargs: dict):
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        expected = group.inputs.get(weight.dtype)
        if expected is None or x.shape != expected.shape or x.dtype != expected.dtype:
            raise AdaLNTablesError(
                f"AdaLN tables: {point} got an input of shape {list(x.shape)} {x.dtype}; its table rows were computed "
                f"for {group.rows} timesteps ({list(expected.shape) if expected is not None else 'another dtype'})")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            raise AdaLNTablesError(f"AdaLN tables: {point} records gradients (its input or weight requires grad); "
                                   "tables computed ahead are constants: run with AdaLN resident to train them")
        torch.logical_or(self._mismatch, (x != expected).any(), out=self._mismatch)
        actual, info, fallback = group.batch.records[block][group.index]
        ops.log_served("linear", point, info, args, kwargs, actual=actual, fallback=fallback)
        self.stats.served += 1
        return group.batch.tables[block][group.offset: group.offset + group.rows].clone()


def _refuse_fast(mode: str) -> None:
    if mode == "fast":
        raise AdaLNTablesError("AdaLN tables in mode fast: not composed (fast keeps FP8 copies of the weights it "
                               "reads on the GPU; these stay in host memory); run fast with --adaln resident")


def _fields(record: runtime.OpRecord) -> tuple[str, dict, str]:
    return record.actual, {"kernel_id": record.kernel_id, "tile": record.tile, "acc_dtype": record.acc_dtype}, \
        record.fallback


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same timesteps: the same tensor, or equal shape, dtype, device and values (one device read)."""
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def tables_of(model: nn.Module) -> AdaLNTables | None:
    """The AdaLN tables serving `model`'s forwards, or None (AdaLN computed in each forward)."""
    return model.__dict__.get("_h3lab_adaln_tables")


def serve_tables(model: nn.Module, source: WeightSource | None = None) -> AdaLNTables:
    """Serve `model`'s forwards from AdaLN tables whose weights `source` brings (default: where they are)."""
    current = tables_of(model)
    if current is not None:
        current.detach()
    return AdaLNTables(model, source if source is not None else ResidentSource(model)).attach()
