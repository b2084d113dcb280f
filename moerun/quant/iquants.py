"""The integer parts of the i-quants' and the ternary formats' 256-element super-blocks, in torch.

Every format here comes out in one form, `SuperBlocks(d, scales, q)`: element i of sub-block
s = i // (256 / S) is worth (d * scales[s]) * q[i]. `d` is the block's fp16 scale times the format's
power-of-two factor (1/8 for IQ2_* and IQ1_*, whose grids and offsets are in eighths; 1/4 for
IQ3_XXS), which is exact in float32; every product in the formula is exact as well (at most 24
significant bits), so computing it in any order gives the gguf package's float32 values bit for bit.
Block layouts are ggml's (ggml-common.h, `dequantize_row_iq*`); the grids and sign table are
`moerun.quant.iq_tables`. Each function takes blocks uint8 [..., block_bytes] (any leading dims).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moerun.quant import iq_tables
from moerun.quant.bitfields import f16_to_f32, fp16
from moerun.quant.iq_tables import Grid

F32 = torch.float32


class SuperBlocks(NamedTuple):
    d: torch.Tensor  # float32 [...]
    scales: torch.Tensor  # int16 [..., S]: one per sub-block of 256 / S elements
    q: torch.Tensor  # int8 [..., 256]


def _fp16_bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """fp16 bit patterns (int64 [...] in [0, 65535]) -> their exact float32 values, NaN payloads kept."""
    return f16_to_f32((bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16))


def _le(data: torch.Tensor, size: int) -> torch.Tensor:
    """Little-endian unsigned fields of `size` bytes: uint8 [..., k * size] -> int64 [..., k]."""
    fields = data.unflatten(-1, (-1, size)).to(torch.int64)
    return sum(fields[..., i] << (8 * i) for i in range(size))


def _bits(x: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """Fields of `width` bits, lowest first: int [..., m] -> [..., m, count]."""
    shifts = torch.arange(0, count * width, width, device=x.device)
    return (x[..., None] >> shifts) & ((1 << width) - 1)


@functools.cache
def _grid_on(grid: Grid, device: torch.device) -> torch.Tensor:
    return grid.table().to(device)


@functools.cache
def _signs_on(device: torch.device) -> torch.Tensor:
    return iq_tables.sign_table().to(device)


def _lookup(grid: Grid, index: torch.Tensor) -> torch.Tensor:
    """Grid entries int8 [..., m, per_entry] of indices [..., m]."""
    return _grid_on(grid, index.device)[index.long()]


def _signed(values: torch.Tensor, negate: torch.Tensor) -> torch.Tensor:
    """values [..., 8] negated where the bit in negate [..., 8] is set, as int8."""
    return torch.where(negate.bool(), -values, values).to(torch.int8)


def _fp16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return fp16(blocks[..., at : at + 2])


def _odd(s: torch.Tensor) -> torch.Tensor:
    """ggml's (0.5 + s) scale doubled, and 2s + 1 for the others: odd integers int16."""
    return (2 * s + 1).to(torch.int16)


def unpack_iq2_xxs(blocks: torch.Tensor) -> SuperBlocks:
    """IQ2_XXS [..., 66]: d fp16, then per 32-element sub-block two uint32: the first's 4 bytes index
    `iq2xxs_grid` (8 values each), the second holds 4 seven-bit sign indices (`ksigns_iq2xs`) and,
    in its top 4 bits, s. Scale d * (s + 1/2) / 4 = (d / 8) * (2s + 1)."""
    words = _le(blocks[..., 2:66], 4).unflatten(-1, (8, 2))  # [..., 8, 2]
    grid = _lookup(iq_tables.IQ2XXS_GRID, _bits(words[..., 0], 4, 8))  # [..., 8, 4, 8]
    negate = _bits(_signs_on(blocks.device)[_bits(words[..., 1], 4, 7)].to(torch.int64), 8)
    q = _signed(grid.to(torch.int16), negate).flatten(-3)
    return SuperBlocks(_fp16_field(blocks, 0) * 0.125, _odd(words[..., 1] >> 28), q)


def unpack_iq2_xs(blocks: torch.Tensor) -> SuperBlocks:
    """IQ2_XS [..., 74]: d fp16, 32 uint16 (one per group of 8: a 9-bit `iq2xs_grid` index and a
    7-bit sign index), 8 bytes of 4-bit scales s (low nibble: the first 16 of a 32, high: the second).
    Scale per 16 elements (d / 8) * (2s + 1)."""
    words = _le(blocks[..., 2:66], 2)  # [..., 32]
    grid = _lookup(iq_tables.IQ2XS_GRID, words & 511)  # [..., 32, 8]
    negate = _bits(_signs_on(blocks.device)[words >> 9].to(torch.int64), 8)
    scales = _bits(blocks[..., 66:74].to(torch.int64), 2, 4).flatten(-2)  # [..., 16]
    q = _signed(grid.to(torch.int16), negate).flatten(-2)
    return SuperBlocks(_fp16_field(blocks, 0) * 0.125, _odd(scales), q)


