"""Rotary position embedding: inverse frequencies for default, linear, YaRN and LongRoPE scaling
(as transformers computes them), applied to the two halves of each head.

LongRoPE has two sets of frequencies and cos/sin scales, short and long; as in transformers, one
forward pass uses one set for all its positions: the long one where the sequence it reaches
(its last position + 1) is longer than original_max_position_embeddings. Keys already in the cache
keep the rotation they got, so a generation crossing the boundary rotates its earlier positions with
the short set and the later ones with the long set, as transformers' generate does. transformers'
PhiMoE recomputes its frequencies from short_factor in every forward, whatever the length, and
switches only its scale (short_mscale / long_mscale): `RopeSpec.long_frequencies` False mirrors it.

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


def _longrope(spec: RopeSpec, head_dim: int, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE's short (`long` False) or long frequencies and their cos/sin scale."""
    factors = spec.long_factor if long and spec.long_frequencies else spec.short_factor
    if len(factors) != head_dim // 2:
        which = "long_factor" if factors is spec.long_factor else "short_factor"
        raise ConfigError(
            f"rope_parameters.{which} has {len(factors)} entries; a rotary head of {head_dim} dims "
            f"needs {head_dim // 2}, one per frequency."
        )
    mscale = spec.long_mscale if long else spec.short_mscale
    if mscale is not None:
        scale = mscale
    elif spec.attention_factor is not None:
        scale = spec.attention_factor
    elif spec.factor <= 1.0:
        scale = 1.0
    else:
        scale = math.sqrt(1 + math.log(spec.factor) / math.log(spec.original_max_positions))
    # transformers: 1 / (ext_factors * base ** (arange(0, dim, 2) / dim)), int64 arange made float
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta**shape), float(scale)


def inverse_frequencies(spec: RopeSpec, head_dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim / 2], scale applied to cos and sin). `long`: LongRoPE's set for
    sequences longer than original_max_positions (the other kinds have one set)."""
    if spec.kind == "longrope":
        return _longrope(spec, head_dim, long)
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
        self.inv_freq, self.scale = self._set(spec, device, long=False)
        # LongRoPE: the set for sequences longer than `boundary` ([2, head_dim / 2] each, short first)
        self.boundary = spec.original_max_positions if spec.kind == "longrope" else None
        if self.boundary is not None:
            long_freq, long_scale = self._set(spec, device, long=True)
            self.inv_freqs = torch.stack([self.inv_freq, long_freq])
            full = torch.ones(head_dim // 2, device=device)
            self.scales = torch.stack([full * self.scale, full * long_scale])

    def _set(self, spec: RopeSpec, device, long: bool):
        """(inv_freq [head_dim / 2], scale: a float, or [head_dim / 2] for partial rotary)."""
        inv_freq, scale = inverse_frequencies(spec, self.rotary_dim, long)
        passed = (self.head_dim - self.rotary_dim) // 2
        if passed:  # partial: frequency 0 and no scale for the passed dims (see the module docstring)
            scale = torch.cat([torch.full((self.rotary_dim // 2,), scale), torch.ones(passed)]).to(device)
            inv_freq = torch.cat([inv_freq, torch.zeros(passed)])
        return inv_freq.to(device), scale

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

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim / 2] in `dtype`. LongRoPE: `lengths` [T] is, for
        each position, the length of the sequence its forward pass reaches (several sequences in one
        pass); None: positions.max() + 1 for all of them, one sequence's pass."""
        if self.boundary is None:
            inv_freq, scale = self.inv_freq[None, :], self.scale
        else:
            if lengths is None:
                lengths = positions.max() + 1
            long = (torch.as_tensor(lengths, device=positions.device) > self.boundary).long()
            long = long.expand(positions.shape)  # [T]: 0 short, 1 long (no host sync)
            inv_freq, scale = self.inv_freqs[long], self.scales[long]  # [T, head_dim / 2]
        freqs = positions.float()[:, None] * inv_freq
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, head_dim]: the first half and the second half of each head rotate as pairs."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
