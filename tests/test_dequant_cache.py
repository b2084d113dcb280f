"""DequantCache: LRU order, the byte budget, and its counters."""

import pytest
import torch

from moerun.quant.cache import DequantCache


def _entry(nbytes: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(nbytes // 4, dtype=torch.float32),)


def test_hits_misses_and_lru_eviction():
    cache = DequantCache(budget_bytes=3 * 400)
    made = []

    def maker(key):
        def make():
            made.append(key)
            return _entry(400)

        return make

    for key in [("l0", 0, torch.float32), ("l0", 1, torch.float32), ("l0", 2, torch.float32)]:
        cache.get(key, maker(key))
    cache.get(("l0", 0, torch.float32), maker("again-0"))  # hit: expert 0 becomes most recent
    cache.get(("l0", 3, torch.float32), maker(("l0", 3)))  # evicts expert 1, the least recent
    assert ("l0", 1, torch.float32) not in cache
    assert ("l0", 0, torch.float32) in cache and ("l0", 2, torch.float32) in cache
    assert "again-0" not in made
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 4, 1)
    assert cache.stats.bytes == 3 * 400 and len(cache) == 3


def test_dtype_is_part_of_the_key():
    cache = DequantCache(budget_bytes=10_000)
    first = cache.get(("l", 0, torch.float32), lambda: _entry(400))
    other = cache.get(("l", 0, torch.bfloat16), lambda: _entry(400))
    assert first[0] is not other[0] and cache.stats.misses == 2


def test_entry_larger_than_the_budget_is_returned_but_not_kept():
    cache = DequantCache(budget_bytes=100)
    entry = cache.get(("l", 0, torch.float32), lambda: _entry(400))
    assert entry[0].numel() == 100 and len(cache) == 0 and cache.stats.bytes == 0


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        DequantCache(budget_bytes=-1)
