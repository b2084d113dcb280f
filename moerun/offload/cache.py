"""ExpertCache: a fixed pool of device slots, each holding one expert's projections.

Slots are preallocated once per layout (the parts' dtypes and shapes; most models have one layout
for all their MoE layers) as one buffer per projection, [slots, out, in]; a map (layer, expert) ->
slot says what each holds. Slots never move: an expert is loaded into a slot and read there until
evicted, so a table of slot numbers stays valid. `fetch_many` pins what it returns until `release`:
a pinned slot is never evicted, so a step's experts stay put while it computes. Misses load on the
store's reader threads; on CUDA each load is staged in pinned host memory and copied on a copy
stream that first waits for the compute stream (the slot's old contents may still be being read),
and the compute stream waits for the copy's event before using the slot. `prefetch` starts loads
of predicted experts into free or evictable slots without waiting for them.

Budget: each layout gets the `top_k` slots one token's experts need in one layer (layers run one
after another, so that is the minimum that works); the rest of the budget is shared in proportion
to each layout's expert bytes, and never more slots than the layout has experts.

Hot experts are pinned by observed frequency: the cache counts each expert's requests, and every
`HOT_PERIOD` steps the most requested experts, up to `HOT_SHARE` of each pool's slots beyond one
token's, become the hot set (the counts are then halved, so the set follows the text). An expert of
the hot set is never evicted while a colder one can be: the eviction policy (LRU by default) chooses
among the others. A run of experts used once (a prompt on a new subject, wrong predictions) then
replaces only the other slots, not the experts most tokens use.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import torch

from moerun.offload.budget import gb_at_least
from moerun.offload.policy import POLICIES, EvictionPolicy
from moerun.offload.stats import OffloadStats
from moerun.offload.store import ExpertStore, Key, Layout
from moerun.offload.throttle import PrefetchThrottle

HOT_PERIOD = 16  # steps between choices of the hot set
HOT_SHARE = 0.75  # of each pool's slots beyond one token's, the most the hot set holds


class CacheBudgetError(ValueError):
    """An expert cache budget too small for one token's experts; `minimum` is the least that works."""

    def __init__(self, message: str, minimum: int | None = None):
        super().__init__(message)
        self.minimum = minimum


class CacheCorruptError(RuntimeError):
    """A slot's bytes differ from the store's (the debug check)."""


class _Pool:
    """The slots of one layout."""

    def __init__(self, layout: Layout, slots: int, device: torch.device, policy: EvictionPolicy):
        self.layout = layout
        self.buffers = {p.name: torch.empty((slots, *p.shape), dtype=p.dtype, device=device) for p in layout}
        self.keys: list[Key | None] = [None] * slots
        self.table: dict[Key, int] = {}
        self.pins = [0] * slots
        self.loading: dict[int, Future] = {}
        self.prefetched: set[int] = set()  # filled by prefetch and not yet requested
        self.policy = policy

    @property
    def num_slots(self) -> int:
        return len(self.keys)


def slot_bytes(layout: Layout) -> int:
    return sum(part.nbytes for part in layout)


def minimum_bytes(store: ExpertStore, top_k: int) -> int:
    """The smallest budget that works: top_k slots of every layout."""
    return sum(top_k * slot_bytes(layout) for layout in {store.layout(layer) for layer in store.sources})


