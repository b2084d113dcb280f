"""The i-quants' and the ternary formats' 256-element super-blocks read inside kernels, element by
element: the Triton side of moerun.quant.iquants, whose layouts (ggml-common.h) its docstrings give.

Each reader takes `row`, uint8 pointers at the first byte of each element's row ([1, BN] or any shape
that broadcasts with k), `k`, the elements' indices in their rows (int32, [BK, 1]), the format's
lookup table `table` (`lookup_table`, an int8 pointer) and `mask`, and returns the values fp32
(d * scale) * q, d and scale as moerun.quant.iquants.SuperBlocks holds them: every product is exact,
so the values are bit for bit those of moerun.quant.dequant.dequantize.

The grid lookups are gathers from `table`, which is made once per device from moerun.quant.iq_tables
(the one definition of the grids, the sign table and IQ4_NL's values): for the grid formats the sign
table's 128 bytes and then the grid's entries, values in order; for IQ4_NL and IQ4_XS the 16 values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moerun.kernels.block_fields import byte, fp16, fp16_bits
from moerun.quant import iq_tables

GRIDS = {
    "iq2_xxs": iq_tables.IQ2XXS_GRID,
    "iq2_xs": iq_tables.IQ2XS_GRID,
    "iq2_s": iq_tables.IQ2S_GRID,
    "iq3_xxs": iq_tables.IQ3XXS_GRID,
    "iq3_s": iq_tables.IQ3S_GRID,
    "iq1_s": iq_tables.IQ1S_GRID,
    "iq1_m": iq_tables.IQ1S_GRID,
}
NONLINEAR = ("iq4_nl", "iq4_xs")  # formats whose 4-bit codes index IQ4NL_VALUES
SIGNS = 128  # entries of the sign table, at the start of every grid format's table
_GRID_AT = tl.constexpr(SIGNS)


@functools.cache
def lookup_table(name: str, device: torch.device) -> torch.Tensor:
    """What the kernels read format `name`'s lookups from, int8 [...] on `device` (made once): the
    sign table's bytes then the grid for the grid formats, IQ4NL_VALUES for iq4_nl and iq4_xs, and one
    zero byte (a pointer the kernels may be given but never read) for every other format."""
    if name in GRIDS:
        signs = iq_tables.sign_table().view(torch.int8)
        table = torch.cat([signs, GRIDS[name].table().flatten()])
    elif name in NONLINEAR:
        table = torch.tensor(iq_tables.IQ4NL_VALUES, dtype=torch.int8)
    else:
        table = torch.zeros(1, dtype=torch.int8)
    return table.to(device)


# ---------------------------------------------------------------- shared pieces


@triton.jit
def _grid(table, index, j, PER_ENTRY: tl.constexpr, mask):
    """Value j of grid entry `index` (int32), as int32."""
    return tl.load(table + _GRID_AT + index * PER_ENTRY + j, mask=mask, other=0).to(tl.int32)


@triton.jit
def _sign_bit(table, sign_index, j, mask):
    """Bit j of the sign table's byte `sign_index`: 1 where value j of its group of 8 is negated."""
    signs = tl.load(table + sign_index, mask=mask, other=0).to(tl.int32) & 0xFF
    return (signs >> j) & 1


@triton.jit
def _signed(value, negate):
    return tl.where(negate != 0, -value, value)


@triton.jit
def _le32(ptr, mask):
    """The little-endian uint32 at uint8 pointers `ptr`, as int32 bits (the top bit as the sign)."""
    low = byte(ptr, mask) | (byte(ptr + 1, mask) << 8)
    return low | (byte(ptr + 2, mask) << 16) | (byte(ptr + 3, mask) << 24)


