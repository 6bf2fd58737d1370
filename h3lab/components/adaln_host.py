"""AdaLN weights in host memory: the `--adaln tables` placement. Each block's `adaln_proj.linear` (about 13B of the
released DiT's 33B parameters) lives in (pinned) host memory and is streamed block by block through device slots
while `h3lab.model.adaln_tables` computes the tables a run needs; only the tables stay on the device.

Contract
--------
`keep_on_host(model, device, backend=None) -> HostAdaLN` changes a built `H3Transformer` in place: every live block's
AdaLN weight and bias are packed (`residency.unit_entries`: 512-byte aligned offsets) into one host buffer per block
(pinned power-of-two arenas on CUDA, `streaming._host_buffers`; plain memory on the CPU) and the Parameters become
views of it (the Parameter objects are kept). It attaches `AdaLNTables(model, source)` (the model's forwards are then
served from tables) and returns the source. `release(model, restore=True)` ends it: tables detached, the AdaLN
weights back on the device as ordinary tensors.

`HostAdaLN.weights(blocks)` (the tables' weight source): allocates `SLOTS` device buffers of the largest block's
AdaLN bytes, copies the next block into the free slot on the copy backend (`streaming.backend_for`: a side stream on
CUDA, which waits for the compute stream to be done with the slot; at once on the CPU) while the caller computes
with the current one, binds the block's Parameters to views of its slot while it is yielded and back to their host
views after, and frees the slots at the end (the caching allocator hands the bytes to the forward's activations).
The bytes are copied, never converted: a table is computed from the resident weights' exact bytes.

Composition (`ExecutionPlan.place`): a streamed DiT streams its blocks without their AdaLN weights
(`streaming.BlockStreamer` skips what `adaln_host_ids(model)` names); planning (`residency.plan_residency`) counts the
tables instead of the AdaLN weights. With a device mesh (each TP rank holds a shard of the AdaLN channels) the
placement is refused in `execution.check_plan`.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..model.adaln_tables import AdaLNTables, adaln_linear, live_blocks, tables_of
from .residency import bind, unit_entries
from .streaming import _host_buffers, _view, backend_for, empty_caches

SLOTS = 2


class HostAdaLN:
    """The AdaLN weights of a model's blocks in host memory, brought to `device` block by block (module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device | str, backend: Any = None):
        self.model = model
        self.device = torch.device(device)
        self.backend = backend if backend is not None else backend_for(self.device)
        self.entries: dict[int, list] = {}
        self.nbytes: dict[int, int] = {}
        self.host: dict[int, torch.Tensor] = {}
        self.host_views: dict[int, list[torch.Tensor]] = {}
        self.copied_bytes = 0

    def pack(self) -> "HostAdaLN":
        """Copy every live block's AdaLN tensors into host buffers and bind the Parameters to them."""
        blocks = live_blocks(self.model)
        for i in blocks:
            self.entries[i], self.nbytes[i] = unit_entries(adaln_linear(self.model, i))
        with torch.no_grad():  # one arena at a time: each block's device copy goes as soon as it is packed
            for members in _host_buffers([self.nbytes[i] for i in blocks], pinned=self.device.type == "cuda"):
                for k, host in members:
                    self._pack_block(blocks[k], host)
        empty_caches(self.device)
        return self

    def _pack_block(self, i: int, host: torch.Tensor) -> None:
        """Block i's AdaLN tensors copied into `host` and its Parameters bound to views of it."""
        for e in self.entries[i]:
            host[e.offset: e.offset + e.nbytes].copy_(e.get().detach().reshape(-1).view(torch.uint8))
        self.host[i] = host
        self.host_views[i] = [_view(host, e) for e in self.entries[i]]
        _bind(self.entries[i], self.host_views[i])

    def blocks(self) -> list[int]:
        live = set(live_blocks(self.model))
        return [i for i in self.host if i in live]

    def tensor_ids(self) -> set[int]:
        """ids of the Parameters this source holds in host memory (what a block streamer must leave alone)."""
        return {id(e.get()) for group in self.entries.values() for e in group}

    @property
    def host_bytes(self) -> int:
        return sum(self.nbytes.values())

    def weights(self, blocks: Sequence[int]) -> Iterator[int]:
        """Each block of `blocks` in order, its AdaLN Parameters bound to device bytes while yielded (module
        docstring)."""
        blocks = list(blocks)
        if not blocks:
            return
        size = max(self.nbytes[i] for i in blocks)
        slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(min(SLOTS, len(blocks)))]
        free: list[Any] = [None] * len(slots)
        tickets: dict[int, Any] = {}

        def fill(k: int) -> None:  # block k of `blocks` into slot k % len(slots)
            s, i = k % len(slots), blocks[k]
            tickets[k] = self.backend.copy(slots[s][: self.nbytes[i]], self.host[i], after=free[s])
            self.copied_bytes += self.nbytes[i]

        try:
            for k in range(min(len(slots), len(blocks))):
                fill(k)
            for k, i in enumerate(blocks):
                s = k % len(slots)
                self.backend.wait(tickets.pop(k))
                _bind(self.entries[i], [_view(slots[s], e) for e in self.entries[i]])
                try:
                    yield i
                finally:
                    _bind(self.entries[i], self.host_views[i])
                    free[s] = self.backend.mark()  # the compute stream is done with this slot after this point
                if k + len(slots) < len(blocks):
                    fill(k + len(slots))
        finally:
            self.backend.synchronize()
            del slots

    def forget_released(self) -> list[int]:
        """After layer thinning released blocks (their tensors on the meta device): their host buffers are dropped
        (an arena two blocks share is freed with its last block). Returns the blocks forgotten."""
        live = set(live_blocks(self.model))
        gone = [i for i in self.host if i not in live]
        for i in gone:
            del self.entries[i], self.nbytes[i], self.host[i], self.host_views[i]
        if gone:
            empty_caches(self.device)
        return gone

    def restore(self) -> None:
        """Every AdaLN Parameter back on the device as an ordinary tensor; the host buffers are dropped."""
        with torch.no_grad():
            for i, group in self.entries.items():
                _bind(group, [v.to(self.device) for v in self.host_views[i]])
        self.entries, self.nbytes, self.host, self.host_views = {}, {}, {}, {}
        empty_caches(self.device)


