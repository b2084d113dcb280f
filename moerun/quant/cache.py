"""A bounded LRU cache of dequantised experts, for paths that need dense weights (CPU prefill).

Keyed by (layer, expert, dtype); each entry holds all of one expert's dense projections. Bounded
in bytes: inserting past the budget evicts the least recently used entries first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

CacheKey = tuple[str, int, torch.dtype]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0


class DequantCache:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"dequantised-expert cache budget must be >= 0 bytes, got {budget_bytes}.")
        self.budget_bytes = budget_bytes
        self.stats = CacheStats()
        self._entries: OrderedDict[CacheKey, tuple[torch.Tensor, ...]] = OrderedDict()

    def get(self, key: CacheKey, make: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The cached tensors for `key`, or `make()`'s, kept if they fit in the budget."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry
        self.stats.misses += 1
        entry = make()
        size = sum(t.numel() * t.element_size() for t in entry)
        if size <= self.budget_bytes:
            while self.stats.bytes + size > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.stats.bytes -= sum(t.numel() * t.element_size() for t in evicted)
                self.stats.evictions += 1
            self._entries[key] = entry
            self.stats.bytes += size
        return entry

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