@triton.jit
def _value(d, scale, q):
    """(d * scale) * q in fp32, as moerun.quant.iquants.dequant_super_blocks orders it (all exact)."""
    return (d * scale.to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _odd(s):
    """ggml's (0.5 + s) scale doubled: 2s + 1."""
    return 2 * s + 1


@triton.jit
def _nibble(ptr, at, mask):
    """4-bit field `at` of the bytes from `ptr` on: the low nibble of byte at // 2 for even `at`."""
    return (byte(ptr + at // 2, mask) >> ((at % 2) * 4)) & 0x0F


# ---------------------------------------------------------------- the formats


@triton.jit
def iq2_xxs(row, k, table, mask):
    blk = row + (k // 256) * 66
    i = k % 256
    sub = blk + 2 + (i // 32) * 8  # two uint32: 4 grid indices; 4 sign indices and the scale
    g = (i % 32) // 8
    words = _le32(sub + 4, mask)
    value = _grid(table, byte(sub + g, mask), i % 8, 8, mask)
    q = _signed(value, _sign_bit(table, (words >> (7 * g)) & 127, i % 8, mask))
    return _value(fp16(blk, mask) * 0.125, _odd((words >> 28) & 15), q)


@triton.jit
def iq2_xs(row, k, table, mask):
    blk = row + (k // 256) * 74
    i = k % 256
    word = byte(blk + 2 + 2 * (i // 8), mask) | (byte(blk + 3 + 2 * (i // 8), mask) << 8)
    q = _signed(_grid(table, word & 511, i % 8, 8, mask), _sign_bit(table, word >> 9, i % 8, mask))
    return _value(fp16(blk, mask) * 0.125, _odd(_nibble(blk + 66, i // 16, mask)), q)


@triton.jit
def iq2_s(row, k, table, mask):
    blk = row + (k // 256) * 82
    i = k % 256
    g = i // 8
    index = byte(blk + 2 + g, mask) | (((byte(blk + 66 + g // 4, mask) >> ((g % 4) * 2)) & 3) << 8)
    q = _signed(_grid(table, index, i % 8, 8, mask), (byte(blk + 34 + g, mask) >> (i % 8)) & 1)
    return _value(fp16(blk, mask) * 0.125, _odd(_nibble(blk + 74, i // 16, mask)), q)


@triton.jit
def iq3_xxs(row, k, table, mask):
    blk = row + (k // 256) * 98
    i = k % 256
    words = _le32(blk + 66 + 4 * (i // 32), mask)  # 4 sign indices and the scale
    value = _grid(table, byte(blk + 2 + i // 4, mask), i % 4, 4, mask)
    q = _signed(value, _sign_bit(table, (words >> (7 * ((i % 32) // 8))) & 127, i % 8, mask))
    return _value(fp16(blk, mask) * 0.25, _odd((words >> 28) & 15), q)


@triton.jit
def iq3_s(row, k, table, mask):
    blk = row + (k // 256) * 110
    i = k % 256
    e = i // 4  # grid entry
    index = byte(blk + 2 + e, mask) | (((byte(blk + 66 + e // 8, mask) >> (e % 8)) & 1) << 8)
    q = _signed(_grid(table, index, i % 4, 4, mask), (byte(blk + 74 + i // 8, mask) >> (i % 8)) & 1)
    return _value(fp16(blk, mask), _odd(_nibble(blk + 106, i // 32, mask)), q)


@triton.jit
def _iq1_q(table, index, j, minus, mask):
    """IQ1's 8 * (grid value + delta), delta -1/8 where `minus` else +1/8: int32 in [-9, 9]."""
    return 8 * _grid(table, index, j, 8, mask) + 1 - 2 * minus


@triton.jit
def iq1_s(row, k, table, mask):
    blk = row + (k // 256) * 50
    i = k % 256
    g = i // 8
    qh = byte(blk + 34 + 2 * (i // 32), mask) | (byte(blk + 35 + 2 * (i // 32), mask) << 8)
    index = byte(blk + 2 + g, mask) | (((qh >> (3 * (g % 4))) & 7) << 8)
    q = _iq1_q(table, index, i % 8, qh >> 15, mask)
    return _value(fp16(blk, mask) * 0.125, _odd((qh >> 12) & 7), q)


@triton.jit
def iq1_m(row, k, table, mask):
    blk = row + (k // 256) * 56
    i = k % 256
    g = i // 8
    high = _nibble(blk + 32, g, mask)  # 3 top index bits, and delta's sign at bit 3
    q = _iq1_q(table, byte(blk + g, mask) | ((high & 7) << 8), i % 8, high >> 3, mask)
    w = blk + 48 + 2 * (i // 64)  # the uint16 holding this element's scale (four 3-bit fields)
    scale = ((byte(w, mask) | (byte(w + 1, mask) << 8)) >> (3 * ((i // 16) % 4))) & 7
    # d's 16 bits: the top nibbles of the 4 uint16, the first word's lowest
    d_bits = (byte(blk + 49, mask) >> 4) | ((byte(blk + 51, mask) >> 4) << 4)
    d_bits = d_bits | ((byte(blk + 53, mask) >> 4) << 8) | ((byte(blk + 55, mask) >> 4) << 12)
    return _value(fp16_bits(d_bits) * 0.125, _odd(scale), q)


@triton.jit
def iq4_xs(row, k, table, mask):
    blk = row + (k // 256) * 136
    i = k % 256
    s = i // 32
    j = i % 32
    code = (byte(blk + 8 + 16 * s + j % 16, mask) >> ((j // 16) * 4)) & 0x0F
    high = (byte(blk + 2 + s // 4, mask) >> ((s % 4) * 2)) & 3
    scale = (_nibble(blk + 4, s, mask) | (high << 4)) - 32
    value = tl.load(table + code, mask=mask, other=0)
    return _value(fp16(blk, mask), scale, value)


@triton.jit
def tq2_0(row, k, table, mask):
    blk = row + (k // 256) * 66
    i = k % 256
    code = (byte(blk + (i // 128) * 32 + i % 32, mask) >> (((i % 128) // 32) * 2)) & 3
    return fp16(blk + 64, mask) * (code - 1).to(tl.float32)  # one sub-block of scale 1


@triton.jit
def tq1_0(row, k, table, mask):
    blk = row + (k // 256) * 54
    i = k % 256
    # elements 0-159: digit i // 32 of byte i % 32; 160-239: digit of byte 32 + (i - 160) % 16;
    # 240-255: digit of byte 48 + (i - 240) % 4
    at = tl.where(i < 160, i % 32, tl.where(i < 240, 32 + (i - 160) % 16, 48 + (i - 240) % 4))
    digit = tl.where(i < 160, i // 32, tl.where(i < 240, (i - 160) // 16, (i - 240) // 4))
    power = tl.where(digit == 0, 1, tl.where(digit == 1, 3, tl.where(digit == 2, 9, 27)))
    power = tl.where(digit == 4, 81, power)
    code = (((byte(blk + at, mask) * power) & 0xFF) * 3) >> 8  # base-3 digit in fixed point
    return fp16(blk + 52, mask) * (code - 1).to(tl.float32)
