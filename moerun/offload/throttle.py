"""Prefetch only while it pays: predictions that are rarely used cost reads for nothing.

The cache asks `allow(stats)` at the start of every step. Prefetches are judged in rounds: once
`round_size` have been issued since the last judgement, the share of them used (requested before
eviction) is compared with `min_useful`; below it, prefetching pauses for `pause_steps` steps and is
then tried again (routing changes with the text, so a bad stretch need not last). On a real model
the next layer's router usually predicts well; on random weights it predicts nothing and pausing
saves the wasted reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerun.offload.stats import OffloadStats


@dataclass
class PrefetchThrottle:
    round_size: int = 32
    min_useful: float = 0.25
    pause_steps: int = 64
    _issued: int = 0  # stats.prefetch_issued at the last judgement
    _used: int = 0
    _step: int = 0
    _paused_until: int = 0

    def allow(self, stats: OffloadStats) -> bool:
        """Whether to prefetch during the step starting now."""
        self._step += 1
        if self._step < self._paused_until:
            return False
        issued, used = stats.prefetch_issued - self._issued, stats.prefetch_used - self._used
        if issued < self.round_size:
            return True
        self._issued, self._used = stats.prefetch_issued, stats.prefetch_used
        if used >= self.min_useful * issued:
            return True
        self._paused_until = self._step + self.pause_steps
        return False
