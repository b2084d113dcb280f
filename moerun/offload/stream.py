"""A MoE layer's view of the shared expert cache for one step.

`begin(experts)` fetches the experts the step touches. A decode step touches k experts, which
always fit (the cache holds at least k slots for every layer). A prefill chunk may touch more
experts than the layer's slots: then the step is split into groups of at most `capacity` experts,
in ascending order, each fetched (and the previous one released) when the backend first asks for
one of its experts. The backends visit experts in ascending order and compute each expert's rows
on their own, so the split changes no result bit.
"""

from __future__ import annotations

import time

import torch

from moerun.offload.cache import ExpertCache


class LayerStream:
    def __init__(self, cache: ExpertCache, layer: str):
        self.cache, self.layer = cache, layer
        self._group_of: dict[int, int] = {}
        self._groups: list[list[int]] = []
        self._current: int | None = None
        self.fetch_s = 0.0  # host seconds spent fetching, for the layer's compute timing

    def begin(self, experts: list[int]) -> None:
        """The step needs `experts` (distinct); fetch the first group now."""
        cap = self.cache.capacity(self.layer)
        self._groups = [experts[i : i + cap] for i in range(0, len(experts), cap)]
        self._group_of = {e: g for g, group in enumerate(self._groups) for e in group}
        self._current = None
        if self._groups:
            self._fetch(0)

    def groups(self) -> list[list[int]]:
        """The step's experts in the groups they are fetched in (ascending), as `begin` split them."""
        return [list(g) for g in self._groups]

    def tensors(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e's slot views; fetches e's group first when the step was split."""
        group = self._group_of.get(e)
        if group is None:
            raise RuntimeError(f"{self.layer}: expert {e} was not announced to the expert cache this step.")
        if group != self._current:
            self._release()
            self._fetch(group)
        return self.cache.tensors((self.layer, e))

    def slot_ids(self, experts: torch.Tensor) -> torch.Tensor:
        """int32 [k] on `experts`' device: the cache slot (in `cache.pool_buffers(layer)`) of each of
        `experts`, which must all be fetched in the step's current group (a decode step's always are)."""
        group = self._groups[self._current] if self._current is not None else []
        table = self.cache.slot_table(self.layer)
        ids = experts.tolist()
        missing = [e for e in ids if e not in group]
        if missing:
            raise RuntimeError(
                f"{self.layer}: experts {missing} are not fetched in this step's current group."
            )
        return torch.tensor([table[e] for e in ids], dtype=torch.int32, device=experts.device)

    def end(self) -> None:
        self._release()
        self._groups, self._group_of = [], {}

    def _fetch(self, group: int) -> None:
        start = time.perf_counter()
        self.cache.fetch_many([(self.layer, e) for e in self._groups[group]])
        self._current = group
        self.fetch_s += time.perf_counter() - start

    def _release(self) -> None:
        if self._current is not None:
            self.cache.release([(self.layer, e) for e in self._groups[self._current]])
            self._current = None
