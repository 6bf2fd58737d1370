"""Validated index metadata, cached per index tensor so strict ops do not pay a host sync on every call.

Strict kernels validate their index tensors on the host (range, uniqueness, coverage), which needs a device sync,
and derive integer metadata from them (sort orders, inverse maps). The model passes the *same* index tensors to
every block and every denoising step, so the result is cached under the identity of the tensors: an entry is used
only while every key tensor is the same live object with an unchanged `_version` (every in-place write, through
any view, bumps it), otherwise the check runs again. Inference-mode tensors track no version and are never cached.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors
        return None


class IndexCache:
    """key (tensors + plain values) -> dict of derived metadata, valid while the tensors are unchanged."""

    def __init__(self, max_entries: int = 64) -> None:
        self._entries: dict[tuple, tuple] = {}
        self._max = max_entries

    def get(self, tensors: tuple[torch.Tensor, ...], extra: tuple, build: Callable[[], dict]) -> dict:
        """The cached entry for (tensors, extra), or `build()` (which validates and may raise) stored as one."""
        versions = tuple(_version(t) for t in tensors)
        key = (tuple(id(t) for t in tensors), extra)
        entry = self._entries.get(key)
        if (
            entry is not None
            and None not in versions
            and all(ref() is t for ref, t in zip(entry[0], tensors))
            and entry[1] == versions
        ):
            return entry[2]
        value = build()
        if None not in versions:
            if len(self._entries) >= self._max:
                self._entries.pop(next(iter(self._entries)))
            refs = tuple(weakref.ref(t, lambda _r, k=key: self._entries.pop(k, None)) for t in tensors)
            self._entries[key] = (refs, versions, value)
        return value


def lazy(entry: dict, name: str, make: Callable[[], Any]) -> Any:
    """entry[name], computed by make() on first use (derived metadata only the backward needs, say)."""
    if name not in entry:
        entry[name] = make()
    return entry[name]
