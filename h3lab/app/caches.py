"""The session's conditioning caches: `LRU(limit)`, a small insertion-ordered cache with the `hit(key)` /
`put(key, value)` interface the pipeline's encode functions take (`h3lab.app.pipeline`).

Contract: `put` inserts (or refreshes) an entry at the end and drops the oldest while more than `limit` are held; `hit`
returns the value or None, and a hit moves the entry to the end. It is a `dict` (len, items, clear).
"""

from __future__ import annotations

from typing import Any


class LRU(dict):
    """A small insertion-ordered cache: the oldest entry goes when `limit` is exceeded; a hit moves to the end."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def hit(self, key: str) -> Any:
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value

    def put(self, key: str, value: Any) -> None:
        self.pop(key, None)
        self[key] = value
        while len(self) > self.limit:
            self.pop(next(iter(self)))


def entries(text: LRU, conditions: LRU) -> list[dict[str, str]]:
    """kind / key / summary of every cached entry, text first (`!cache`)."""
    out = [{"kind": "text", "key": k, "summary": v.summary} for k, v in text.items()]
    out += [{"kind": "condition", "key": k, "summary": v.summary} for k, v in conditions.items()]
    return out