def unpack_iq2_s(blocks: torch.Tensor) -> SuperBlocks:
    """IQ2_S [..., 82]: d fp16, 32 low bytes of 10-bit `iq2s_grid` indices (one per group of 8), 32
    sign bytes (bit j: value j of the group negated), 8 bytes of the indices' top 2 bits (four groups
    per byte), 8 bytes of 4-bit scales as IQ2_XS's."""
    qh = _bits(blocks[..., 66:74].to(torch.int64), 4, 2).flatten(-2)  # [..., 32]
    index = blocks[..., 2:34].to(torch.int64) | qh << 8
    grid = _lookup(iq_tables.IQ2S_GRID, index)  # [..., 32, 8]
    negate = _bits(blocks[..., 34:66].to(torch.int64), 8)
    scales = _bits(blocks[..., 74:82].to(torch.int64), 2, 4).flatten(-2)
    q = _signed(grid.to(torch.int16), negate).flatten(-2)
    return SuperBlocks(_fp16_field(blocks, 0) * 0.125, _odd(scales), q)


def unpack_iq3_xxs(blocks: torch.Tensor) -> SuperBlocks:
    """IQ3_XXS [..., 98]: d fp16, 64 bytes indexing `iq3xxs_grid` (4 values each), then per 32-element
    sub-block one uint32 of 4 seven-bit sign indices (one per 8 values) and, in its top 4 bits, s.
    Scale d * (s + 1/2) / 2 = (d / 4) * (2s + 1)."""
    grid = _lookup(iq_tables.IQ3XXS_GRID, blocks[..., 2:66])  # [..., 64, 4]
    grid = grid.unflatten(-2, (8, 4, 2)).flatten(-2)  # [..., 8, 4, 8]
    words = _le(blocks[..., 66:98], 4)  # [..., 8]
    negate = _bits(_signs_on(blocks.device)[_bits(words, 4, 7)].to(torch.int64), 8)
    q = _signed(grid.to(torch.int16), negate).flatten(-3)
    return SuperBlocks(_fp16_field(blocks, 0) * 0.25, _odd(words >> 28), q)


def unpack_iq3_s(blocks: torch.Tensor) -> SuperBlocks:
    """IQ3_S [..., 110]: d fp16, 64 low bytes of 9-bit `iq3s_grid` indices (4 values each), 8 bytes of
    their top bits, 32 bytes of sign bits (one per value), 4 bytes of 4-bit scales s (one per 32).
    Scale d * (2s + 1)."""
    index = blocks[..., 2:66].to(torch.int64) | _bits(blocks[..., 66:74].to(torch.int64), 8).flatten(-2) << 8
    grid = _lookup(iq_tables.IQ3S_GRID, index).flatten(-2)  # [..., 256]
    negate = _bits(blocks[..., 74:106].to(torch.int64), 8).flatten(-2)
    scales = _bits(blocks[..., 106:110].to(torch.int64), 2, 4).flatten(-2)  # [..., 8]
    q = _signed(grid.to(torch.int16), negate)
    return SuperBlocks(_fp16_field(blocks, 0), _odd(scales), q)


