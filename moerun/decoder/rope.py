"""Rotary position embedding: inverse frequencies for default, linear and YaRN scaling (as
transformers computes them), applied to the two halves of each head.

Partial rotary (GLM-4's `partial_rotary_factor`): transformers rotates the first R dims of each head
as two halves of R/2 and passes the other D - R through. Here each head's dims are put in another
order once, at load (`head_order`, applied by the attention to its q and k weights): the rotated
halves, each followed by half the passed dims, so the pairs (j, j + R/2) sit at (j, j + D/2), and
the passed dims get frequency 0 (cos 1, sin 0). Every kernel that rotates whole-head halves (torch's
here, the native decode's) then computes transformers' partial rotation, bit for bit; q · k is the
same in any order of a head's dims, and values are not reordered."""

from __future__ import annotations

import math

import torch

from moerun.decoder.config import ConfigError, RopeSpec


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


def rotary_dims(head_dim: int, partial_rotary_factor: float) -> int:
    """How many leading dims of each head rotate: int(head_dim * partial_rotary_factor) as transformers
    computes it (give or take float noise: a factor of 40 / 96 rotates 40), an even number of at least 2."""
    dims = int(head_dim * partial_rotary_factor + 1e-6)
    if not 2 <= dims <= head_dim or dims % 2:
        raise ConfigError(
            f"partial_rotary_factor={partial_rotary_factor:g} of a head of {head_dim} rotates {dims} "
            "dims; RoPE needs an even number of at least 2, at most the head."
        )
    return dims


class Rotary:
    """cos/sin for positions, and their application to [B, heads, T, head_dim] tensors."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str | None = None):
        self.head_dim, self.rotary_dim = head_dim, spec.rotary_dims or head_dim
        inv_freq, self.scale = inverse_frequencies(spec, self.rotary_dim)
        passed = (head_dim - self.rotary_dim) // 2
        if passed:  # partial: frequency 0 and no scale for the passed dims (see the module docstring)
            scale = torch.full((self.rotary_dim // 2,), self.scale)
            self.scale = torch.cat([scale, torch.ones(passed)]).to(device)  # [head_dim / 2]
            inv_freq = torch.cat([inv_freq, torch.zeros(passed)])
        self.inv_freq = inv_freq.to(device)

    def head_order(self) -> torch.Tensor | None:
        """Partial rotary: the order of a head's dims the rotation expects, as indices into
        transformers' order (the first rotated half, the first half of the passed dims, the second
        rotated half, the second half of the passed dims); None when the whole head rotates."""
        R, D = self.rotary_dim, self.head_dim
        if R == D:
            return None
        half, passed = R // 2, (D - R) // 2
        return torch.cat(
            [
                torch.arange(0, half),
                torch.arange(R, R + passed),
                torch.arange(half, R),
                torch.arange(R + passed, D),
            ]
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim / 2] in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, head_dim]: the first half and the second half of each head rotate as pairs."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
