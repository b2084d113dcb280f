"""Dequantise the bytes of every format in `formats.FORMATS` to floats, in torch, vectorised over blocks.

`dequantize_bytes` turns rows of raw bytes into float rows; `dequantize` does a whole QTensor. Block
layouts are ggml's (`ggml-common.h`, `dequantize_row_*` in ggml-quants.c), and the float arithmetic
follows the same order as the gguf package's numpy dequantisers (e.g. Q4_K: (d * sc) * q - dmin * m),
so results are bit-identical to theirs. (Each product there is exact in float32, as an fp16 d has 11
significant bits and the integer sc * q fits in 13, so only a final subtraction rounds.) The integer
parts of each block (quants, sub-block scales and mins, the fp16 super-block scales) come from one
`unpack_*` function per format, which integer dot products can reuse. Everything is torch ops and
runs on the device that holds the bytes.
(Converting GPT-OSS's MXFP4 checkpoint tensors between layouts: moerun.quant.mxfp4_layouts.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moerun.quant import iquants
from moerun.quant.bitfields import f16_to_f32, fp16, reinterpret, split_bits
from moerun.quant.formats import FLOAT_DTYPES, FormatError, QFormat, QTensor

F32 = torch.float32
# Blocks are dequantised a slice of about this many elements at a time, to bound the float32
# temporaries (a few times the slice) however large the tensor.
CHUNK_ELEMENTS = 1 << 22

# MXFP4's E2M1 values doubled, so that they are integers (ggml's `kvalues_mxfp4`); the scale they are
# multiplied by is then half the E8M0 scale. Code 8 (-0) is stored as 0, as ggml does.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


# ---------------------------------------------------------------- unpacking: integer parts per format
# Each takes blocks uint8 [..., block_bytes] (any leading dims, written `...` below) and returns the
# block's integer parts; the block's values are the formula in its docstring, element by element.


def unpack_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 blocks [..., 18] -> (d, q); value = d * q.

    d: float32 [...], the fp16 scale (exact). q: int8 [..., 32] in [-8, 7]; byte j of the 16 after d
    holds element j in its low nibble and element j + 16 in its high nibble, both offset by 8."""
    d = fp16(blocks[..., 0:2])
    nibbles = split_bits(blocks[..., 2:18], (0, 4), 0x0F)  # [..., 2, 16]
    q = nibbles.flatten(-2).to(torch.int8) - 8
    return d, q


def unpack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks [..., 20] -> (d, m, q); value = d * q + m.

    d, m: float32 [...], the fp16 scale and min (exact). q: uint8 [..., 32] in [0, 15], nibbles as
    Q4_0's (byte j: element j low, j + 16 high), with no offset."""
    q = split_bits(blocks[..., 4:20], (0, 4), 0x0F).flatten(-2)
    return fp16(blocks[..., 0:2]), fp16(blocks[..., 2:4]), q


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's quants uint8 [..., 32] in [0, 31]: nibbles as Q4_0's, topped with bit j of the
    little-endian uint32 `qh` (bytes [..., 4]) for element j."""
    high = split_bits(qh, tuple(range(8)), 0x01).transpose(-1, -2).flatten(-2)  # [..., 32]
    return split_bits(qs, (0, 4), 0x0F).flatten(-2) | high << 4


def unpack_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 blocks [..., 22] -> (d, q); value = d * q.

    d: float32 [...], the fp16 scale (exact). q: int8 [..., 32] in [-16, 15]: the 5-bit field of
    `_five_bit` (qh: bytes 2-5, nibbles: bytes 6-21) minus 16."""
    return fp16(blocks[..., 0:2]), _five_bit(blocks[..., 2:6], blocks[..., 6:22]).to(torch.int8) - 16


def unpack_q5_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_1 blocks [..., 24] -> (d, m, q); value = d * q + m.

    d, m: float32 [...], the fp16 scale and min (exact). q: uint8 [..., 32] in [0, 31], the 5-bit
    field of `_five_bit` (qh: bytes 4-7, nibbles: bytes 8-23)."""
    return fp16(blocks[..., 0:2]), fp16(blocks[..., 2:4]), _five_bit(blocks[..., 4:8], blocks[..., 8:24])


def unpack_iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks [..., 18] -> (d, q); value = d * q.

    d: float32 [...], the fp16 scale (exact). q: int8 [..., 32], IQ4NL_VALUES (moerun.quant.iq_tables)
    of the 4-bit codes, nibbles as Q4_0's."""
    codes = split_bits(blocks[..., 2:18], (0, 4), 0x0F).flatten(-2)
    return fp16(blocks[..., 0:2]), iquants.iq4nl_values(codes)


