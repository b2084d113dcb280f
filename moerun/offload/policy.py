"""Eviction policies for the expert cache's slots: which unpinned slot to reuse next.

A policy sees slot numbers only: `touch` when a slot is used or filled, `forget` when it is emptied,
`victims` to choose among the slots the cache may evict. LRU is the default; LFU is here to compare.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol


class EvictionPolicy(Protocol):
    def touch(self, slot: int) -> None: ...
    def forget(self, slot: int) -> None: ...
    def victims(self, candidates: Collection[int], n: int) -> list[int]: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[int, int] = {}

    def touch(self, slot: int) -> None:
        self._clock += 1
        self._last[slot] = self._clock

    def forget(self, slot: int) -> None:
        self._last.pop(slot, None)

    def victims(self, candidates: Collection[int], n: int) -> list[int]:
        return sorted(candidates, key=lambda s: self._last.get(s, 0))[:n]


class LFUPolicy:
    """Least frequently used since filled first; ties broken by least recent use."""

    def __init__(self) -> None:
        self._clock = 0
        self._uses: dict[int, tuple[int, int]] = {}

    def touch(self, slot: int) -> None:
        self._clock += 1
        uses, _ = self._uses.get(slot, (0, 0))
        self._uses[slot] = (uses + 1, self._clock)

    def forget(self, slot: int) -> None:
        self._uses.pop(slot, None)

    def victims(self, candidates: Collection[int], n: int) -> list[int]:
        return sorted(candidates, key=lambda s: self._uses.get(s, (0, 0)))[:n]


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}
