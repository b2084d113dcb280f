"""Expert streaming: the only code that moves expert bytes between the checkpoint, host RAM and the
device. `ExpertStore` reads one expert's bytes; `ExpertCache` keeps a fixed pool of device slots fed
from it (eviction by a pluggable policy, predictive prefetch, `OffloadStats`); `LayerStream` is one
MoE layer's view of the cache for a step. `memory` reads what memory the process may use and
`budget` decides from it whether a model stays resident or streams, and the cache's size."""

from moerun.offload.cache import CacheBudgetError, CacheCorruptError, ExpertCache, minimum_bytes
from moerun.offload.policy import POLICIES, LFUPolicy, LRUPolicy
from moerun.offload.prefetch import NextLayerPrefetch
from moerun.offload.stats import OffloadStats
from moerun.offload.store import ExpertReadError, ExpertStore
from moerun.offload.stream import LayerStream

__all__ = [
    "POLICIES",
    "CacheBudgetError",
    "CacheCorruptError",
    "ExpertCache",
    "ExpertReadError",
    "ExpertStore",
    "LFUPolicy",
    "LRUPolicy",
    "LayerStream",
    "NextLayerPrefetch",
    "OffloadStats",
    "minimum_bytes",
]