class ExpertCache:
    def __init__(
        self,
        store: ExpertStore,
        budget_bytes: int,
        top_k: int,
        device: torch.device | str = "cpu",
        policy: str | Callable[[], EvictionPolicy] = "lru",
        debug: bool = False,
    ):
        """`debug`: after every step, check that each slot's bytes still equal the store's (slow)."""
        self.store, self.device, self.top_k, self.debug = store, torch.device(device), top_k, debug
        make_policy = POLICIES[policy] if isinstance(policy, str) else policy
        layers: dict[Layout, list[str]] = {}
        for layer in store.sources:
            layers.setdefault(store.layout(layer), []).append(layer)
        need = minimum_bytes(store, top_k)
        if budget_bytes < need:
            raise CacheBudgetError(
                f"An expert cache of {budget_bytes / 2**30:.6g} GB ({budget_bytes} bytes) cannot hold one "
                f"token's {top_k} experts of a layer; the minimum is expert_cache_gb={gb_at_least(need)} "
                f"({need} bytes).",
                need,
            )
        spare = budget_bytes - need
        weight = {layout: len(names) * slot_bytes(layout) for layout, names in layers.items()}
        self._pools: dict[Layout, _Pool] = {}
        self._pool_of: dict[str, _Pool] = {}
        for layout, names in layers.items():
            extra = int(spare * weight[layout] / sum(weight.values())) // slot_bytes(layout)
            most = sum(store.num_experts(name) for name in names)
            pool = _Pool(layout, min(top_k + extra, most), self.device, make_policy())
            self._pools[layout] = pool
            self._pool_of.update(dict.fromkeys(names, pool))
        self.stats = OffloadStats()
        self.throttle = PrefetchThrottle()  # pauses prefetch while its predictions go unused
        self.prefetching = True  # this step: the model prefetches (see begin_step)
        self.last_step = OffloadStats()
        self._step_start = OffloadStats()
        self._lock = threading.Lock()  # reader threads add bytes_read
        self.requests: Counter[Key] = Counter()  # requests per expert, halved at each choice of `hot`
        self.hot: frozenset[Key] = frozenset()  # experts kept out of eviction while others can go
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- sizes -------------------------------------------------------------------------------
    def capacity(self, layer: str) -> int:
        """Slots `layer`'s experts can use at once."""
        return self._pool_of[layer].num_slots

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self._pools.values())

    @property
    def nbytes(self) -> int:
        return sum(p.num_slots * slot_bytes(layout) for layout, p in self._pools.items())

    def resident(self, key: Key) -> bool:
        return key in self._pool_of[key[0]].table

    # -- fetching ----------------------------------------------------------------------------
    def fetch_many(self, keys: Sequence[Key], predicted: Iterable[Key] = ()) -> list[int]:
        """Slots holding `keys`, pinned until `release(keys)`; misses loaded (all reads in parallel)
        and waited for. Then `predicted` keys start loading in the background (see `prefetch`)."""
        start = time.perf_counter()
        slots: list[int] = []
        try:
            for key in keys:
                pool = self._pool_of[key[0]]
                self.requests[key] += 1
                slot = pool.table.get(key)
                if slot is None:
                    slot = self._claim(pool, key, pinned_request=True)
                    self.stats.misses += 1
                    self._load(pool, slot, key)
                else:
                    self.stats.hits += 1
                    if slot in pool.prefetched:
                        pool.prefetched.discard(slot)
                        self.stats.prefetch_used += 1
                pool.pins[slot] += 1
                pool.policy.touch(slot)
                slots.append(slot)
            for key, slot in zip(keys, slots, strict=False):
                self._wait(self._pool_of[key[0]], slot)
        except BaseException:
            for key, slot in zip(keys, slots, strict=False):
                pool = self._pool_of[key[0]]
                pool.pins[slot] -= 1
                with contextlib.suppress(Exception):  # the first error is the one to report
                    self._wait(pool, slot)
            raise
        finally:
            self.stats.fetch_ms += 1e3 * (time.perf_counter() - start)
        self.prefetch(predicted)
        return slots

    def release(self, keys: Iterable[Key]) -> None:
        for key in keys:
            pool = self._pool_of[key[0]]
            pool.pins[pool.table[key]] -= 1

    def prefetch(self, keys: Iterable[Key]) -> int:
        """Start loading `keys` not yet resident into free or evictable slots (never pinned ones,
        never ones still loading); returns how many loads started."""
        issued = 0
        for key in keys:
            pool = self._pool_of[key[0]]
            if key in pool.table:
                continue
            slot = self._claim(pool, key, pinned_request=False)
            if slot is None:
                break
            pool.prefetched.add(slot)
            # not touched: a prediction sits at the evict-first end until it is requested, so a
            # wrong guess displaces no more than the one least recently used expert
            pool.policy.forget(slot)
            self._load(pool, slot, key)
            issued += 1
        self.stats.prefetch_issued += issued
        return issued

    def tensors(self, key: Key) -> dict[str, torch.Tensor]:
        """The slot views (projection -> [out, in] or [out, row_bytes]) of a fetched expert."""
        pool = self._pool_of[key[0]]
        slot = pool.table[key]
        return {name: buffer[slot] for name, buffer in pool.buffers.items()}

    def pool_buffers(self, layer: str) -> dict[str, torch.Tensor]:
        """projection -> the slot pool [S, ...] that holds `layer`'s experts (shared with the layers
        of the same layout): slot s is `buffer[s]`. The buffers never move, so kernels (and CUDA
        graphs) may index them by slot."""
        return dict(self._pool_of[layer].buffers)

    def slot_table(self, layer: str) -> dict[int, int]:
        """expert -> slot for `layer`'s resident experts."""
        pool = self._pool_of[layer]
        return {e: slot for (name, e), slot in pool.table.items() if name == layer}

    def _claim(self, pool: _Pool, key: Key, pinned_request: bool) -> int | None:
        """A slot for `key`: a free one, else the policy's victim among unpinned slots (for a
        prefetch: also not loading). None for a prefetch when nothing may be evicted."""
        free = [s for s, k in enumerate(pool.keys) if k is None and s not in pool.loading]
        if free:
            slot = free[0]
        else:
            candidates = [
                s
                for s in range(pool.num_slots)
                if pool.pins[s] == 0 and (pinned_request or s not in pool.loading)
            ]
            if not candidates:
                if not pinned_request:
                    return None
                raise CacheBudgetError(
                    f"The expert cache's {pool.num_slots} slots for {key[0]} are all in use by this step; "
                    "ask for at most that many experts at once."
                )
            cold = [s for s in candidates if pool.keys[s] not in self.hot]
            slot = pool.policy.victims(cold or candidates, 1)[0]
            self._evict(pool, slot)
        pool.keys[slot] = key
        pool.table[key] = slot
        return slot

    def _evict(self, pool: _Pool, slot: int) -> None:
        self._wait(pool, slot)  # a load still writing into it finishes first
        if slot in pool.prefetched:
            pool.prefetched.discard(slot)
            self.stats.prefetch_wasted += 1
        del pool.table[pool.keys[slot]]
        pool.keys[slot] = None
        pool.policy.forget(slot)

    def _load(self, pool: _Pool, slot: int, key: Key) -> None:
        after = None
        if self.copy_stream is not None:  # the slot's old contents may still be read by queued compute
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        dests = {name: buffer[slot] for name, buffer in pool.buffers.items()}
        try:
            pool.loading[slot] = self.store.submit(self._read_job, key, dests, after)
        except BaseException:
            del pool.table[key]
            pool.keys[slot] = None
            raise

    def _read_job(self, key: Key, dests: dict[str, torch.Tensor], after) -> torch.cuda.Event | None:
        """On a reader thread: expert `key` into its slot; on CUDA, the event of its copy."""
        if self.copy_stream is None:
            read = self.store.read_into(key, dests)
            done = None
        else:
            staging = self.store.empty(key[0], pin=True)
            read = self.store.read_into(key, staging)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(after)
                for name, dest in dests.items():
                    dest.copy_(staging[name], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            done.synchronize()  # the staging buffers may go once the copy has landed
        with self._lock:
            self.stats.bytes_read += read
        return done

    def _wait(self, pool: _Pool, slot: int) -> None:
        future = pool.loading.pop(slot, None)
        if future is None:
            return
        try:
            done = future.result()
        except BaseException:
            key = pool.keys[slot]  # the slot holds garbage: forget it
            if key is not None:
                del pool.table[key]
                pool.keys[slot] = None
                pool.prefetched.discard(slot)
                pool.policy.forget(slot)
            raise
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    # -- steps, stats and checks ---------------------------------------------------------------
    def begin_step(self) -> None:
        self._step_start = self.stats.copy()
        self.prefetching = self.throttle.allow(self.stats)
        self.stats.prefetch_paused += not self.prefetching

    def end_step(self) -> None:
        self.stats.steps += 1
        self.last_step = self.stats - self._step_start
        if self.stats.steps % HOT_PERIOD == 0:
            self.choose_hot()
        if self.debug:
            self.verify()

    def choose_hot(self) -> None:
        """The hot set from the request counts: per pool, the most requested experts, at most
        HOT_SHARE of its slots beyond top_k (ties: the expert requested first); the counts halve."""
        hot: list[Key] = []
        for pool in self._pools.values():
            most = int(HOT_SHARE * (pool.num_slots - self.top_k))
            keys = [k for k in self.requests if self._pool_of[k[0]] is pool]
            hot += sorted(keys, key=lambda k: -self.requests[k])[:most]
        self.hot = frozenset(hot)
        self.requests = Counter({k: n // 2 for k, n in self.requests.items() if n > 1})

    def record(self, route_ms: float = 0.0, compute_ms: float = 0.0) -> None:
        self.stats.route_ms += route_ms
        self.stats.compute_ms += compute_ms

    def summary(self) -> dict:
        return {
            "slots": self.num_slots,
            "cache_bytes": self.nbytes,
            "hot": len(self.hot),
            "reads": self.store.read_counts(),
            "last_step": self.last_step.as_dict(),
            "total": self.stats.as_dict(),
        }

    def verify(self) -> None:
        """Raise CacheCorruptError unless every resident slot's bytes equal the store's."""
        for pool in self._pools.values():
            for slot, key in enumerate(pool.keys):
                if key is None:
                    continue
                self._wait(pool, slot)
                fresh = self.store.empty(key[0])
                self.store.read_into(key, fresh)
                for name, buffer in pool.buffers.items():
                    held = buffer[slot].cpu().contiguous().view(torch.uint8)
                    if not torch.equal(held, fresh[name].contiguous().view(torch.uint8)):
                        raise CacheCorruptError(f"Slot {slot} ({key[0]} expert {key[1]}) {name} differs.")

    def close(self) -> None:
        """Let loads in flight finish (a failed prefetch nobody asked for is not an error), then
        stop the store's reader threads."""
        for pool in self._pools.values():
            for slot in list(pool.loading):
                with contextlib.suppress(Exception):
                    self._wait(pool, slot)
        self.store.close()
