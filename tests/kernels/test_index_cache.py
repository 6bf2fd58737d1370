"""kernels/_index_cache.py: entries valid while the key tensors are the same live objects at the same `_version` and
data pointer, and `frozen()` (a CUDA graph capture): no build inside, a miss raises before any host read, every hit is
collected."""

from __future__ import annotations

import pytest
import torch

from h3kernels._index_cache import IndexCache, IndexCacheMiss, frozen, lazy, live_entries


def test_an_entry_lives_while_its_tensors_are_unchanged():
    cache, builds = IndexCache(), []
    index = torch.randint(0, 7, (11,))

    def build():
        builds.append(1)
        return {"max": int(index.max())}

    first = cache.get((index,), ("t",), build)
    assert cache.get((index,), ("t",), build) is first and len(builds) == 1
    assert cache.get((index.clone(),), ("t",), build) is not first  # another tensor, same bytes: built again
    index.add_(1)  # in place: a new _version
    assert cache.get((index,), ("t",), build)["max"] == first["max"] + 1 and len(builds) == 3
    version = index._version
    index.data = index.data + 5  # new storage, the same object and _version
    assert index._version == version
    assert cache.get((index,), ("t",), build)["max"] == first["max"] + 6 and len(builds) == 4


def test_frozen_collects_hits_and_refuses_to_build():
    cache = IndexCache()
    index = torch.randint(0, 5, (9,))
    entry = cache.get((index,), ("t",), lambda: {"n": 1})
    lazy(entry, "plan", lambda: torch.argsort(index))
    with frozen() as pins:
        assert cache.get((index,), ("t",), lambda: pytest.fail("built inside frozen()")) is entry
        assert torch.equal(lazy(entry, "plan", lambda: pytest.fail("computed")), torch.argsort(index))
        with pytest.raises(IndexCacheMiss, match=r"index cache miss for \('t',\) on tensors of shapes \[\[9\]\]"):
            cache.get((index.clone(),), ("t",), lambda: pytest.fail("built inside frozen()"))
        with pytest.raises(IndexCacheMiss, match="lazy index metadata 'other'"):
            lazy(entry, "other", lambda: pytest.fail("computed"))
    assert pins == [entry]
    assert cache.get((index.clone(),), ("t",), lambda: {"n": 2}) == {"n": 2}  # outside: builds again


def test_live_entries_lists_every_cache_and_forgets_dropped_entries():
    a, b = IndexCache(), IndexCache()
    i, j = torch.randint(0, 7, (5,)), torch.randint(0, 7, (6,))
    ea = a.get((i,), ("a",), lambda: {"cache": "a"})
    eb = b.get((j,), ("b",), lambda: {"cache": "b"})
    live = live_entries()
    assert any(e is ea for e in live) and any(e is eb for e in live)
    del j  # the key tensor freed: its entry leaves the cache, and the list
    assert not any(e is eb for e in live_entries()) and any(e is ea for e in live_entries())
