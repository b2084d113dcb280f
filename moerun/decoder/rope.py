"""Rotary position embedding: inverse frequencies for default, linear and YaRN scaling (as
transformers computes them), applied to the two halves of each head."""

from __future__ import annotations

import math

import torch

from moerun.decoder.config import RopeSpec


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, head_dim: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between."""
    factor, base = spec.factor, spec.theta
    if spec.attention_factor is not None:
        attention_factor = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (
            head_dim
            * math.log(spec.original_max_positions / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention_factor)


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim / 2], scale applied to cos and sin)."""
    pos_freqs = spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if spec.kind == "default":
        return 1.0 / pos_freqs, 1.0
    if spec.kind == "linear":
        return 1.0 / pos_freqs / spec.factor, 1.0
    if spec.kind == "yarn":
        return _yarn(spec, head_dim, pos_freqs)
    raise AssertionError(spec.kind)  # RopeSpec refuses other kinds


class Rotary:
    """cos/sin for positions, and their application to [B, heads, T, head_dim] tensors."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str | None = None):
        inv_freq, self.scale = inverse_frequencies(spec, head_dim)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim / 2] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, head_dim]: the first half and the second half of each head rotate as pairs."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
