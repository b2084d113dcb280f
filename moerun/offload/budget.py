"""Choosing an expert cache budget when none is given and the model does not fit the device.

`auto_budget` is the rule, a pure function of byte counts so it is tested with plain numbers;
`free_device_memory` asks the device (None where the device reports nothing, as a CPU does: there
the model is placed whole, as without streaming).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_RESERVE_TOKENS = 4096  # context the KV cache is sized for when the budget is chosen
MARGIN_BYTES = 2**30  # kept free besides: CUDA context, allocator slack, activations
MARGIN_FRACTION = 0.05  # ... or this share of the free memory, if more


@dataclass(frozen=True)
class Fit:
    """How a model was placed: `budget_bytes` None when everything is resident."""

    free_bytes: int
    dense_bytes: int
    expert_bytes: int
    kv_bytes: int
    margin_bytes: int
    budget_bytes: int | None

    def describe(self) -> str:
        gb = lambda n: f"{n / 2**30:.2f} GB"  # noqa: E731
        need = self.dense_bytes + self.expert_bytes
        return (
            f"the model needs {gb(need)} but the device has {gb(self.free_bytes)} free; streaming "
            f"experts with expert_cache_gb={self.budget_bytes / 2**30:.4g} (keeping {gb(self.dense_bytes)} "
            f"for the dense weights, {gb(self.kv_bytes)} for a {KV_RESERVE_TOKENS}-token KV cache and "
            f"{gb(self.margin_bytes)} spare)."
        )


def auto_budget(free_bytes: int, dense_bytes: int, expert_bytes: int, kv_bytes: int) -> Fit:
    """Everything resident when dense + experts + KV cache + margin fit `free_bytes`; else an expert
    cache of what is left after the dense weights, the KV cache and the margin (which may be too
    small for one token's experts: the cache then says what the minimum is)."""
    margin = max(MARGIN_BYTES, int(MARGIN_FRACTION * free_bytes))
    room = free_bytes - dense_bytes - kv_bytes - margin
    budget = None if expert_bytes <= room else max(room, 0)
    return Fit(free_bytes, dense_bytes, expert_bytes, kv_bytes, margin, budget)


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on `device` (CUDA), None for devices that do not say (CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
