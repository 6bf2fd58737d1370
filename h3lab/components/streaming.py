"""Streamed residency: the DiT's blocks live in host memory and pass through a few device slots while they run.

Contract
--------
`stream_blocks(model, device, gpu_memory_gib=None, slots=2) -> BlockStreamer` changes a built `H3Transformer` in
place. Its *units* are the blocks the forward calls as modules -- `token_refiner.refiner_blocks.*`, then
`transformer_blocks.*`, in execution order. Every other tensor (projections, time MLP, heads, norms, `rope.inv_freq`)
and every *resident* unit goes to `device`; every *streamed* unit's parameters and buffers are packed, each tensor at
a 512-byte aligned offset, into one contiguous host buffer per unit (pinned once, at this call, when `device` is
CUDA; plain memory on the CPU), and the module's tensors become views of it. `slots` device buffers of the largest
streamed unit's size alternate: a forward pre-hook on each streamed unit waits until its bytes are in a slot, binds
the unit's tensors to views of that slot and starts copying the next streamed unit(s) into the other slot(s); a
forward post-hook (also run when the forward raises) records that the slot is free and binds the unit back to host
memory. Copies run on a side stream (`CudaBackend`): the side stream waits for the compute stream to be done with a
slot before overwriting it, the compute stream waits for a slot's copy before using it, and nothing else waits, so
the host thread never blocks. After the last unit the first one is copied in again, so the next forward starts warm.
The prediction of what runs next is only an optimisation: a unit that arrives out of order is copied in on demand.

Bytes: a unit computes on the same bytes, at the same alignment, in the same order as when resident, so outputs are
byte-identical to resident in every mode (tests: CPU strict and off; H200: `benchmarks/benchmark_streaming.py`).
Which units stream (`gpu_memory_gib`: a budget for the DiT's tensors on the GPU), the value of the run-spec field and
the pinned arena layout are planned in `residency.py`; this module moves the bytes.

Training streams too, with gradient checkpointing (`model.gradient_checkpointing`): the checkpointed forward keeps
no activation of a block (so no slot view outlives the block), and the backward recomputes each block -- its
pre-hook copies it into a slot again -- right before that block's backward, which uses the recomputation's saved
views of the slot. Three rules make that safe: (1) while gradients are recorded, a copy into a slot waits for every
kernel the compute stream has been given so far (a fresh mark, not the slot's last-use mark: the block's backward
kernels are issued after its recomputation ended); (2) while the model recomputes (`model.recomputing`), the unit
predicted next is the previous one (the backward walks the blocks in reverse); (3) only frozen tensors stream: the
trainable ones (a LoRA adapter's factors, created after the units were packed) stay resident beside them, and the
optimiser's state with them. A forward that records gradients without checkpointing is refused (autograd would keep
slot views that the next copy overwrites). Do not move or cast a streamed model (`.to`, `apply_dtype_policy`):
`streamer.remove(restore=True)` makes it an ordinary resident model again (refused on CUDA when the blocks do not fit).

Statistics (`BlockStreamer.begin_run()` / `end_run() -> StreamStats`; the last run's are `last_stats()`): bytes
moved, copies, on-demand loads, copy seconds and throughput, and the copy wait the compute stream was exposed to
(per use: the time from the moment compute wanted a unit to the end of its copy, when positive); `hidden_fraction =
1 - exposed / copy seconds`. On the CPU every copy runs on the compute thread: all of it is exposed.

The run-spec field: `RunSpec.residency` (`h3lab/run/fields.py`) holds `residency_value(policy, gpu_memory_gib,
slots)`, checked by `check_residency_value` ({} = resident; {"policy": "streamed", "slots": 2[, "gpu_memory_gib":
40.0]}) and applied by `residency_field.apply_residency` around the loop.

AdaLN tables (`adaln_host.py`): when the model's forwards are served from AdaLN tables, the blocks' AdaLN weights
live in the tables' source, not in the units (`BlockStreamer.skip`): a streamed block moves its other tensors only,
and the plan counts the tables instead.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..model.adaln_tables import tables_of
from .residency import (  # noqa: F401 - the planning names are re-exported: streaming is the room's entry point
    ALIGN, DEFAULT_SLOTS, PLANNED_TABLE_ROWS, GiB, Plan, ResidencyError, adaln_ids, aligned, arena_layout, bind,
    block_units, check_gpu_memory, check_residency_value, fixed_bytes, plan_for_model, plan_residency, registered,
    residency_value, tables_plan, unit_entries,
)


# ------------------------------------------------------------------------------------------------ backends
@dataclass
class Ticket:
    """One copy: its start and end marks (events on CUDA, perf_counter seconds on the host backend)."""

    start: Any
    end: Any
    nbytes: int


class HostBackend:
    """A device without streams (the CPU): a copy runs at once on the calling thread; marks are perf_counter stamps."""

    name = "host"

    def mark(self) -> float:
        return time.perf_counter()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Ticket:
        t0 = time.perf_counter()
        dst.copy_(src)
        return Ticket(t0, time.perf_counter(), dst.numel())

    def wait(self, ticket: Ticket) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def duration(self, ticket: Ticket) -> float:
        return ticket.end - ticket.start

    def exposed(self, copies: list[Ticket], uses: list[tuple[Ticket, Any]]) -> float:
        return sum(self.duration(t) for t in copies)  # every copy blocked the compute thread


class CudaBackend:
    """Copies on one side stream of `device`; marks are timing events on the current (compute) stream."""

    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def _event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def mark(self) -> Any:
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Ticket:
        start, end = self._event(), self._event()
        with torch.cuda.stream(self.stream):
            if after is not None:  # the compute stream is done with this slot's previous unit
                self.stream.wait_event(after)
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)  # pinned source: an async DMA, the host thread does not wait
            end.record(self.stream)
        return Ticket(start, end, dst.numel())

    def wait(self, ticket: Ticket) -> None:
        torch.cuda.current_stream(self.device).wait_event(ticket.end)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def duration(self, ticket: Ticket) -> float:
        return ticket.start.elapsed_time(ticket.end) / 1e3

    def exposed(self, copies: list[Ticket], uses: list[tuple[Ticket, Any]]) -> float:
        # The compute stream reached `want` and then waited for the copy's end: the part after `want` is exposed.
        return sum(max(0.0, want.elapsed_time(t.end) / 1e3) for t, want in uses)


def backend_for(device: torch.device):
    return CudaBackend(device) if device.type == "cuda" else HostBackend()


# ------------------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class StreamStats:
    """What one run's streaming moved and waited for (see the module docstring)."""

    backend: str
    bytes_moved: int
    copies: int
    on_demand: int  # copies issued when a unit was needed (cold start, out-of-order unit), not prefetched
    uses: int  # streamed unit forwards
    copy_seconds: float
    exposed_seconds: float
    plan: Mapping[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Bytes per second while copying."""
        return self.bytes_moved / self.copy_seconds if self.copy_seconds > 0 else 0.0

    @property
    def hidden_fraction(self) -> float:
        if self.copy_seconds <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.exposed_seconds / self.copy_seconds))

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "bytes_moved": self.bytes_moved, "copies": self.copies,
                "on_demand": self.on_demand, "uses": self.uses, "copy_seconds": self.copy_seconds,
                "throughput_gbps": self.throughput / 1e9, "exposed_seconds": self.exposed_seconds,
                "hidden_fraction": self.hidden_fraction, "plan": dict(self.plan)}

    def lines(self) -> list[str]:
        return [f"  streamed         {self.bytes_moved / 1e9:8.2f} GB in {self.copies} copies, "
                f"{self.throughput / 1e9:.1f} GB/s; copy wait not hidden {self.exposed_seconds:.3f} s "
                f"of {self.copy_seconds:.3f} s ({100 * self.hidden_fraction:.0f}% hidden)"]


_last_stats: contextvars.ContextVar["StreamStats | None"] = contextvars.ContextVar("h3lab_stream_stats", default=None)


def last_stats() -> StreamStats | None:
    """The statistics of the most recent streamed run in this context."""
    return _last_stats.get()


# ------------------------------------------------------------------------------------------------ the streamer
@dataclass(eq=False)
class _Unit:
    name: str
    module: nn.Module
    entries: list[Entry]
    nbytes: int
    host: torch.Tensor | None = None  # uint8 (nbytes,), a slice of a host arena, while the unit streams
    host_views: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class _Slot:
    index: int
    buffer: torch.Tensor  # uint8 (slot_bytes,) on the device
    unit: _Unit | None = None  # whose bytes it holds (or is receiving)
    ticket: Ticket | None = None  # the copy that fills it
    free: Any = None  # a mark on the compute stream after the last use of its bytes
    busy: bool = False
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # id(unit) -> views of `buffer`


def _host_buffers(sizes: list[int], pinned: bool) -> Iterator[list[tuple[int, torch.Tensor]]]:
    """A uint8 host buffer per size, one arena at a time: [(index, buffer), ...] of each arena's members, the next
    arena allocated only when the caller asks for it. Exact allocations, or slices of pinned arenas
    (`arena_layout`)."""
    if not sizes:
        return
    if not pinned:
        for i, n in enumerate(sizes):
            yield [(i, torch.empty(n, dtype=torch.uint8))]
        return
    for arena, members in arena_layout(sizes):
        buf = torch.empty(arena, dtype=torch.uint8, pin_memory=True)
        yield [(i, buf[offset: offset + sizes[i]]) for i, offset in members]


def streamer_of(model: nn.Module) -> "BlockStreamer | None":
    """The streamer driving `model`, or None (a resident model)."""
    return model.__dict__.get("_h3lab_streamer")


class BlockStreamer:
    """Streams a model's blocks through device slots (see the module docstring). Build with `stream_blocks`."""

    def __init__(self, model: nn.Module, device: torch.device, backend: Any = None):
        self.model = model
        self.device = torch.device(device)
        self.backend = backend if backend is not None else backend_for(self.device)
        # AdaLN weights served as tables live where the tables' source keeps them: no unit carries them; trainable
        # parameters (a LoRA of a model adapted before it streams) stay resident, where their optimiser state is
        self.skip = adaln_ids(model) if tables_of(model) is not None else set()
        self.skip |= {id(p) for p in model.parameters() if p.requires_grad}
        self.units: list[_Unit] = []
        for name, module in block_units(model):
            group, nbytes = unit_entries(module, skip=self.skip)
            self.units.append(_Unit(name, module, group, nbytes))
        self.plan: Plan | None = None
        self.streamed: list[_Unit] = []
        self.slots: list[_Slot] = []
        self._queue: deque[_Slot] = deque()  # prefetched slots, in predicted order of use
        self._cursor = 0
        self._current: tuple[_Unit, _Slot] | None = None
        self._handles: list[Any] = []
        self._by_module: dict[int, _Unit] = {}
        self._next: dict[int, _Unit] = {}  # id(unit) -> the streamed unit predicted after it (cyclic)
        self._prev: dict[int, _Unit] = {}  # id(unit) -> the one before it: what a backward recomputes next
        self._recording = False
        self._copies: list[Ticket] = []
        self._uses: list[tuple[Ticket, Any]] = []
        self._on_demand = 0

    # -------------------------------------------------------------------------------------- placement
    def apply(self, plan: Plan) -> "BlockStreamer":
        """Place every tensor as `plan` says (incrementally: units already where they belong are not touched), then
        (re)build the slots and the hooks."""
        self.backend.synchronize()
        self._remove_hooks()
        names = set(plan.streamed)
        with torch.no_grad():
            self.place_extras(self.units)  # the units themselves are placed below, as the plan says
            for unit in self.units:
                if unit.name not in names:
                    self._make_resident(unit)
            to_host = [u for u in self.units if u.name in names and u.host is None]
            # One arena at a time: each unit's old tensors are released as soon as its bytes are packed, so host
            # memory peaks at the model plus one arena, not at twice the streamed bytes.
            for members in _host_buffers([u.nbytes for u in to_host], pinned=self.device.type == "cuda"):
                for i, host in members:
                    unit = to_host[i]
                    for e in unit.entries:
                        host[e.offset: e.offset + e.nbytes].copy_(e.get().detach().reshape(-1).view(torch.uint8))
                    unit.host = host
                    unit.host_views = [_view(host, e) for e in unit.entries]
                    self._bind(unit, unit.host_views)
        self.plan = plan
        self.streamed = [u for u in self.units if u.name in names]
        self._next = {id(u): self.streamed[(i + 1) % len(self.streamed)] for i, u in enumerate(self.streamed)}
        self._prev = {id(u): self.streamed[i - 1] for i, u in enumerate(self.streamed)}
        self._queue.clear()
        self._current = None
        self.slots = [_Slot(i, torch.empty(plan.slot_bytes, dtype=torch.uint8, device=self.device))
                      for i in range(plan.slots)] if self.streamed else []
        self._cursor = 0
        for unit in self.streamed:
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(unit.module.register_forward_hook(self._post_hook, always_call=True))
        self._by_module = {id(u.module): u for u in self.streamed}
        self.model.__dict__["_h3lab_streamer"] = self
        empty_caches(self.device)
        return self

    def place_extras(self, skip: list[_Unit] | None = None) -> list[str]:
        """Move every tensor onto the device except the packed tensors of `skip` (default: the streamed units);
        returns their names. The tensors outside the units go there when the model is placed; tensors that appear
        later inside a unit -- a LoRA adapter injected for one run (`RunSpec.adapters`, applied before the
        residency), whose factors peft creates where the unit's weights are between forwards, in host memory -- stay
        resident beside the streamed ones (called by `begin_run`)."""
        packed = {id(e.get()) for u in (self.streamed if skip is None else skip) for e in u.entries} | self.skip
        moved = []
        with torch.no_grad():
            for path, owner, key, is_param, t in list(registered(self.model)):
                if id(t) not in packed and not t.is_meta and not _on(t, self.device):  # meta: a released block
                    bind(owner, key, is_param, t.to(self.device))
                    moved.append(f"{path + '.' if path else ''}{key}")
        return moved

    def forget_released(self) -> list[str]:
        """After layer thinning released blocks (moved their tensors to the meta device): their units leave the
        streamer -- hooks, slots' claims and host buffers -- and the remaining units are planned again with the same
        budget and slots (a smaller stack may fit a budget whole). Returns the names forgotten. Without this a
        released block's pre-hook would bind slot views into meta parameters on its next (skipped) call."""
        live = {name for name, _ in block_units(self.model)}
        gone = [u for u in self.units if u.name not in live]
        if not gone:
            return []
        self.backend.synchronize()
        self._remove_hooks()
        self.units = [u for u in self.units if u.name in live]
        self.streamed = [u for u in self.streamed if u.name in live]
        plan = self.plan
        self.apply(_plan(self, plan.gpu_memory_gib if plan else None, plan.slots if plan else DEFAULT_SLOTS))
        return [u.name for u in gone]

    def _make_resident(self, unit: _Unit) -> None:
        if unit.host is not None:
            self._bind(unit, [v.to(self.device) for v in unit.host_views])
            unit.host, unit.host_views = None, []
        else:
            for e in unit.entries:
                if not _on(e.get(), self.device):
                    e.bind(e.get().to(self.device))

    def remove(self, restore: bool = True) -> None:
        """Stop streaming. `restore=True`: every unit back on the device (a resident model; on CUDA refused,
        unchanged, when they do not fit). `restore=False`: streamed units stay bound to host memory (the model is
        then only good for `stream_blocks` again or for dropping)."""
        self.backend.synchronize()
        if restore:
            need = sum(u.nbytes for u in self.streamed)
            _check_fits(self.device, need - sum(s.buffer.numel() for s in self.slots), "streaming off")
        self._remove_hooks()
        self.slots, self._queue, self._current = [], deque(), None
        empty_caches(self.device)  # the slots' memory first: the restored blocks may need it
        if restore:
            with torch.no_grad():
                for unit in self.streamed:
                    self._make_resident(unit)
        self.streamed, self.plan = [], None
        self.model.__dict__.pop("_h3lab_streamer", None)
        empty_caches(self.device)

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _bind(unit: _Unit, tensors: list[torch.Tensor]) -> None:
        for e, t in zip(unit.entries, tensors):
            e.bind(t)

    # -------------------------------------------------------------------------------------- the hooks
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        unit = self._by_module[id(module)]
        if self._recording_grads(module, args) and not getattr(self.model, "gradient_checkpointing", False):
            raise ResidencyError(
                f"{unit.name}: a streamed block trains only with gradient checkpointing (this forward records "
                "gradients, which would keep weights the next block's copy overwrites); turn on gradient "
                "checkpointing (--gradient-checkpointing) or run it resident"
            )
        if self._current is not None:
            raise ResidencyError(f"{unit.name} started inside {self._current[0].name}: streamed blocks cannot nest")
        slot = self._take(unit)
        want = self.backend.mark()
        self.backend.wait(slot.ticket)
        if self._recording:
            self._uses.append((slot.ticket, want))
        views = slot.views.get(id(unit))
        if views is None:
            views = slot.views[id(unit)] = [_view(slot.buffer, e) for e in unit.entries]
        self._bind(unit, views)
        slot.busy = True
        self._current = (unit, slot)
        self._prefetch(unit)

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._current is None or self._current[0].module is not module:
            return  # the pre-hook refused this forward
        unit, slot = self._current
        self._bind(unit, unit.host_views)
        slot.free = self.backend.mark()
        slot.busy = False
        self._current = None

    def _take(self, unit: _Unit) -> _Slot:
        """The slot holding (or receiving) `unit`'s bytes: the predicted one, one that still holds them, or a free
        slot filled on demand."""
        if self._queue and self._queue[0].unit is unit:
            return self._queue.popleft()
        self._queue.clear()  # the prediction was wrong: prefetches stay labelled, a later use may still find them
        slot = next((s for s in self.slots if s.unit is unit and not s.busy), None)
        if slot is None:
            slot = self._free_slot()
            self._fill(slot, unit)
            self._on_demand += self._recording
        return slot

    @staticmethod
    def _recording_grads(module: nn.Module, args: tuple) -> bool:
        return torch.is_grad_enabled() and (any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
                                            or any(p.requires_grad for p in module.parameters()))

    def _prefetch(self, current: _Unit) -> None:
        """Queue the units predicted next (streamed order, cyclic: after the last comes the first; the reverse order
        while the model recomputes blocks for a backward) into the other slots, up to `slots - 1` ahead."""
        order = self._prev if getattr(self.model, "recomputing", False) else self._next
        nxt = self._queue[-1].unit if self._queue else current  # the queue already holds the units up to here
        while len(self._queue) < len(self.slots) - 1:
            nxt = order[id(nxt)]
            if nxt is current:
                break  # every streamed unit is queued or running
            slot = next((s for s in self.slots if s.unit is nxt and not s.busy and s not in self._queue), None)
            if slot is None:
                slot = self._free_slot()
                if slot is None:
                    break
                self._fill(slot, nxt)
            self._queue.append(slot)

    def _free_slot(self) -> _Slot | None:
        """The next slot in ring order that is neither running nor queued."""
        for step in range(len(self.slots)):
            slot = self.slots[(self._cursor + step) % len(self.slots)]
            if not slot.busy and slot not in self._queue:
                self._cursor = (slot.index + 1) % len(self.slots)
                return slot
        return None

    def _fill(self, slot: _Slot, unit: _Unit) -> None:
        # While gradients are recorded the slot's last-use mark is not enough: a block's backward kernels run after
        # its recomputation ended, so the copy waits for everything given to the compute stream so far.
        after = self.backend.mark() if torch.is_grad_enabled() else slot.free
        slot.ticket = self.backend.copy(slot.buffer[: unit.nbytes], unit.host, after=after)
        slot.unit = unit
        if self._recording:
            self._copies.append(slot.ticket)

    # -------------------------------------------------------------------------------------- statistics
    def begin_run(self) -> None:
        """Start a run's statistics; first place the tensors that appeared since the model was placed."""
        self.place_extras()
        self._copies, self._uses, self._on_demand, self._recording = [], [], 0, True

    def end_run(self) -> StreamStats:
        """Synchronise and summarise the copies since `begin_run` (see the module docstring)."""
        self.backend.synchronize()
        copies, uses = self._copies, self._uses
        stats = StreamStats(
            backend=self.backend.name,
            bytes_moved=sum(t.nbytes for t in copies),
            copies=len(copies),
            on_demand=self._on_demand,
            uses=len(uses),
            copy_seconds=sum(self.backend.duration(t) for t in copies),
            exposed_seconds=self.backend.exposed(copies, uses),
            plan=self.plan.to_dict() if self.plan is not None else {},
        )
        self._copies, self._uses, self._recording = [], [], False
        _last_stats.set(stats)
        return stats


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """`t` lives on `device` ("cuda" without an index means the current GPU, as torch places it)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _view(buffer: torch.Tensor, e: Entry) -> torch.Tensor:
    return buffer[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape)


def _check_fits(device: torch.device, extra: int, what: str) -> None:
    if device.type != "cuda" or extra <= 0:
        return
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if extra > free:
        raise ResidencyError(f"{what}: the blocks need {extra / GiB:.2f} GiB more on {device}, {free / GiB:.2f} GiB "
                             "are free; keep streaming (or give a --gpu-memory budget)")


def empty_caches(device: torch.device) -> None:
    """Give freed device memory and freed pinned host buffers back (CUDA; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()  # pinned buffers freed by a re-plan go back to the OS


def stream_blocks(model: nn.Module, device: torch.device | str | None = None, *, gpu_memory_gib: float | None = None,
                  slots: int = DEFAULT_SLOTS, backend: Any = None) -> BlockStreamer:
    """Stream `model`'s blocks (see the module docstring); a model already streamed is re-planned in place.
    `device` defaults to where the model's input projection lives."""
    if gpu_memory_gib is not None:
        gpu_memory_gib = check_gpu_memory(gpu_memory_gib)
    check_residency_value({"policy": "streamed", "slots": slots})
    current = streamer_of(model)
    if device is None:
        device = current.device if current is not None else _model_device(model)
    device = torch.device(device)
    if current is not None and (current.device != device or backend is not None):
        current.remove(restore=False)
        current = None
    if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
        from ..hashing import model_fingerprint

        model.fingerprint = model_fingerprint(model)  # the identity of these bytes, before they move
    if current is not None and current.skip != (adaln_ids(model) if tables_of(model) is not None else set()):
        current.remove(restore=False)  # the AdaLN weights joined or left the tables: the units change
        current = None
    streamer = current or BlockStreamer(model, device, backend)
    return streamer.apply(_plan(streamer, gpu_memory_gib, slots))


def _plan(streamer: BlockStreamer, gpu_memory_gib: float | None, slots: int) -> Plan:
    """The streamer's units planned under the budget; the device also holds the AdaLN tables when they serve."""
    sizes = [(u.name, u.nbytes) for u in streamer.units]
    fixed = fixed_bytes(streamer.model, [u.entries for u in streamer.units], streamer.skip)
    tables = tables_plan(streamer.model, PLANNED_TABLE_ROWS) if streamer.skip else None
    return plan_residency(sizes, fixed, gpu_memory_gib, slots, tables)


def _model_device(model: nn.Module) -> torch.device:
    proj = getattr(model, "proj_in", None)
    weight = getattr(proj, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(model.parameters()).device
