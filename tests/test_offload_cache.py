"""ExpertStore and ExpertCache on their own: file slices, the host tier, LRU/LFU counts against a
hand-worked sequence, the budget floor, a long random run with the byte check, and faults."""

import random
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file

import moerun.offload.cache as cache_module
from moerun.loader import SafetensorsFile
from moerun.loader.mapped import MappedFile
from moerun.offload import (
    CacheBudgetError,
    ExpertCache,
    ExpertReadError,
    ExpertStore,
    minimum_bytes,
)

E, OUT, IN = 6, 8, 4


def _file(tmp_path, dtype=torch.bfloat16, layers=1, name="experts.safetensors"):
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        tensors[f"l{i}.gate_up"] = torch.randn(E, 2 * OUT, IN, generator=gen).to(dtype)
        tensors[f"l{i}.down"] = torch.randn(E, IN, OUT, generator=gen).to(dtype)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    save_file(tensors, path)
    return SafetensorsFile(path), tensors


def _store(f: SafetensorsFile, layers=1, dtype=torch.bfloat16, **kw) -> ExpertStore:
    weights = {f"l{i}": {p: f.tensor(f"l{i}.{p}") for p in ("gate_up", "down")} for i in range(layers)}
    return ExpertStore(weights, dtype, files=[MappedFile(f.path, f._data)], **kw)


def test_store_reads_one_expert_from_the_file(tmp_path):
    f, tensors = _file(tmp_path)
    store = _store(f)
    assert store.file_backed("l0") == {"gate_up": True, "down": True}
    for e in range(E):
        out = store.empty("l0")
        assert store.read_into(("l0", e), out) == (2 * OUT * IN + IN * OUT) * 2
        assert torch.equal(out["gate_up"], tensors["l0.gate_up"][e])
        assert torch.equal(out["down"], tensors["l0.down"][e])
    store.close()


def test_store_converts_to_the_compute_dtype(tmp_path):
    f, tensors = _file(tmp_path)
    store = _store(f, dtype=torch.float32)
    out = store.empty("l0")
    store.read_into(("l0", 3), out)
    assert out["gate_up"].dtype == torch.float32
    assert torch.equal(out["gate_up"], tensors["l0.gate_up"].float()[3])
    store.close()


def test_host_tier_serves_repeats_without_reading(tmp_path):
    f, tensors = _file(tmp_path)
    per_expert = (2 * OUT * IN + IN * OUT) * 2
    store = _store(f, host_budget_bytes=2 * per_expert)
    out = store.empty("l0")
    assert store.read_into(("l0", 1), out) == per_expert
    assert store.read_into(("l0", 1), out) == 0  # from the tier
    store.read_into(("l0", 2), out)
    store.read_into(("l0", 3), out)  # evicts expert 1 (budget: two experts)
    assert store.read_into(("l0", 1), out) == per_expert
    assert torch.equal(out["down"], tensors["l0.down"][1])
    store.close()


def _cache(tmp_path, slots, top_k=2, policy="lru", layers=1, **kw):
    f, tensors = _file(tmp_path, layers=layers)
    store = _store(f, layers=layers)
    per_slot = minimum_bytes(store, 1)
    return ExpertCache(store, slots * per_slot, top_k=top_k, policy=policy, **kw), tensors


def test_lru_hits_misses_and_bytes_follow_a_scripted_routing(tmp_path):
    cache, _ = _cache(tmp_path, slots=3)
    per_expert = (2 * OUT * IN + IN * OUT) * 2
    # 3 slots, LRU; each step pins its experts, then releases them. Use order after each step:
    #   [0,1] miss miss                            -> 0 1
    #   [1,2] hit miss (free slot)                 -> 0 1 2
    #   [0,3] hit; 3 misses, evicts LRU unpinned 1 -> 2 0 3
    #   [1,4] 1 evicts 2; 4 evicts 0 (3 is newer)  -> 3 1 4
    #   [3,4] hit hit
    steps = [[0, 1], [1, 2], [0, 3], [1, 4], [3, 4]]
    expected = [(0, 2), (1, 1), (1, 1), (0, 2), (2, 0)]
    for experts, (hits, misses) in zip(steps, expected, strict=True):
        cache.begin_step()
        keys = [("l0", e) for e in experts]
        cache.fetch_many(keys)
        cache.release(keys)
        cache.end_step()
        assert (cache.last_step.hits, cache.last_step.misses) == (hits, misses), experts
        assert cache.last_step.bytes_read == misses * per_expert
    assert sorted(cache.slot_table("l0")) == [1, 3, 4]
    assert cache.stats.steps == 5 and cache.stats.hits == 4 and cache.stats.misses == 6
    cache.close()


def test_lfu_keeps_the_frequent_expert_that_lru_drops(tmp_path):
    for policy, kept in (("lru", False), ("lfu", True)):
        cache, _ = _cache(tmp_path / policy, slots=2, top_k=1, policy=policy)
        for e in [0, 0, 0, 1, 2]:  # LRU evicts 0 for 2; LFU evicts 1 (used once)
            cache.fetch_many([("l0", e)])
            cache.release([("l0", e)])
        assert cache.resident(("l0", 0)) is kept
        cache.close()


def _steps(cache, experts):
    for e in experts:  # one step each
        cache.begin_step()
        cache.fetch_many([("l0", e)])
        cache.release([("l0", e)])
        cache.end_step()


