"""`h3lab.app.caches.LRU`, the session's conditioning caches: the oldest entry goes past the limit, a hit refreshes."""

from types import SimpleNamespace

from h3lab.app.caches import LRU, entries


def test_lru_drops_the_oldest_and_a_hit_refreshes():
    cache = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.hit("a") == 1 and list(cache) == ["b", "a"]  # the hit moved to the end
    cache.put("c", 3)
    assert list(cache) == ["a", "c"] and cache.hit("b") is None  # "b" was the oldest
    cache.put("a", 4)
    assert list(cache) == ["c", "a"] and cache["a"] == 4  # a put refreshes too
    assert cache.hit("missing") is None and len(cache) == 2


def test_entries_list_text_then_conditions():
    text, cond = LRU(4), LRU(4)
    cond.put("k2", SimpleNamespace(summary="image 64x64"))
    text.put("k1", SimpleNamespace(summary="a fox"))
    assert entries(text, cond) == [{"kind": "text", "key": "k1", "summary": "a fox"},
                                   {"kind": "condition", "key": "k2", "summary": "image 64x64"}]
