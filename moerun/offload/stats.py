"""Counters of expert streaming: one `OffloadStats` for the whole run, differences of it per step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class OffloadStats:
    route_ms: float = 0.0  # host time spent routing in streamed MoE layers
    fetch_ms: float = 0.0  # host time spent in fetch_many (waiting for misses included)
    compute_ms: float = 0.0  # host time of the experts and combine, fetches excluded
    hits: int = 0  # requested experts already in a slot (or loading there by prefetch)
    misses: int = 0  # requested experts that had to be loaded
    bytes_read: int = 0  # bytes copied out of the checkpoint (or the host tier's source)
    prefetch_issued: int = 0  # loads started by prediction
    prefetch_used: int = 0  # prefetched experts requested before being evicted
    prefetch_wasted: int = 0  # prefetched experts evicted without being requested
    prefetch_paused: int = 0  # steps with prefetching paused, as too few of its predictions were used
    steps: int = 0  # model forward passes

    def __sub__(self, other: OffloadStats) -> OffloadStats:
        return OffloadStats(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def copy(self) -> OffloadStats:
        return dataclasses.replace(self)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