@pytest.mark.parametrize("hot_share", [0.5, 0.0], ids=["hot-set", "lru-alone"])
def test_the_most_requested_experts_survive_a_scan_of_cold_ones(tmp_path, monkeypatch, hot_share):
    """5 slots, one token's expert each step: after HOT_PERIOD steps on experts 0 and 1 they are the
    hot set (at most half of the 4 slots beyond one token's), and a scan of the 4 others replaces
    only the other 3 slots. LRU alone evicts expert 0 on the scan's fourth expert."""
    monkeypatch.setattr(cache_module, "HOT_SHARE", hot_share)
    cache, _ = _cache(tmp_path, slots=5, top_k=1)
    _steps(cache, [0, 1] * (cache_module.HOT_PERIOD // 2))
    assert cache.hot == ({("l0", 0), ("l0", 1)} if hot_share else set())
    _steps(cache, [2, 3, 4, 5, 2, 3, 4, 5])
    kept = cache.resident(("l0", 0)) and cache.resident(("l0", 1))
    assert kept if hot_share else not cache.resident(("l0", 0))
    # at the next choice the counts (halved at the first) are 0, 1: 4 each; 2, 5: 2; 3, 4: 2 + 4
    _steps(cache, [3, 4] * 4)
    assert cache.hot == ({("l0", 3), ("l0", 4)} if hot_share else set())
    cache.close()


def test_pinned_experts_are_never_evicted(tmp_path):
    cache, _ = _cache(tmp_path, slots=2)
    cache.fetch_many([("l0", 0), ("l0", 1)])
    assert cache.prefetch([("l0", 2)]) == 0  # nothing evictable: the prefetch is dropped
    with pytest.raises(CacheBudgetError, match="all in use"):
        cache.fetch_many([("l0", 2)])
    cache.release([("l0", 0), ("l0", 1)])
    cache.close()


def test_too_small_a_budget_is_refused_with_the_minimum(tmp_path):
    f, _ = _file(tmp_path, layers=2)
    store = _store(f, layers=2)
    per_expert = (2 * OUT * IN + IN * OUT) * 2
    with pytest.raises(CacheBudgetError, match=f"minimum is expert_cache_gb=.*{3 * per_expert} bytes"):
        ExpertCache(store, 3 * per_expert - 1, top_k=3)
    cache = ExpertCache(store, 3 * per_expert, top_k=3)
    assert cache.num_slots == 3
    cache.close()


def test_prefetch_counts_used_and_wasted(tmp_path):
    cache, _ = _cache(tmp_path, slots=3, top_k=1)
    cache.fetch_many([("l0", 0)], predicted=[("l0", 1), ("l0", 2)])
    cache.release([("l0", 0)])
    cache.fetch_many([("l0", 1)])  # used
    cache.release([("l0", 1)])
    cache.fetch_many([("l0", 3)])  # evicts the LRU: expert 0 (2 was touched by its prefetch later)
    cache.release([("l0", 3)])
    cache.fetch_many([("l0", 4)])  # evicts 2, never used: wasted
    cache.release([("l0", 4)])
    s = cache.stats
    assert (s.prefetch_issued, s.prefetch_used, s.prefetch_wasted) == (2, 1, 1)
    assert (s.hits, s.misses) == (1, 3)
    cache.close()


def test_long_random_run_keeps_every_slot_equal_to_the_store(tmp_path):
    cache, tensors = _cache(tmp_path, slots=5, top_k=3, layers=3, debug=True)
    rng = random.Random(0)
    for _ in range(2000):
        cache.begin_step()
        for layer in ("l0", "l1", "l2"):
            keys = [(layer, e) for e in rng.sample(range(E), 3)]
            predicted = [(rng.choice(("l0", "l1", "l2")), rng.randrange(E)) for _ in range(rng.randrange(3))]
            slots = cache.fetch_many(keys, predicted)
            assert len(set(slots)) == 3
            for layer_e in keys:
                got = cache.tensors(layer_e)["down"]
                assert torch.equal(got, tensors[f"{layer_e[0]}.down"][layer_e[1]])
            cache.release(keys)
        cache.end_step()  # debug: every slot checked against the store
    s = cache.stats
    assert s.hits + s.misses == 2000 * 9 and s.misses > 1000
    assert s.prefetch_issued == s.prefetch_used + s.prefetch_wasted + len(
        [k for p in cache._pools.values() for k in p.prefetched]
    )
    cache.close()


def test_a_file_truncated_under_the_store_gives_a_clear_error(tmp_path):
    f, _ = _file(tmp_path)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(f.path, copy)
    store = _store(SafetensorsFile(copy))
    out = store.empty("l0")
    store.read_into(("l0", E - 1), out)
    with open(copy, "r+b") as handle:
        handle.truncate(copy.stat().st_size - 100)
    with pytest.raises(ExpertReadError, match="truncated or replaced"):
        store.read_into(("l0", E - 1), out)
    store.close()


def test_a_failed_load_leaves_no_slot_behind_and_readers_shut_down(tmp_path):
    f, _ = _file(tmp_path)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(f.path, copy)
    before = set(threading.enumerate())  # readers of other tests' caches may still be alive
    store = _store(SafetensorsFile(copy))
    cache = ExpertCache(store, 2 * minimum_bytes(store, 1), top_k=1)
    with open(copy, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(ExpertReadError):
        cache.fetch_many([("l0", 4)])
    assert not cache.resident(("l0", 4)) and cache.slot_table("l0") == {}
    readers = [t for t in set(threading.enumerate()) - before if t.name.startswith("moerun-expert-reader")]
    assert readers  # the store read on its own threads ...
    cache.close()
    assert not [t for t in readers if t.is_alive()]  # ... and they are gone
    with pytest.raises(ExpertReadError, match="closed"):
        cache.fetch_many([("l0", 1)])
