"""The one place moerun reads environment variables.

`MOERUN_TRACE` is a comma-separated list of trace channels:
  perf     per-stage wall times of each MoE layer call (route, plan, experts, combine)
  buffers  router sanity figures (logit min/max, NaN count, out-of-range ids, weight range)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

TRACE_CHANNELS = frozenset({"perf", "buffers"})


@dataclass(frozen=True)
class Settings:
    trace: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        raw = environ.get("MOERUN_TRACE", "")
        channels = frozenset(part.strip() for part in raw.split(",") if part.strip())
        unknown = channels - TRACE_CHANNELS - {"all"}
        if unknown:
            raise ValueError(
                f"MOERUN_TRACE names unknown channel(s) {sorted(unknown)}; "
                f"known channels are {sorted(TRACE_CHANNELS)} or 'all'."
            )
        if "all" in channels:
            channels = TRACE_CHANNELS
        return cls(trace=channels)


@functools.cache
def settings() -> Settings:
    """Settings read from the environment once per process (tests call `settings.cache_clear()`)."""
    return Settings.from_env(os.environ)
