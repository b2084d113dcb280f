"""The KV cache: every layer's keys and values, preallocated for a sequence's whole length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.decoder.config import AttentionSpec, MLASpec


@dataclass
class KVCache:
    """Keys and values of every layer, [B, kv_heads, max_len, head_dim] each (MLA: the latent
    [B, 1, max_len, kv_lora_rank] and the rotary key [B, 1, max_len, qk_rope_head_dim]), filled up
    to `length` (positions past it are uninitialised and never read).

    LongRoPE (moerun.decoder.rope): `tokens` [B, max_len] keeps the ids at the cached positions and
    `rope_long` which of the two sets rotated them, so that a pass crossing the boundary can compute
    those positions again (Decoder.new_cache sets `tokens` for such models; None otherwise);
    `rope_reach`: a length the sequence is known to reach (a prompt prefilled in chunks), whose set
    every pass uses if it reaches less."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0
    tokens: torch.Tensor | None = None
    rope_long: bool = False
    rope_reach: int = 0

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

    def copy_prefix(self, old: KVCache, n: int) -> None:
        """Hold `old`'s first n positions (and its LongRoPE state), as if computed here."""
        for new_layer, old_layer in zip(self.keys + self.values, old.keys + old.values, strict=True):
            new_layer[:, :, :n].copy_(old_layer[:, :, :n])
        if self.tokens is not None and old.tokens is not None:
            self.tokens[:, :n].copy_(old.tokens[:, :n])
            self.rope_long = old.rope_long
        self.length = n
