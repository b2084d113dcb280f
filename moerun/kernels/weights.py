"""Reading expert weights inside kernels: one Triton function turns a tile of any supported format
into fp32, so the GEMM and GEMV kernels are written once for every format.

`load_weight_tile(w_ptr, row_stride, n_offs, k_offs, N, K, table_ptr, FMT)` returns the fp32 tile
W[n_offs, k_offs] transposed, [BK, BN], ready for `tl.dot(a [BM, BK], tile)`. `w_ptr` points at
the first byte/element of one expert's [N, K] weight; rows are `row_stride` apart, counted in
elements for the float formats (typed pointer) and in bytes for the block formats (uint8 pointer,
ggml block layouts, see moerun.quant.formats). `table_ptr` is the format's lookup table
(`KernelWeight.table`: the i-quants' grids, signs and non-linear values; unread by the other
formats). Entries with n >= N or k >= K read as 0. For block formats K is a whole number of blocks;
any BK and BN work (fields are gathered element by element, so a tile may cover part of a
super-block or several blocks), and the values are bit-exact those of
moerun.quant.dequant.dequantize. The 256-element i-quants and ternary formats are read by
moerun.kernels.iquants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moerun.kernels import iquants
from moerun.kernels.block_fields import byte, fp16, int8
from moerun.quant.dequant import dequantize_bytes
from moerun.quant.formats import QTensor, get_format

# FMT codes: a format's code is its index here; the names are moerun.quant.formats names.
FORMAT_NAMES = (
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "mxfp4_gpt_oss", "q5_k", "q2_k", "q3_k",
    "q4_1", "q5_0", "q5_1", "iq4_nl", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
    "iq4_xs", "tq1_0", "tq2_0",
)  # fmt: skip
FORMAT_CODES = {name: code for code, name in enumerate(FORMAT_NAMES)}
DENSE_CODES = {
    "float32": FORMAT_CODES["f32"],
    "float16": FORMAT_CODES["f16"],
    "bfloat16": FORMAT_CODES["bf16"],
}
# The codes as kernels compare them: compiled Triton reads no module globals but tl.constexpr ones.
(
    F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, MXFP4_GPT_OSS, Q5_K, Q2_K, Q3_K,
    Q4_1, Q5_0, Q5_1, IQ4_NL, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, IQ4_XS, TQ1_0, TQ2_0,
) = (tl.constexpr(code) for code in range(len(FORMAT_NAMES)))  # fmt: skip


@triton.jit
def _e8m0_half_scale(e):
    """E8M0 exponents (int32) -> 2^(e - 128) in fp32, as moerun.quant.dequant.e8m0_half_scale:
    e = 0 and 1 give the subnormals 2^-128 and 2^-127, e = 255 gives 2^127."""
    bits = tl.where(e == 0, 0x00200000, tl.where(e == 1, 0x00400000, (e - 1) << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_value(code):
    """E2M1 codes (int32, 0-15) -> twice their value, as fp32 (moerun.quant.dequant.MXFP4_VALUES):
    magnitudes 0, 1, 2, 3, 4, 6, 8, 12, and code 8 (-0) as +0."""
    mag = code & 7
    big = (2 + (mag & 1)) << (((mag >> 1) & 1) + 1)  # 4, 6, 8, 12 for mag 4-7
    value = tl.where(mag < 4, mag, big)
    return tl.where(code >= 8, -value, value).to(tl.float32)


@triton.jit
def _k4_scale_min(sb_ptr, s, mask):
    """Q4_K/Q5_K's 6-bit (scale, min) of sub-block s (0-7) from the 12 bytes at `sb_ptr`, as fp32."""
    j = s & 3
    a = byte(sb_ptr + j, mask)
    b = byte(sb_ptr + 4 + j, mask)
    c = byte(sb_ptr + 8 + j, mask)
    scale = tl.where(s < 4, a & 0x3F, (c & 0x0F) | ((a >> 6) << 4))
    mn = tl.where(s < 4, b & 0x3F, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


@triton.jit
def load_weight_tile(w_ptr, row_stride, n_offs, k_offs, N, K, table_ptr, FMT: tl.constexpr):
    n = n_offs[None, :]  # [1, BN]
    k = k_offs[:, None]  # [BK, 1]
    mask = (n < N) & (k < K)
    # `==` chains, not `in`: triton's compiler has no `in` (ruff's SIM109 would ask for it).
    if FMT == F32 or FMT == F16 or FMT == BF16:  # noqa: SIM109
        tile = tl.load(w_ptr + n * row_stride + k, mask=mask, other=0.0).to(tl.float32)
    else:
        # Block formats: element (n, k) is element i of block k // block_size of row n, whose bytes
        # start at `blk`; each field is gathered per element (neighbours hit the same cache lines).
        # The float operations follow moerun.quant.dequant's order, so the values are bit-exact.
        row = w_ptr + n * row_stride  # [1, BN]
        if FMT == Q8_0:
            i = k % 32
            blk = row + (k // 32) * 34
            tile = fp16(blk, mask) * int8(blk + 2 + i, mask)
        elif FMT == Q4_0:
            i = k % 32
            blk = row + (k // 32) * 18
            q = (byte(blk + 2 + i % 16, mask) >> ((i // 16) * 4)) & 0x0F
            tile = fp16(blk, mask) * (q - 8).to(tl.float32)
        elif FMT == Q4_1:
            i = k % 32
            blk = row + (k // 32) * 20
            q = (byte(blk + 4 + i % 16, mask) >> ((i // 16) * 4)) & 0x0F
            tile = fp16(blk, mask) * q.to(tl.float32) + fp16(blk + 2, mask)
        elif FMT == Q5_0 or FMT == Q5_1:  # noqa: SIM109
            i = k % 32
            if FMT == Q5_0:
                blk = row + (k // 32) * 22
                qh = blk + 2
            else:
                blk = row + (k // 32) * 24
                qh = blk + 4
            # nibbles as Q4_0's after the 4 qh bytes; the fifth bit: bit i of qh read as a uint32
            q = (byte(qh + 4 + i % 16, mask) >> ((i // 16) * 4)) & 0x0F
            q = q | (((byte(qh + i // 8, mask) >> (i % 8)) & 1) << 4)
            if FMT == Q5_0:
                tile = fp16(blk, mask) * (q - 16).to(tl.float32)
            else:
                tile = fp16(blk, mask) * q.to(tl.float32) + fp16(blk + 2, mask)
        elif FMT == IQ4_NL:
            i = k % 32
            blk = row + (k // 32) * 18
            code = (byte(blk + 2 + i % 16, mask) >> ((i // 16) * 4)) & 0x0F
            tile = fp16(blk, mask) * tl.load(table_ptr + code, mask=mask, other=0).to(tl.float32)
        elif FMT == MXFP4 or FMT == MXFP4_GPT_OSS:  # noqa: SIM109
            i = k % 32
            blk = row + (k // 32) * 17
            if FMT == MXFP4:  # byte j: element j low, j + 16 high
                code = (byte(blk + 1 + i % 16, mask) >> ((i // 16) * 4)) & 0x0F
            else:  # byte j: element 2j low, 2j + 1 high
                code = (byte(blk + 1 + i // 2, mask) >> ((i % 2) * 4)) & 0x0F
            tile = _e8m0_half_scale(byte(blk, mask)) * _mxfp4_value(code)
        elif FMT == Q4_K or FMT == Q5_K:  # noqa: SIM109
            i = k % 256
            s = i // 32  # sub-block
            if FMT == Q4_K:
                blk = row + (k // 256) * 144
                qs = blk + 16
            else:
                blk = row + (k // 256) * 176
                qs = blk + 48
            # 32 bytes per pair of sub-blocks: the even one in the low nibbles, the odd one high.
            q = (byte(qs + (i // 64) * 32 + i % 32, mask) >> ((s & 1) * 4)) & 0x0F
            if FMT == Q5_K:  # the fifth bit: bit s of qh byte i % 32
                q = q | (((byte(blk + 16 + i % 32, mask) >> s) & 1) << 4)
            scale, mn = _k4_scale_min(blk + 4, s, mask)
            tile = (fp16(blk, mask) * scale) * q.to(tl.float32) - fp16(blk + 2, mask) * mn
        elif FMT == Q6_K:
            i = k % 256
            r = i % 128  # within a half of 64 ql bytes and 32 qh bytes
            blk = row + (k // 256) * 210
            low = (byte(blk + (i // 128) * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0x0F
            high = (byte(blk + 128 + (i // 128) * 32 + r % 32, mask) >> ((r // 32) * 2)) & 0x03
            scale = int8(blk + 192 + i // 16, mask)
            tile = (fp16(blk + 208, mask) * scale) * ((low | (high << 4)) - 32).to(tl.float32)
        elif FMT == Q2_K or FMT == Q3_K:  # noqa: SIM109
            i = k % 256
            s = i // 16  # sub-block
            if FMT == Q2_K:
                blk = row + (k // 256) * 84
                qs = blk + 16
            else:
                blk = row + (k // 256) * 110
                qs = blk + 32
            # 32 bytes per half of 128 elements, whose 2-bit fields at shifts 0, 2, 4, 6 are its 4 runs.
            q = (byte(qs + (i // 128) * 32 + i % 32, mask) >> (((i // 32) % 4) * 2)) & 0x03
            if FMT == Q2_K:
                packed = byte(blk + s, mask)  # low nibble: scale, high: min
                d, dmin = fp16(blk + 80, mask), fp16(blk + 82, mask)
                step = d * (packed & 0x0F).to(tl.float32)
                tile = step * q.to(tl.float32) - dmin * (packed >> 4).to(tl.float32)
            else:
                # 6-bit scales offset by 32: low 4 bits from bytes 0-7, high 2 bits from bytes 8-11.
                low = (byte(blk + 96 + s % 8, mask) >> ((s // 8) * 4)) & 0x0F
                high = (byte(blk + 104 + s % 4, mask) >> ((s // 4) * 2)) & 0x03
                scale = ((low | (high << 4)) - 32).to(tl.float32)
                # Minus 4 where the element's bit (bit i // 32 of hmask byte i % 32) is clear.
                hbit = (byte(blk + i % 32, mask) >> (i // 32)) & 1
                q = q - ((hbit ^ 1) << 2)
                tile = (fp16(blk + 108, mask) * scale) * q.to(tl.float32)
        elif FMT == IQ2_XXS:
            tile = iquants.iq2_xxs(row, k, table_ptr, mask)
        elif FMT == IQ2_XS:
            tile = iquants.iq2_xs(row, k, table_ptr, mask)
        elif FMT == IQ2_S:
            tile = iquants.iq2_s(row, k, table_ptr, mask)
        elif FMT == IQ3_XXS:
            tile = iquants.iq3_xxs(row, k, table_ptr, mask)
        elif FMT == IQ3_S:
            tile = iquants.iq3_s(row, k, table_ptr, mask)
        elif FMT == IQ1_S:
            tile = iquants.iq1_s(row, k, table_ptr, mask)
        elif FMT == IQ1_M:
            tile = iquants.iq1_m(row, k, table_ptr, mask)
        elif FMT == IQ4_XS:
            tile = iquants.iq4_xs(row, k, table_ptr, mask)
        elif FMT == TQ1_0:
            tile = iquants.tq1_0(row, k, table_ptr, mask)
        elif FMT == TQ2_0:
            tile = iquants.tq2_0(row, k, table_ptr, mask)
        else:
            tl.static_assert(False, "format not supported in kernels")
        tile = tl.where(mask, tile, 0.0)
    return tile


@dataclass(frozen=True)
class KernelWeight:
    """One projection of every expert as a kernel reads it: expert e's [n, k] weight starts
    `expert_stride` units after expert e-1's, its rows `row_stride` units apart (units: elements
    of `data` for the float formats, bytes for the block formats)."""

    data: torch.Tensor  # [E, n, k] float, or uint8 [E, n, row_bytes]
    fmt: int  # FMT code
    n: int  # output features
    k: int  # input features
    row_stride: int
    expert_stride: int

    @property
    def table(self) -> torch.Tensor:
        """The format's lookup table on the weights' device, made once (moerun.kernels.iquants): the
        `table_ptr` every launch passes to load_weight_tile."""
        return iquants.lookup_table(FORMAT_NAMES[self.fmt], self.data.device)

    def values(self, expert: int | None = None) -> torch.Tensor:
        """fp32 values of every expert [E, n, k] (or of one, [n, k]), by moerun.quant's dequantiser:
        what the torch references compute with."""
        data = self.data if expert is None else self.data[expert]
        if data.dtype != torch.uint8:
            return data.float()
        return dequantize_bytes(get_format(FORMAT_NAMES[self.fmt]), data, torch.float32)


def kernel_weight(weight: torch.Tensor | QTensor) -> KernelWeight:
    """A dense [E, n, k] tensor or a QTensor of logical shape [E, n, k] as kernels read it."""
    if isinstance(weight, QTensor):
        if weight.format.name not in FORMAT_CODES:
            raise ValueError(f"the triton kernels cannot read {weight.format.name} weights yet")
        data = weight.data.contiguous()
        num_experts, n, k = weight.shape
        return KernelWeight(data, FORMAT_CODES[weight.format.name], n, k, data.shape[-1], data[0].numel())
    data = weight.contiguous()
    if str(data.dtype).removeprefix("torch.") not in DENSE_CODES:
        raise ValueError(f"the triton kernels cannot read {data.dtype} weights")
    num_experts, n, k = data.shape
    return KernelWeight(data, DENSE_CODES[str(data.dtype).removeprefix("torch.")], n, k, k, n * k)
