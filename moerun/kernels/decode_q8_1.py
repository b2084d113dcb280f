"""The integer (q8_1) kernels of the Triton decode step, for block-quantised weights.

Owns q8_1 activations on the device (`quantize_rows_q8_1` and its torch reference, and `store_q8_1`,
which `moerun.kernels.decode`'s activation kernel also writes its q8_1 rows with) and the projection
kernel with integer dot products, `experts_gemv_q8_1_kernel`: weight quants times q8_1 activation
quants, summed per sub-block in int32, the float scales applied after in the order of
`moerun.quant.q8_1.dot_q8_1` (ggml's vecdotq.cuh). `moerun.kernels.decode` launches it through the
one launcher of both projections wherever their input is a Q8_1; its torch reference there is
dot_q8_1 per expert (`gate_up_experts_reference`, `down_experts_reference`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from moerun.kernels.block_fields import fp16
from moerun.kernels.configs import default_config, merge_config
from moerun.kernels.weights import (
    FORMAT_CODES,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
)
from moerun.quant.q8_1 import Q8_1, quantize_q8_1

# Formats with an integer q8_1 path, and the bytes of weights one loop step covers (256 elements:
# one k-quant super-block, or eight 32-element blocks).
Q8_1_GROUP_BYTES = {FORMAT_CODES["q8_0"]: 8 * 34, FORMAT_CODES["q4_0"]: 8 * 18, FORMAT_CODES["mxfp4"]: 8 * 17}
Q8_1_GROUP_BYTES |= {FORMAT_CODES["q4_k"]: 144, FORMAT_CODES["q5_k"]: 176, FORMAT_CODES["q6_k"]: 210}
Q8_1_GROUP_BYTES |= {FORMAT_CODES["q2_k"]: 84, FORMAT_CODES["q3_k"]: 110}
Q8_1_GROUP_BYTES |= {FORMAT_CODES["q4_1"]: 8 * 20, FORMAT_CODES["q5_0"]: 8 * 22, FORMAT_CODES["q5_1"]: 8 * 24}
Q8_1_GROUP_BYTES |= {FORMAT_CODES["iq4_nl"]: 8 * 18, FORMAT_CODES["iq4_xs"]: 136}
QK = 32  # elements per q8_1 block

GEMV_Q8_1_CONFIG = default_config("decode_gemv_q8_1")
QUANTIZE_CONFIG = default_config("decode_quantize_q8_1")  # BLOCK_I: a multiple of 32


# ---------------------------------------------------------------- q8_1 activations


@triton.jit
def store_q8_1(v, blocks, n, qs_row, d_row, s_row, GROUPS: tl.constexpr):
    """Quantise v fp32 [G, 32] (q8_1 blocks `blocks` [G] of a row of n) as quantize_q8_1 does and
    store qs int8, d and s fp32 (fp16 values) at the row pointers; blocks past n are not stored."""
    # ggml's quantize_row_q8_1_ref: IEEE divisions (plain `/` may be approximate on the GPU)
    d = tl.div_rn(tl.max(tl.abs(v), axis=1), tl.full([GROUPS], 127.0, tl.float32))  # [G]
    inv = tl.div_rn(tl.full([GROUPS], 1.0, tl.float32), tl.where(d != 0, d, 1.0))
    keep = (d != 0) & (inv <= 3.4028234663852886e38)  # 1 / d overflowing: a zero block
    inv = tl.where(keep, inv, 0.0)
    d = tl.where(keep, d, 0.0)
    scaled = v * inv[:, None]
    mag = tl.abs(scaled)
    whole = tl.floor(mag)
    q = whole + tl.where(mag - whole >= 0.5, 1.0, 0.0)  # roundf: ties away from zero
    q = tl.where(scaled < 0, -q, q).to(tl.int32)
    s = tl.sum(q, axis=1).to(tl.float32) * d
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(qs_row + cols, q.to(tl.int8), mask=cols < n)
    tl.store(d_row + blocks, d.to(tl.float16).to(tl.float32), mask=blocks * 32 < n)
    tl.store(s_row + blocks, s.to(tl.float16).to(tl.float32), mask=blocks * 32 < n)


@triton.jit
def _quantize_q8_1_kernel(x_ptr, qs_ptr, d_ptr, s_ptr, n, GROUPS: tl.constexpr):
    """Rows x float [R, n] (n a multiple of 32) -> q8_1: qs int8 [R, n]; d, s fp32 [R, n / 32].
    Grid (R, cdiv(n, 32 * GROUPS))."""
    r = tl.program_id(0)
    blocks = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x_ptr + r * n + cols, mask=cols < n, other=0.0).to(tl.float32)
    store_q8_1(v, blocks, n, qs_ptr + r * n, d_ptr + r * (n // 32), s_ptr + r * (n // 32), GROUPS)


def empty_q8_1(shape: tuple[int, ...], device: torch.device) -> Q8_1:
    blocks = (*shape[:-1], shape[-1] // QK)
    return Q8_1(
        qs=torch.empty(shape, dtype=torch.int8, device=device),
        d=torch.empty(blocks, dtype=torch.float32, device=device),
        s=torch.empty(blocks, dtype=torch.float32, device=device),
    )


def quantize_rows_q8_1(x: torch.Tensor, config: Mapping[str, int] | None = None) -> Q8_1:
    """Float rows x [..., n] (n a multiple of 32) -> their Q8_1, bit-exact `quantize_q8_1`, one launch.
    Unlike quantize_q8_1 nothing is checked on the host: inf or NaN input, or scales overflowing
    fp16, give inf or NaN scales rather than an error (the decode step reads nothing back)."""
    cfg = merge_config(QUANTIZE_CONFIG, config)
    n = x.shape[-1]
    if n % QK or cfg["BLOCK_I"] % QK:
        raise ValueError(
            f"q8_1 rows and BLOCK_I must be multiples of {QK}; got n={n}, BLOCK_I={cfg['BLOCK_I']}."
        )
    out = empty_q8_1(tuple(x.shape), x.device)
    rows = x.reshape(-1, n).contiguous()
    grid = (rows.shape[0], triton.cdiv(n, cfg["BLOCK_I"]))
    _quantize_q8_1_kernel[grid](
        rows, out.qs, out.d, out.s, n, GROUPS=cfg["BLOCK_I"] // QK, num_warps=cfg["num_warps"]
    )
    return out


def quantize_rows_q8_1_reference(x, config=None) -> Q8_1:
    return quantize_q8_1(x)


# ---------------------------------------------------------------- integer dot products


@triton.jit
def _dot_blocks32(rows, n_mask, qs_g, d8_g, s8_g, n_blocks, table, FMT: tl.constexpr):
    """Up to 8 blocks of 32 (n_blocks valid) of a 32-element format's rows (byte pointers [BN] at the
    first block) with q8_1 quants qs_g int8 [256], d8_g and s8_g fp32 [8] -> fp32 [BN]. table: the
    format's lookup table (IQ4_NL's values)."""
    j = tl.arange(0, 8)
    c = tl.arange(0, 32)
    jm = j < n_blocks
    m2 = n_mask[:, None] & jm[None, :]  # [BN, 8]
    m3 = m2[:, :, None]
    aq = tl.load(qs_g + j[:, None] * 32 + c[None, :], mask=jm[:, None], other=0).to(tl.int32)  # [8, 32]
    d8 = tl.load(d8_g + j, mask=jm, other=0.0)[None, :]  # [1, 8]
    s8 = tl.load(s8_g + j, mask=jm, other=0.0)[None, :]
    if FMT == Q8_0:
        base = rows[:, None] + j[None, :] * 34  # [BN, 8]
        q = tl.load(base[:, :, None] + 2 + c[None, None, :], mask=m3, other=0)
        isum = tl.sum(q.to(tl.int8, bitcast=True).to(tl.int32) * aq[None, :, :], axis=2)  # [BN, 8]
        out = tl.sum((fp16(base, m2) * d8) * isum.to(tl.float32), axis=1)
    else:
        # Block bytes, and where the 16 nibble bytes start (byte b: element b low, b + 16 high);
        # Q5_0 / Q5_1 keep the fifth bits in the 4 bytes before them (bit e: element e).
        if FMT == Q4_0 or FMT == IQ4_NL:  # noqa: SIM109
            width, first = 18, 2
        elif FMT == MXFP4:
            width, first = 17, 1
        elif FMT == Q4_1:
            width, first = 20, 4
        elif FMT == Q5_0:
            width, first = 22, 6
        else:
            width, first = 24, 8
        base = rows[:, None] + j[None, :] * width
        byte = tl.load(base[:, :, None] + first + (c % 16)[None, None, :], mask=m3, other=0).to(tl.int32)
        code = (byte >> (4 * (c // 16))[None, None, :]) & 0xF  # [BN, 8, 32]
        if FMT == Q5_0 or FMT == Q5_1:  # noqa: SIM109
            qh = tl.load(base[:, :, None] + first - 4 + (c // 8)[None, None, :], mask=m3, other=0)
            code = code | (((qh.to(tl.int32) >> (c % 8)[None, None, :]) & 1) << 4)
        if FMT == MXFP4:
            mag = code & 7  # doubled E2M1: 0, 1, 2, 3, 4, 6, 8, 12
            big = (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0)
            value = tl.where(mag < 4, mag, big)
            code = tl.where((code & 8) != 0, -value, value)
        elif FMT == IQ4_NL:
            code = tl.load(table + code, mask=m3, other=0).to(tl.int32)
        isum = tl.sum(code * aq[None, :, :], axis=2).to(tl.float32)  # [BN, 8]
        if FMT == Q4_0 or FMT == Q5_0:  # noqa: SIM109 - the offset -8 / -16 comes via s
            offset = 8.0 if FMT == Q4_0 else 16.0
            out = tl.sum(fp16(base, m2) * (isum * d8 - offset * s8), axis=1)
        elif FMT == Q4_1 or FMT == Q5_1:  # noqa: SIM109 - the min via s
            out = tl.sum(isum * (fp16(base, m2) * d8) + fp16(base + 2, m2) * s8, axis=1)
        elif FMT == IQ4_NL:
            out = tl.sum((fp16(base, m2) * d8) * isum, axis=1)
        else:
            e = tl.load(base, mask=m2, other=0).to(tl.int32)  # E8M0; half its scale is 2^(e - 128)
            bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
            out = tl.sum((bits.to(tl.float32, bitcast=True) * d8) * isum, axis=1)
    return out


@triton.jit
def _dot_q4_k(rows, n_mask, qs_g, d8_g, FIVE_BITS: tl.constexpr):
    """One Q4_K super-block (or, FIVE_BITS, Q5_K) at byte pointers [BN] with q8_1 quants qs_g [256],
    d8_g [8] -> fp32 [BN]. Q5_K is Q4_K's layout with 32 `qh` bytes before the nibbles, whose bit j
    of byte c is the fifth bit of element c of sub-block j."""
    j = tl.arange(0, 8)  # sub-blocks of 32
    c = tl.arange(0, 32)
    m2 = n_mask[:, None]
    m3 = n_mask[:, None, None]
    aq = tl.load(qs_g + j[:, None] * 32 + c[None, :]).to(tl.int32)  # [8, 32]
    d8 = tl.load(d8_g + j)[None, :]  # [1, 8]
    # sub-block j: low (j even) or high nibbles of bytes first + 32 * (j // 2) + c
    first = 48 if FIVE_BITS else 16
    offs = (first + 32 * (j // 2))[:, None] + c[None, :]  # [8, 32]
    byte = tl.load(rows[:, None, None] + offs[None, :, :], mask=m3, other=0).to(tl.int32)
    q = (byte >> (4 * (j % 2))[None, :, None]) & 0xF
    if FIVE_BITS:
        qh = tl.load(rows[:, None, None] + 16 + c[None, None, :], mask=m3, other=0).to(
            tl.int32
        )  # [BN, 1, 32]
        q = q | (((qh >> j[None, :, None]) & 1) << 4)
    isum = tl.sum(q * aq[None, :, :], axis=2)  # [BN, 8]
    # 6-bit scales and mins: bytes 4-7 (a), 8-11 (b), 12-15 (c) as in dequant._unpack_k4_scales
    at = rows[:, None] + (j % 4)[None, :]
    sa = tl.load(at + 4, mask=m2, other=0).to(tl.int32)
    sb = tl.load(at + 8, mask=m2, other=0).to(tl.int32)
    sc = tl.load(at + 12, mask=m2, other=0).to(tl.int32)
    high = (j >= 4)[None, :]
    scale = tl.where(high, (sc & 0xF) | ((sa >> 6) << 4), sa & 63)
    minimum = tl.where(high, (sc >> 4) | ((sb >> 6) << 4), sb & 63)
    qsum = tl.sum(aq, axis=1)[None, :]  # [1, 8]
    sumf_d = tl.sum(d8 * (isum * scale).to(tl.float32), axis=1)
    sumf_m = tl.sum(d8 * (qsum * minimum).to(tl.float32), axis=1)
    return fp16(rows, n_mask) * sumf_d - fp16(rows + 2, n_mask) * sumf_m


@triton.jit
def _two_bit_quants(qs, n_mask, el):
    """The 2-bit fields of Q2_K / Q3_K elements `el` (int [16, 16] in [0, 256)), their 64 bytes at
    byte pointers qs [BN]: element i in byte 32 * (i // 128) + i % 32 at shift 2 * ((i % 128) // 32).
    -> int32 [BN, 16, 16]."""
    byte = tl.load(
        qs[:, None, None] + (32 * (el // 128) + el % 32)[None, :, :], mask=n_mask[:, None, None], other=0
    )
    return (byte.to(tl.int32) >> (2 * ((el % 128) // 32))[None, :, :]) & 3


@triton.jit
def _dot_q2_k(rows, n_mask, qs_g, d8_g):
    """One Q2_K super-block (byte pointers [BN]) with q8_1 quants qs_g [256], d8_g [8] -> fp32 [BN].
    Element i: half h = i // 128 takes bytes 16 + 32h + (i % 32), at shift 2 * ((i % 128) // 32);
    sub-block j = i // 16 has scale (byte j & 15) and min (byte j >> 4)."""
    j = tl.arange(0, 16)  # sub-blocks of 16
    el = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16] element index
    m2 = n_mask[:, None]
    q = _two_bit_quants(rows + 16, n_mask, el)
    aq = tl.load(qs_g + el).to(tl.int32)  # [16, 16]
    isum = tl.sum(q * aq[None, :, :], axis=2)  # [BN, 16]
    packed = tl.load(rows[:, None] + j[None, :], mask=m2, other=0).to(tl.int32)
    d8 = tl.load(d8_g + j // 2)[None, :]  # a q8_1 block spans two sub-blocks
    qsum = tl.sum(aq, axis=1)[None, :]  # [1, 16]
    sumf_d = tl.sum(d8 * (isum * (packed & 15)).to(tl.float32), axis=1)
    sumf_m = tl.sum(d8 * (qsum * (packed >> 4)).to(tl.float32), axis=1)
    return fp16(rows + 80, n_mask) * sumf_d - fp16(rows + 82, n_mask) * sumf_m


@triton.jit
def _dot_q3_k(rows, n_mask, qs_g, d8_g):
    """One Q3_K super-block (byte pointers [BN]) with q8_1 quants qs_g [256], d8_g [8] -> fp32 [BN].
    Element i: 2 low bits as Q2_K's (from byte 32 on), minus 4 where bit i // 32 of hmask byte i % 32
    is clear; sub-block j's 6-bit scale (offset by 32): nibble j // 8 of byte 96 + j % 8, and 2 high
    bits at shift 2 * (j // 4) of byte 104 + j % 4."""
    j = tl.arange(0, 16)  # sub-blocks of 16
    el = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16] element index
    m2 = n_mask[:, None]
    low = _two_bit_quants(rows + 32, n_mask, el)
    hmask = tl.load(rows[:, None, None] + (el % 32)[None, :, :], mask=n_mask[:, None, None], other=0).to(
        tl.int32
    )
    q = low - 4 * (1 - ((hmask >> (el // 32)[None, :, :]) & 1))
    aq = tl.load(qs_g + el).to(tl.int32)  # [16, 16]
    isum = tl.sum(q * aq[None, :, :], axis=2)  # [BN, 16]
    lo = tl.load(rows[:, None] + 96 + (j % 8)[None, :], mask=m2, other=0).to(tl.int32)
    hi = tl.load(rows[:, None] + 104 + (j % 4)[None, :], mask=m2, other=0).to(tl.int32)
    scale = (((lo >> (4 * (j // 8))[None, :]) & 15) | (((hi >> (2 * (j // 4))[None, :]) & 3) << 4)) - 32
    d8 = tl.load(d8_g + j // 2)[None, :]  # a q8_1 block spans two sub-blocks
    return fp16(rows + 108, n_mask) * tl.sum(d8 * (isum * scale).to(tl.float32), axis=1)


@triton.jit
def _dot_q6_k(rows, n_mask, qs_g, d8_g):
    """One Q6_K super-block (byte pointers [BN]) with q8_1 quants qs_g [256], d8_g [8] -> fp32 [BN]."""
    j = tl.arange(0, 16)  # sub-blocks of 16
    el = j[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16] element index
    half = el // 128
    r = el % 128
    m3 = n_mask[:, None, None]
    low = tl.load(rows[:, None, None] + (64 * half + r % 64)[None, :, :], mask=m3, other=0).to(tl.int32)
    top = tl.load(rows[:, None, None] + (128 + 32 * half + r % 32)[None, :, :], mask=m3, other=0).to(tl.int32)
    low = (low >> (4 * (r // 64))[None, :, :]) & 0xF
    top = (top >> (2 * (r // 32))[None, :, :]) & 3
    q = (low | (top << 4)) - 32
    aq = tl.load(qs_g + el).to(tl.int32)  # [16, 16]
    isum = tl.sum(q * aq[None, :, :], axis=2)  # [BN, 16]
    scale = tl.load(rows[:, None] + 192 + j[None, :], mask=n_mask[:, None], other=0)
    scale = scale.to(tl.int8, bitcast=True).to(tl.int32)
    d8 = tl.load(d8_g + j // 2)[None, :]  # a q8_1 block spans two sub-blocks
    return fp16(rows + 208, n_mask) * tl.sum(d8 * (isum * scale).to(tl.float32), axis=1)


@triton.jit
def _dot_iq4_xs(rows, n_mask, qs_g, d8_g, table):
    """One IQ4_XS super-block (byte pointers [BN]) with q8_1 quants qs_g [256], d8_g [8] -> fp32 [BN]:
    sum over sub-blocks j of 32 of (d * d8_j) * (isum_j * (ls_j - 32)), the codes' values gathered
    from `table` (IQ4_NL's). Sub-block j: 16 bytes from 8 + 16j (element c in the low nibble of byte
    c % 16 for c < 16, the high one after); ls_j's low nibble in byte 4 + j // 2, its 2 high bits at
    shift 2 * (j % 4) of byte 2 + j // 4."""
    j = tl.arange(0, 8)  # sub-blocks of 32
    c = tl.arange(0, 32)
    m2 = n_mask[:, None]
    m3 = n_mask[:, None, None]
    aq = tl.load(qs_g + j[:, None] * 32 + c[None, :]).to(tl.int32)  # [8, 32]
    d8 = tl.load(d8_g + j)[None, :]  # [1, 8]
    offs = (8 + 16 * j)[:, None] + (c % 16)[None, :]  # [8, 32]
    byte = tl.load(rows[:, None, None] + offs[None, :, :], mask=m3, other=0).to(tl.int32)
    code = (byte >> (4 * (c // 16))[None, None, :]) & 0xF
    value = tl.load(table + code, mask=m3, other=0).to(tl.int32)
    isum = tl.sum(value * aq[None, :, :], axis=2)  # [BN, 8]
    low = tl.load(rows[:, None] + 4 + (j // 2)[None, :], mask=m2, other=0).to(tl.int32)
    high = tl.load(rows[:, None] + 2 + (j // 4)[None, :], mask=m2, other=0).to(tl.int32)
    ls = (((low >> (4 * (j % 2))[None, :]) & 0xF) | (((high >> (2 * (j % 4))[None, :]) & 3) << 4)) - 32
    return tl.sum((fp16(rows, n_mask)[:, None] * d8) * (isum * ls).to(tl.float32), axis=1)


@triton.jit
def experts_gemv_q8_1_kernel(
    qs_ptr, d8_ptr, s8_ptr, x_row_stride, slots_ptr, experts_ptr, weights_ptr,
    w_ptr, row_stride, expert_stride, table_ptr, bias_ptr, out_ptr, N, K,
    FMT: tl.constexpr, GROUP_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """As decode._experts_gemv_kernel with x in q8_1 and integer dot products. Grid (k, cdiv(N, BLOCK_N)).

    qs: int8 [k, K]; d8, s8: fp32 [k, K / 32]; rows `x_row_stride` elements of qs apart (0: shared).
    w: uint8 [slots, N, row_stride] of FMT (one of Q8_1_GROUP_BYTES); table: its lookup table
    (KernelWeight.table). bias: float [E, N].
    out: fp32 [k, N]."""
    i = tl.program_id(0)
    n_offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    slot = tl.load(slots_ptr + i).to(tl.int64)
    rows = w_ptr + slot * expert_stride + n_offs * row_stride  # [BN] byte pointers
    qs_row = qs_ptr + i * x_row_stride
    d8_row = d8_ptr + i * (x_row_stride // 32)
    s8_row = s8_ptr + i * (x_row_stride // 32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, 256)):  # 256 elements a step
        blk = rows + g * GROUP_BYTES
        if FMT == Q4_K or FMT == Q5_K:  # noqa: SIM109 - triton has no `in`
            acc += _dot_q4_k(blk, n_mask, qs_row + g * 256, d8_row + g * 8, FMT == Q5_K)
        elif FMT == Q2_K:
            acc += _dot_q2_k(blk, n_mask, qs_row + g * 256, d8_row + g * 8)
        elif FMT == Q3_K:
            acc += _dot_q3_k(blk, n_mask, qs_row + g * 256, d8_row + g * 8)
        elif FMT == Q6_K:
            acc += _dot_q6_k(blk, n_mask, qs_row + g * 256, d8_row + g * 8)
        elif FMT == IQ4_XS:
            acc += _dot_iq4_xs(blk, n_mask, qs_row + g * 256, d8_row + g * 8, table_ptr)
        else:
            n_blocks = K // 32 - g * 8
            acc += _dot_blocks32(
                blk, n_mask, qs_row + g * 256, d8_row + g * 8, s8_row + g * 8, n_blocks, table_ptr, FMT
            )
    if HAS_BIAS:
        expert = tl.load(experts_ptr + i).to(tl.int64)
        bias = tl.load(bias_ptr + expert * N + n_offs, mask=n_mask, other=0.0).to(tl.float32)
        if SCALE_BIAS:
            bias = bias * tl.load(weights_ptr + i)
        acc += bias
    tl.store(out_ptr + i * N + n_offs, acc, mask=n_mask)
