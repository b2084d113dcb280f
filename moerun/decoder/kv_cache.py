"""The KV cache: every layer's keys and values, preallocated for a sequence's whole length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.decoder.config import AttentionSpec, MLASpec


@dataclass
class KVCache:
    """Keys and values of every layer, [B, kv_heads, max_len, head_dim] each (MLA: the latent
    [B, 1, max_len, kv_lora_rank] and the rotary key [B, 1, max_len, qk_rope_head_dim]), filled up
    to `length` (positions past it are uninitialised and never read)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        spec: AttentionSpec | MLASpec,
        max_len: int,
        dtype: torch.dtype,
        device,
    ) -> KVCache:
        (kh, kd), (vh, vd) = spec.cache_dims()
        keys = [torch.empty((batch, kh, max_len, kd), dtype=dtype, device=device) for _ in range(num_layers)]
        values = [
            torch.empty((batch, vh, max_len, vd), dtype=dtype, device=device) for _ in range(num_layers)
        ]
        return cls(keys, values)

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes over every layer, keys and values."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.keys + self.values)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]
