"""pipeline.store.lru: the bound on a worker's per-configuration caches (issue 33, item 5)."""

from __future__ import annotations

import pytest

from pipeline.store.lru import LRU


def test_inserting_past_the_bound_evicts_the_least_recently_used() -> None:
    """A get is a use: the entry read last survives, the one untouched longest goes."""
    cache: LRU[str, int] = LRU(2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1
    cache["c"] = 3
    assert list(cache) == ["a", "c"] and cache.get("b") is None
    assert (len(cache), cache.evicted) == (2, 1)


def test_pinned_keys_are_never_evicted_nor_counted() -> None:
    """A worker's own configuration ("{}") stays however many others come and go."""
    cache: LRU[str, int] = LRU(3, pinned=("{}",))
    cache["{}"] = 0
    for i in range(100):
        cache[f"k{i}"] = i
    assert cache.get("{}") == 0 and "{}" in cache
    assert len(cache) == 4 and cache.evicted == 97
    assert set(cache) == {"{}", "k97", "k98", "k99"}


def test_setdefault_keeps_the_value_a_racing_builder_stored() -> None:
    """Two threads that built the same context keep the first one stored."""
    cache: LRU[str, object] = LRU(4)
    first, second = object(), object()
    assert cache.setdefault("k", first) is first
    assert cache.setdefault("k", second) is first


def test_clear_forgets_every_entry_and_a_bound_below_one_is_refused() -> None:
    cache: LRU[str, int] = LRU(1, pinned=("{}",))
    cache["{}"], cache["a"] = 0, 1
    cache.clear()
    assert len(cache) == 0 and list(cache) == []
    with pytest.raises(ValueError, match="at least one"):
        LRU(0)