def _bind(entries: list, tensors: list[torch.Tensor]) -> None:
    for e, t in zip(entries, tensors):
        bind(e.owner, e.key, e.is_param, t)


def source_of(model: nn.Module) -> HostAdaLN | None:
    """The host source of `model`'s AdaLN weights, or None (they live with the model)."""
    tables = tables_of(model)
    source = getattr(tables, "source", None)
    return source if isinstance(source, HostAdaLN) else None


def adaln_host_ids(model: nn.Module) -> set[int]:
    """ids of the tensors a `HostAdaLN` keeps in host memory for `model` (empty without one)."""
    source = source_of(model)
    return source.tensor_ids() if source is not None else set()


def keep_on_host(model: nn.Module, device: torch.device | str, backend: Any = None) -> HostAdaLN:
    """Keep `model`'s AdaLN weights in host memory and serve its forwards from tables (module docstring)."""
    current = source_of(model)
    if current is not None and current.device == torch.device(device) and backend is None:
        return current
    if current is not None:
        release(model, restore=True)
    source = HostAdaLN(model, device, backend).pack()
    AdaLNTables(model, source).attach()
    return source


def release(model: nn.Module, restore: bool = True) -> None:
    """Stop serving `model` from tables; `restore`: its AdaLN weights back on the device."""
    tables = tables_of(model)
    if tables is None:
        return
    tables.detach()
    source = tables.source
    if restore and isinstance(source, HostAdaLN):
        source.restore()
