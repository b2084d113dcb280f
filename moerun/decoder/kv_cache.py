"""The KV cache: every layer's keys and values, preallocated for a sequence's whole length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.decoder.config import AttentionSpec


@dataclass
class KVCache:
    """Keys and values of every layer, [B, kv_heads, max_len, head_dim] each, filled up to `length`
    (positions past it are uninitialised and never read)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(
        cls, num_layers: int, batch: int, spec: AttentionSpec, max_len: int, dtype: torch.dtype, device
    ) -> KVCache:
        shape = (batch, spec.kv_heads, max_len, spec.head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]
