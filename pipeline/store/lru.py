"""A bounded map that forgets its least recently used entries: a worker's per-configuration
caches (:mod:`workers.runtime`) grow with every distinct configuration a submission carries, and
submissions come from the broker, so without a bound any stream of valid messages that differ
in one threshold grows a worker without end (issue 33, item 5).

Pinned keys (a worker's own configuration, ``"{}"``) are never evicted and do not count against
the bound. Not thread-safe by itself: its owner holds a lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``maxsize`` unpinned entries; inserting one more evicts the least recently used
    (a :meth:`get` hit or an insert is a use). ``evicted`` counts the evictions so far."""

    def __init__(self, maxsize: int, pinned: Iterable[K] = ()) -> None:
        if maxsize < 1:
            raise ValueError(f"an LRU needs room for at least one entry, not {maxsize}")
        self.maxsize = maxsize
        self.evicted = 0
        self._pinned = frozenset(pinned)
        self._fixed: dict[K, V] = {}
        self._lru: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        if key in self._fixed:
            return self._fixed[key]
        value = self._lru.get(key)
        if value is not None:
            self._lru.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        if key in self._pinned:
            self._fixed[key] = value
            return
        self._lru[key] = value
        self._lru.move_to_end(key)
        while len(self._lru) > self.maxsize:
            self._lru.popitem(last=False)
            self.evicted += 1

    def setdefault(self, key: K, value: V) -> V:
        """The value already under ``key`` (a racing builder's), else ``value``, stored."""
        got = self.get(key)
        if got is not None:
            return got
        self[key] = value
        return value

    def clear(self) -> None:
        """Forget every entry, pinned ones too (a test, or a process whose environment
        changed); the eviction count stays."""
        self._fixed.clear()
        self._lru.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._fixed or key in self._lru

    def __len__(self) -> int:
        return len(self._fixed) + len(self._lru)

    def __iter__(self) -> Iterator[K]:
        yield from list(self._fixed)
        yield from list(self._lru)
