"""Choosing where a model goes when the user names no expert cache: all resident, or experts streamed
through a cache of what is left.

`auto_budget` is the rule, a pure function of byte counts so it is tested with plain numbers: the
model stays resident when its dense part, its experts, a KV cache of `KV_RESERVE_TOKENS` and a margin
fit the memory it may use (moerun.offload.memory); else the experts are streamed through an expert
cache of what is left after the dense part, the KV cache and the margin. The margin is the working
memory a forward pass takes (activations, the readers' buffers: the caller estimates it from the
model) plus `MARGIN_FRACTION` of the memory, at least `floor` (on CUDA: the context and the
allocator's slack). `Fit` says the decision in one line, and what a budget too small would need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_RESERVE_TOKENS = 4096  # context the KV cache is sized for when the budget is chosen
MARGIN_BYTES = 2**30  # CUDA: kept free besides (context, allocator slack, activations)
MARGIN_FRACTION = 0.05  # of the memory, kept free besides the working memory


def _gb(n: int) -> str:
    """Bytes for a reader: GB with two decimals, MB below a tenth of a GB."""
    return f"{n / 2**30:.2f} GB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.1f} MB"


def gb_at_least(nbytes: int, digits: int = 4) -> float:
    """nbytes in GB, rounded up to `digits` significant digits (so the figure, given back, is enough)."""
    gb = nbytes / 2**30
    if gb <= 0:
        return 0.0
    scale = 10 ** (digits - 1 - math.floor(math.log10(gb)))
    return math.ceil(gb * scale) / scale


@dataclass(frozen=True)
class Fit:
    """How a model is placed in `free_bytes`: `budget_bytes` (the expert cache) None when everything
    is resident. `source` says where `free_bytes` came from; `held` is what the process held already
    (counted in an overall budget the user gave, `memory_gb`)."""

    free_bytes: int
    dense_bytes: int
    expert_bytes: int
    kv_bytes: int
    margin_bytes: int
    budget_bytes: int | None
    source: str = "the device's free memory"
    held: int = 0
    workspace_bytes: int = 0
    floor: int = MARGIN_BYTES
    kv_tokens: int = KV_RESERVE_TOKENS  # positions `kv_bytes` holds

    @property
    def streamed(self) -> bool:
        return self.budget_bytes is not None

    def describe(self) -> str:
        """The decision, in one line."""
        need = self.dense_bytes + self.expert_bytes
        parts = (
            f"{_gb(self.dense_bytes)} for the dense weights, {_gb(self.kv_bytes)} for a {self.kv_tokens}-"
            f"token KV cache and {_gb(self.margin_bytes)} of working memory"
        )
        if not self.streamed:
            return (
                f"the model's {_gb(need)} fits the {_gb(self.free_bytes)} it may use ({self.source}); "
                f"every expert resident (besides {parts})."
            )
        return (
            f"the model needs {_gb(need)} but may use {_gb(self.free_bytes)} ({self.source}); streaming "
            f"experts with expert_cache_gb={self.budget_bytes / 2**30:.4g} (keeping {parts})."
        )

    def minimum_free(self, cache_bytes: int) -> int:
        """The least `free_bytes` with which this rule leaves an expert cache of `cache_bytes`."""
        rest = self.dense_bytes + self.kv_bytes + cache_bytes
        return max(rest + self.floor, math.ceil((rest + self.workspace_bytes) / (1 - MARGIN_FRACTION)) + 1)

    def too_small(self, cache_bytes: int) -> str:
        """One sentence: the model cannot run in this memory, and the least it needs (with an
        expert cache of `cache_bytes`, the smallest that works)."""
        least = self.minimum_free(cache_bytes)
        ask = (
            f"; give memory_gb={gb_at_least(self.held + least, 3)} or more"
            if self.source.startswith("memory_gb")
            else ""
        )
        return (
            f"the model cannot run in the {_gb(max(self.free_bytes, 0))} it may use ({self.source}): it "
            f"needs at least {_gb(least)} besides what the process holds ({_gb(self.dense_bytes)} for "
            f"the dense weights, {_gb(self.kv_bytes)} for a {self.kv_tokens}-token KV cache, "
            f"{_gb(cache_bytes)} for one token's experts of a layer and "
            f"{_gb(least - self.dense_bytes - self.kv_bytes - cache_bytes)} of working memory){ask}."
        )


def auto_budget(
    free_bytes: int,
    dense_bytes: int,
    expert_bytes: int,
    kv_bytes: int,
    workspace_bytes: int = 0,
    floor: int = MARGIN_BYTES,
    source: str = "the device's free memory",
    held: int = 0,
    kv_tokens: int = KV_RESERVE_TOKENS,
) -> Fit:
    """Everything resident when dense + experts + KV cache + margin fit `free_bytes`; else an expert
    cache of what is left after the dense weights, the KV cache and the margin (which may be too
    small for one token's experts: the cache then says what the minimum is). The margin:
    `workspace_bytes` + MARGIN_FRACTION of `free_bytes`, at least `floor`."""
    margin = max(floor, workspace_bytes + int(MARGIN_FRACTION * max(free_bytes, 0)))
    room = free_bytes - dense_bytes - kv_bytes - margin
    budget = None if expert_bytes <= room else max(room, 0)
    return Fit(
        free_bytes,
        dense_bytes,
        expert_bytes,
        kv_bytes,
        margin,
        budget,
        source,
        held,
        workspace_bytes,
        floor,
        kv_tokens,
    )