def unpack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks [..., 34] -> (d, q); value = d * q.

    d: float32 [...], the fp16 scale (exact). q: int8 [..., 32]."""
    return fp16(blocks[..., 0:2]), blocks[..., 2:34].view(torch.int8)


def unpack_q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q2_K blocks [..., 84] -> (d, dmin, scales, mins, q); for element i of sub-block s = i // 16:
    value = (d * scales[s]) * q[i] - dmin * mins[s].

    d, dmin: float32 [...], the fp16 super-block scales (exact). scales, mins: uint8 [..., 16] in
    [0, 15] (low and high nibble of each of the first 16 bytes). q: uint8 [..., 256] in [0, 3]; each
    half of 128 elements takes 32 bytes, whose 2-bit fields at shifts 0, 2, 4, 6 are its 4 runs of 32."""
    packed_scales, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = fp16(blocks[..., 80:82]), fp16(blocks[..., 82:84])
    q = split_bits(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 0x03)  # [..., half, shift, 32]
    return d, dmin, packed_scales & 0x0F, packed_scales >> 4, q.flatten(-3)


def unpack_q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q3_K blocks [..., 110] -> (d, scales, q); for element i: value = (d * scales[i // 16]) * q[i].

    d: float32 [...], the fp16 super-block scale (exact). scales: int8 [..., 16] in [-32, 31], 6-bit
    fields offset by 32 (low 4 bits: nibbles of bytes 0-7 of the 12, low nibbles first; high 2 bits:
    2-bit fields of bytes 8-11). q: int8 [..., 256] in [-4, 3]: 2 low bits as in Q2_K, minus 4 where
    the element's bit in `hmask` (bit g of byte i % 32 for run g = i // 32) is clear."""
    hmask, qs, packed_scales = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = fp16(blocks[..., 108:110])

    low = split_bits(packed_scales[..., 0:8], (0, 4), 0x0F).flatten(-2)  # [..., 16]
    high = split_bits(packed_scales[..., 8:12], (0, 2, 4, 6), 0x03).flatten(-2)  # [..., 16]
    scales = (low | high << 4).to(torch.int8) - 32

    low_bits = split_bits(qs.unflatten(-1, (2, 32)), (0, 2, 4, 6), 0x03).flatten(-3)  # [..., 256]
    high_bit = split_bits(hmask, tuple(range(8)), 0x01).flatten(-2)  # [..., 256]
    # A set high bit means no offset: ggml subtracts 4 only where the bit is 0.
    q = low_bits.to(torch.int8) - ((high_bit ^ 1) << 2).to(torch.int8)
    return d, scales, q


def _unpack_k4_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins [..., 12] -> (scales, mins), uint8 [..., 8].

    Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take the
    nibbles of bytes 8-11 (low: scale, high: min) topped with the spare 2 bits of bytes 0-3 and 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | (a >> 6) << 4], dim=-1)
    mins = torch.cat([b & 0x3F, (c >> 4) | (b >> 6) << 4], dim=-1)
    return scales, mins


def unpack_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K blocks [..., 144] -> (d, dmin, scales, mins, q); for element i of sub-block s = i // 32:
    value = (d * scales[s]) * q[i] - dmin * mins[s].

    d, dmin: float32 [...], the fp16 super-block scales (exact). scales, mins: uint8 [..., 8] in
    [0, 63]. q: uint8 [..., 256] in [0, 15]; each 32 bytes hold sub-block 2k in their low nibbles and
    2k + 1 in their high nibbles."""
    d, dmin = fp16(blocks[..., 0:2]), fp16(blocks[..., 2:4])
    scales, mins = _unpack_k4_scales(blocks[..., 4:16])
    q = split_bits(blocks[..., 16:144].unflatten(-1, (4, 32)), (0, 4), 0x0F).flatten(-3)
    return d, dmin, scales, mins, q


def unpack_q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q5_K blocks [..., 176] -> (d, dmin, scales, mins, q); value as Q4_K's.

    d, dmin, scales, mins: as `unpack_q4_k`. q: uint8 [..., 256] in [0, 31]: Q4_K's 4 low bits (from
    the last 128 bytes) plus a fifth, bit s of byte i % 32 of the 32 `qh` bytes for sub-block s."""
    d, dmin = fp16(blocks[..., 0:2]), fp16(blocks[..., 2:4])
    scales, mins = _unpack_k4_scales(blocks[..., 4:16])
    qh, qs = blocks[..., 16:48], blocks[..., 48:176]
    low = split_bits(qs.unflatten(-1, (4, 32)), (0, 4), 0x0F).flatten(-3)
    high = split_bits(qh, tuple(range(8)), 0x01).flatten(-2)
    return d, dmin, scales, mins, low | high << 4