def _iq1_values(grid: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """8 * (grid value + delta), delta = +1/8 or -1/8 where `minus`: grid int8 [..., 8] in {-1, 0, 1},
    minus [...] -> int8 [..., 8] in [-9, 9]."""
    return (8 * grid.to(torch.int16) + 1 - 2 * minus[..., None].to(torch.int16)).to(torch.int8)


def unpack_iq1_s(blocks: torch.Tensor) -> SuperBlocks:
    """IQ1_S [..., 50]: d fp16, 32 low bytes of 11-bit `iq1s_grid` indices (8 values each), then per
    32-element sub-block one uint16: the indices' top 3 bits (3 per group of 8), a 3-bit s at bit 12,
    and at bit 15 the sign of delta. Value d * (2s + 1) * (grid + delta), delta = ±1/8: as
    (d / 8) * (2s + 1) * q, q = 8 * grid ± 1."""
    qh = _le(blocks[..., 34:50], 2)  # [..., 8]
    index = blocks[..., 2:34].to(torch.int64).unflatten(-1, (8, 4)) | _bits(qh, 4, 3) << 8  # [..., 8, 4]
    values = _iq1_values(_lookup(iq_tables.IQ1S_GRID, index), (qh >> 15)[..., None].expand(index.shape))
    return SuperBlocks(_fp16_field(blocks, 0) * 0.125, _odd((qh >> 12) & 7), values.flatten(-3))


def unpack_iq1_m(blocks: torch.Tensor) -> SuperBlocks:
    """IQ1_M [..., 56]: 32 low bytes of 11-bit `iq1s_grid` indices, 16 bytes of nibbles (one per group
    of 8: 3 top index bits, and the sign of delta at bit 3), 4 uint16 holding 3-bit scales s (four
    each, one per 16 elements) in their low 12 bits and the fp16 d in their top nibbles (the first
    word's lowest). Value as IQ1_S's, per 16 elements."""
    words = _le(blocks[..., 48:56], 2)  # [..., 4]
    d_bits = sum((words[..., k] >> 12) << (4 * k) for k in range(4))
    nibbles = _bits(blocks[..., 32:48].to(torch.int64), 2, 4).flatten(-2)  # [..., 32]
    index = blocks[..., 0:32].to(torch.int64) | (nibbles & 7) << 8
    values = _iq1_values(_lookup(iq_tables.IQ1S_GRID, index), nibbles >> 3)
    scales = _bits(words & 0xFFF, 4, 3).flatten(-2)  # [..., 16]
    return SuperBlocks(_fp16_bits_to_f32(d_bits) * 0.125, _odd(scales), values.flatten(-2))


@functools.cache
def _iq4nl_on(device: torch.device) -> torch.Tensor:
    return torch.tensor(iq_tables.IQ4NL_VALUES, dtype=torch.int8, device=device)


def iq4nl_values(codes: torch.Tensor) -> torch.Tensor:
    """IQ4_NL's non-linear values int8 of 4-bit codes (any integer dtype)."""
    return _iq4nl_on(codes.device)[codes.long()]


def unpack_iq4_xs(blocks: torch.Tensor) -> SuperBlocks:
    """IQ4_XS [..., 136]: d fp16, uint16 of the scales' top 2 bits, 4 bytes of their low nibbles, then
    per 32-element sub-block 16 bytes of codes (low nibbles: elements 0-15, high: 16-31) into
    `IQ4NL_VALUES`. Scale d * (ls - 32), ls the 6-bit field."""
    high = _bits(_le(blocks[..., 2:4], 2).squeeze(-1), 8, 2)  # [..., 8]
    low = _bits(blocks[..., 4:8].to(torch.int64), 2, 4).flatten(-2)  # [..., 8]
    codes = _bits(blocks[..., 8:136].unflatten(-1, (8, 16)), 2, 4).transpose(-1, -2).flatten(-3)
    scales = ((low | high << 4) - 32).to(torch.int16)
    return SuperBlocks(_fp16_field(blocks, 0), scales, iq4nl_values(codes))


def _ones(d: torch.Tensor) -> torch.Tensor:
    return torch.ones((*d.shape, 1), dtype=torch.int16, device=d.device)


def unpack_tq2_0(blocks: torch.Tensor) -> SuperBlocks:
    """TQ2_0 [..., 66]: 64 bytes of 2-bit codes c (each 32 bytes hold 4 runs of 32 at shifts 0, 2, 4,
    6), then d fp16. Value d * (c - 1); one sub-block of scale 1."""
    runs = _bits(blocks[..., 0:64].unflatten(-1, (2, 32)).to(torch.int64), 4, 2)  # [..., 2, 32, 4]
    codes = runs.transpose(-1, -2).flatten(-3)
    d = _fp16_field(blocks, 64)
    return SuperBlocks(d, _ones(d), (codes - 1).to(torch.int8))


def unpack_tq1_0(blocks: torch.Tensor) -> SuperBlocks:
    """TQ1_0 [..., 54]: 48 bytes of base-3 codes (5 per byte), 4 bytes of 4 more each, then d fp16.
    A byte b holds fixed-point digits: digit k is ((b * 3^k mod 256) * 3) >> 8. Bytes 0-31 give
    elements 32k + j, bytes 32-47 give 160 + 16k + j, bytes 48-51 give 240 + 4k + j. Value d * (c - 1)."""

    def digits(part: torch.Tensor, count: int) -> torch.Tensor:  # [..., m] -> [..., count * m]
        powers = torch.tensor([3**k for k in range(count)], dtype=torch.int64, device=part.device)
        shifted = (part.to(torch.int64)[..., None, :] * powers[:, None]) & 0xFF
        return ((shifted * 3) >> 8).flatten(-2)

    parts = (digits(blocks[..., 0:32], 5), digits(blocks[..., 32:48], 5), digits(blocks[..., 48:52], 4))
    codes = torch.cat(parts, -1)
    d = _fp16_field(blocks, 52)
    return SuperBlocks(d, _ones(d), (codes - 1).to(torch.int8))


UNPACKERS = {
    "iq2_xxs": unpack_iq2_xxs,
    "iq2_xs": unpack_iq2_xs,
    "iq2_s": unpack_iq2_s,
    "iq3_xxs": unpack_iq3_xxs,
    "iq3_s": unpack_iq3_s,
    "iq1_s": unpack_iq1_s,
    "iq1_m": unpack_iq1_m,
    "iq4_xs": unpack_iq4_xs,
    "tq1_0": unpack_tq1_0,
    "tq2_0": unpack_tq2_0,
}


def dequant_super_blocks(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Blocks uint8 [N, block_bytes] of format `name` -> float32 [N, 256]."""
    d, scales, q = UNPACKERS[name](blocks)
    step = (d[:, None] * scales.to(F32))[..., None]  # [N, S, 1]
    return (step * q.to(F32).unflatten(-1, (scales.shape[-1], -1))).flatten(-2)
