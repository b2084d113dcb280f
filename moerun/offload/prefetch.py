"""Prefetch by prediction, beside the cache it feeds: while MoE layer L computes, the next MoE layer's
router is run on the current hidden state (the model asks the layer for that mass), and the
`prefetch_k` experts with the most mass start loading into the expert cache, so that most of layer
L+1's fetch has happened by the time it routes. Under expert parallelism each rank prefetches only
its own experts, from rank 0's prediction."""

from __future__ import annotations

import torch

from moerun.offload.cache import ExpertCache


class NextLayerPrefetch:
    def __init__(self, cache: ExpertCache, k: int):
        self.cache, self.k = cache, k

    @property
    def active(self) -> bool:
        """Whether this step prefetches (the cache may pause prefetching for a step)."""
        return bool(self.k) and self.cache.prefetching

    def start(self, layer: str, mass: torch.Tensor, owned: range | None = None) -> None:
        """Start loading the `k` experts of MoE layer `layer` with the most predicted mass [E]; with
        `owned` (expert parallelism, this rank's share) the most among those."""
        if owned is not None:
            mass = mass[owned.start : owned.stop]
        top = mass.topk(min(self.k, mass.numel())).indices.tolist()
        if owned is not None:
            top = [owned[i] for i in top]
        self.cache.prefetch([(layer, e) for e in top])