def unpack_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [..., 210] -> (d, scales, q); for element i: value = (d * scales[i // 16]) * q[i].

    d: float32 [...], the fp16 super-block scale (exact). scales: int8 [..., 16]. q: int8 [..., 256]
    in [-32, 31], offset by 32. Each half of 128 elements takes 64 `ql` bytes (low nibbles: elements
    0-63, high nibbles: 64-127) and 32 `qh` bytes (2-bit fields at shifts 0, 2, 4, 6: the top bits of
    runs 0-31, 32-63, 64-95, 96-127)."""
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    scales = blocks[..., 192:208].view(torch.int8)
    d = fp16(blocks[..., 208:210])
    low = split_bits(ql.unflatten(-1, (2, 64)), (0, 4), 0x0F).flatten(-2)  # [..., half, 128]
    high = split_bits(qh.unflatten(-1, (2, 32)), (0, 2, 4, 6), 0x03).flatten(-2)  # [..., half, 128]
    q = (low | high << 4).flatten(-2).to(torch.int8) - 32
    return d, scales, q


def unpack_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks [..., 17] -> (e, codes); value = e8m0_half_scale(e) * MXFP4_VALUES[code].

    e: uint8 [...], the E8M0 scale byte. codes: uint8 [..., 32] E2M1 codes in [0, 15]; byte j of the
    16 after e holds element j in its low nibble and element j + 16 in its high nibble."""
    return blocks[..., 0], split_bits(blocks[..., 1:17], (0, 4), 0x0F).flatten(-2)


def unpack_mxfp4_gpt_oss(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxfp4_gpt_oss` blocks [..., 17] -> (e, codes), as `unpack_mxfp4`, but byte j of the 16 after e
    holds element 2j in its low nibble and element 2j + 1 in its high nibble."""
    qs = blocks[..., 1:17]
    return blocks[..., 0], torch.stack([qs & 0x0F, qs >> 4], dim=-1).flatten(-2)


def e8m0_half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents uint8 [...] -> half their scale, 2^(e - 128), float32 [...] (ggml's
    `ggml_e8m0_to_fp32_half`; e < 2 gives a subnormal, and e = 255 gives 2^127 rather than NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(F32)


# ---------------------------------------------------------------- dequantising blocks [N, block_bytes]
# Each returns float32 [N, block_size], with the float operations in the gguf package's order.


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = unpack_q4_0(blocks)
    return d[:, None] * q.to(F32)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = unpack_q8_0(blocks)
    return d[:, None] * q.to(F32)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = unpack_q4_1(blocks)
    return d[:, None] * q.to(F32) + m[:, None]


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d, q = unpack_q5_0(blocks)
    return d[:, None] * q.to(F32)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m, q = unpack_q5_1(blocks)
    return d[:, None] * q.to(F32) + m[:, None]


def _dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d, q = unpack_iq4_nl(blocks)
    return d[:, None] * q.to(F32)


def _scaled_sub_blocks(
    d: torch.Tensor,
    scales: torch.Tensor,
    q: torch.Tensor,
    dmin: torch.Tensor | None,
    mins: torch.Tensor | None,
) -> torch.Tensor:
    """(d * scale) * q [- dmin * min] per sub-block: d, dmin [N]; scales, mins [N, S]; q [N, 256]."""
    n_sub = scales.shape[-1]
    step = (d[:, None] * scales.to(F32))[..., None]  # [N, S, 1]
    values = step * q.to(F32).unflatten(-1, (n_sub, -1))  # [N, S, 256 / S]
    if dmin is not None:
        values = values - (dmin[:, None] * mins.to(F32))[..., None]
    return values.flatten(-2)


def _dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, mins, q = unpack_q2_k(blocks)
    return _scaled_sub_blocks(d, scales, q, dmin, mins)


def _dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    d, scales, q = unpack_q3_k(blocks)
    return _scaled_sub_blocks(d, scales, q, None, None)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, mins, q = unpack_q4_k(blocks)
    return _scaled_sub_blocks(d, scales, q, dmin, mins)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin, scales, mins, q = unpack_q5_k(blocks)
    return _scaled_sub_blocks(d, scales, q, dmin, mins)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    d, scales, q = unpack_q6_k(blocks)
    return _scaled_sub_blocks(d, scales, q, None, None)


@functools.cache
def _mxfp4_table(device: torch.device) -> torch.Tensor:
    """MXFP4_VALUES as float32 [16] on `device`, made once per device rather than once per call."""
    return torch.tensor(MXFP4_VALUES, dtype=F32, device=device)


def _mxfp4_values(e: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return e8m0_half_scale(e)[:, None] * _mxfp4_table(codes.device)[codes.long()]


def _dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    return _mxfp4_values(*unpack_mxfp4(blocks))


def _dequant_mxfp4_gpt_oss(blocks: torch.Tensor) -> torch.Tensor:
    return _mxfp4_values(*unpack_mxfp4_gpt_oss(blocks))


BLOCK_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q4_0": _dequant_q4_0,
    "q4_1": _dequant_q4_1,
    "q5_0": _dequant_q5_0,
    "q5_1": _dequant_q5_1,
    "q8_0": _dequant_q8_0,
    "iq4_nl": _dequant_iq4_nl,
    "q2_k": _dequant_q2_k,
    "q3_k": _dequant_q3_k,
    "q4_k": _dequant_q4_k,
    "q5_k": _dequant_q5_k,
    "q6_k": _dequant_q6_k,
    "mxfp4": _dequant_mxfp4,
    "mxfp4_gpt_oss": _dequant_mxfp4_gpt_oss,
} | {name: functools.partial(iquants.dequant_super_blocks, name=name) for name in iquants.UNPACKERS}


# ---------------------------------------------------------------- public entry points


def dequantize_bytes(fmt: QFormat, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of `fmt` bytes, uint8 [..., row_bytes], -> their values [..., row_elements] in `dtype`.

    Values are computed in float32 and then cast; the result never shares memory with `data`.
    Refuses (FormatError) bytes that are not uint8 or rows that are not a whole number of blocks."""
    if data.dtype != torch.uint8 or data.ndim == 0:
        raise FormatError(
            f"Cannot dequantise {fmt.name} from a {data.dtype} tensor of shape {tuple(data.shape)}: "
            f"the bytes must be a uint8 tensor [..., row_bytes]."
        )
    row_bytes = data.shape[-1]
    if row_bytes % fmt.block_bytes:
        raise FormatError(
            f"Cannot dequantise {fmt.name} rows of {row_bytes} bytes: {fmt.name} blocks are "
            f"{fmt.block_bytes} bytes each, and {row_bytes} is not a multiple of {fmt.block_bytes}."
        )
    out_shape = (*data.shape[:-1], row_bytes // fmt.block_bytes * fmt.block_size)

    if fmt.name in FLOAT_DTYPES:
        values = reinterpret(data, FLOAT_DTYPES[fmt.name])
        if values.dtype == dtype:
            return values.clone(memory_format=torch.contiguous_format)
        if values.dtype == torch.float16:
            return f16_to_f32(values).to(dtype)
        return values.to(F32).to(dtype)
    if fmt.name not in BLOCK_DEQUANTIZERS:
        raise FormatError(
            f"Dequantising {fmt.name} is not supported; known: {', '.join(BLOCK_DEQUANTIZERS)}."
        )

    dequant_blocks = BLOCK_DEQUANTIZERS[fmt.name]
    blocks = data.reshape(-1, fmt.block_bytes)  # [N, block_bytes]
    per_chunk = max(1, CHUNK_ELEMENTS // fmt.block_size)
    if blocks.shape[0] <= per_chunk:
        return dequant_blocks(blocks).to(dtype).reshape(out_shape)
    out = torch.empty(blocks.shape[0], fmt.block_size, dtype=dtype, device=data.device)
    for start in range(0, blocks.shape[0], per_chunk):
        out[start : start + per_chunk] = dequant_blocks(blocks[start : start + per_chunk])
    return out.reshape(out_shape)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A QTensor's values, of its logical shape ([E, out, in] or [out, in]), in `dtype` (a stand-in's:
    a stand-in, moerun.quant.formats.storage_free)."""
    if q.data.is_meta:
        return torch.empty(q.shape, dtype=dtype, device="meta")
    return dequantize_bytes(q.format, q.data, dtype).reshape(q.shape)
