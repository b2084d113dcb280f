"""Whole-tensor dequantisation on CPU, compiled by numba: the gguf package's values bit for bit, as
`dequant`'s torch path gives them, several times faster. (One difference from the torch path: in a
block whose d and dmin are both NaN or inf, a NaN minus a NaN keeps the first one's payload here and
in numpy, the second one's in torch. Real weights have no such blocks.)

Each kernel decodes blocks [b0, b1) of blocks uint8 [N, block_bytes] (ggml's layouts; see the unpack_*
functions in moerun.quant.dequant) into out float32 [N, block_size], with the float operations of the
gguf package's numpy dequantisers in the same order: a scale d * sc first, then times q, then minus
dmin * m. The kernels are compiled without fastmath, so LLVM neither reorders nor fuses them into FMAs.
The fp16 scale fields go through a table of all 65536 fp16 values made by numpy's own cast, which keeps
NaN payloads as gguf does; NaN and inf d fields then propagate through the same float instructions.

The kernels release the GIL; `numba_dequantize` hands chunks of blocks to the calling thread and the
matvec kernels' thread pool (torch.get_num_threads() threads in all), as `numba_matvec` does. The first
call per format compiles (seconds) and says so on stderr; numba caches the machine code on disk, and a
later process that loads it from there says nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

from moerun.quant.formats import QFormat
from moerun.quant.numba_matvec import E8M0_HALF, first_call, run_in_chunks

# No fastmath: every float operation stays as written, in float32, in order.
_jit = numba.njit(nogil=True, cache=True)

# fp16 bits -> the value in float32, exactly, NaN payloads included (numpy's cast, as gguf uses).
_F16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@_jit
def _fp16_at(blocks, b, o, f16):
    """The fp16 field at byte o of block b, as float32."""
    return f16[np.int32(blocks[b, o]) | (np.int32(blocks[b, o + 1]) << 8)]


@_jit
def q8_0_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 0, f16)
        for l in range(32):
            q = np.int32(blocks[b, 2 + l] ^ 0x80) - 128  # the byte as int8
            out[b, l] = d * np.float32(q)


@_jit
def q4_0_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 0, f16)
        for j in range(16):
            x = np.int32(blocks[b, 2 + j])
            out[b, j] = d * np.float32((x & 15) - 8)
            out[b, j + 16] = d * np.float32((x >> 4) - 8)


@_jit
def _e2m1_doubled(code):
    """dequant.MXFP4_VALUES[code], computed (a table lookup does not vectorise): for magnitude bits m < 4, m;
    above, 2 or 3 (by bit 0) times 2 or 4 (by bit 1); bit 3 is the sign (code 8 is +0)."""
    m = code & 7
    v = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return np.float32(-v if code & 8 else v)


@_jit
def mxfp4_blocks(blocks, e8m0_half, out, b0, b1):
    """GGUF MXFP4: byte j holds element j (low nibble) and j + 16 (high)."""
    for b in range(b0, b1):
        s = e8m0_half[blocks[b, 0]]
        for j in range(16):
            x = blocks[b, 1 + j]
            out[b, j] = s * _e2m1_doubled(np.int32(x) & 15)
            out[b, j + 16] = s * _e2m1_doubled(np.int32(x) >> 4)


@_jit
def mxfp4_gpt_oss_blocks(blocks, e8m0_half, out, b0, b1):
    """`mxfp4_gpt_oss`: byte j holds element 2j (low nibble) and 2j + 1 (high)."""
    for b in range(b0, b1):
        s = e8m0_half[blocks[b, 0]]
        for j in range(16):
            x = blocks[b, 1 + j]
            out[b, 2 * j] = s * _e2m1_doubled(np.int32(x) & 15)
            out[b, 2 * j + 1] = s * _e2m1_doubled(np.int32(x) >> 4)


@_jit
def q2_k_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 80, f16)
        dmin = _fp16_at(blocks, b, 82, f16)
        for h in range(2):
            for part in range(2):
                # 16 bytes, whose 2-bit fields at shifts 0, 2, 4, 6 are sub-blocks s, s + 2, s + 4, s + 6
                s = 8 * h + part
                sc0, sc1 = np.int32(blocks[b, s]), np.int32(blocks[b, s + 2])
                sc2, sc3 = np.int32(blocks[b, s + 4]), np.int32(blocks[b, s + 6])
                step0, off0 = d * np.float32(sc0 & 15), dmin * np.float32(sc0 >> 4)
                step1, off1 = d * np.float32(sc1 & 15), dmin * np.float32(sc1 >> 4)
                step2, off2 = d * np.float32(sc2 & 15), dmin * np.float32(sc2 >> 4)
                step3, off3 = d * np.float32(sc3 & 15), dmin * np.float32(sc3 >> 4)
                for l in range(16):
                    x = np.int32(blocks[b, 16 + 32 * h + 16 * part + l])
                    i = 128 * h + 16 * part + l
                    out[b, i] = step0 * np.float32(x & 3) - off0
                    out[b, i + 32] = step1 * np.float32((x >> 2) & 3) - off1
                    out[b, i + 64] = step2 * np.float32((x >> 4) & 3) - off2
                    out[b, i + 96] = step3 * np.float32(x >> 6) - off3


@_jit
def _q3_k_step(blocks, b, d, s):
    """d times Q3_K's 6-bit scale of sub-block s (dequant.unpack_q3_k)."""
    low = (np.int32(blocks[b, 96 + s % 8]) >> (4 * (s // 8))) & 15
    high = (np.int32(blocks[b, 104 + s % 4]) >> (2 * (s // 4))) & 3
    return d * np.float32((low | (high << 4)) - 32)


@_jit
def q3_k_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 108, f16)
        for h in range(2):
            for part in range(2):
                # 16 bytes of qs, whose 2-bit fields at shifts 0, 2, 4, 6 are runs 4h to 4h + 3 (sub-blocks
                # s, s + 2, s + 4, s + 6); the same 16 bytes of hmask hold their high bits, at bits 4h-4h+3
                s = 8 * h + part
                step0, step1 = _q3_k_step(blocks, b, d, s), _q3_k_step(blocks, b, d, s + 2)
                step2, step3 = _q3_k_step(blocks, b, d, s + 4), _q3_k_step(blocks, b, d, s + 6)
                for l in range(16):
                    x = np.int32(blocks[b, 32 + 32 * h + 16 * part + l])
                    hm = np.int32(blocks[b, 16 * part + l]) >> (4 * h)
                    i = 128 * h + 16 * part + l
                    # q is the 2 low bits minus 4 where the high bit is 0
                    out[b, i] = step0 * np.float32((x & 3) - 4 + 4 * (hm & 1))
                    out[b, i + 32] = step1 * np.float32(((x >> 2) & 3) - 4 + 2 * (hm & 2))
                    out[b, i + 64] = step2 * np.float32(((x >> 4) & 3) - 4 + (hm & 4))
                    out[b, i + 96] = step3 * np.float32((x >> 6) - 4 + ((hm >> 1) & 4))


@_jit
def _k4_scale_min(blocks, b, s):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block s (dequant._unpack_k4_scales)."""
    if s < 4:
        return np.int32(blocks[b, 4 + s]) & 63, np.int32(blocks[b, 8 + s]) & 63
    c = np.int32(blocks[b, 8 + s])
    sc = (c & 15) | ((np.int32(blocks[b, s]) >> 6) << 4)
    m = (c >> 4) | ((np.int32(blocks[b, 4 + s]) >> 6) << 4)
    return sc, m


@_jit
def q4_k_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 0, f16)
        dmin = _fp16_at(blocks, b, 2, f16)
        for k in range(4):  # 32 bytes: sub-block 2k in their low nibbles, 2k + 1 in their high ones
            sc, m = _k4_scale_min(blocks, b, 2 * k)
            step_lo, off_lo = d * np.float32(sc), dmin * np.float32(m)
            sc, m = _k4_scale_min(blocks, b, 2 * k + 1)
            step_hi, off_hi = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                x = np.int32(blocks[b, 16 + 32 * k + l])
                out[b, 64 * k + l] = step_lo * np.float32(x & 15) - off_lo
                out[b, 64 * k + 32 + l] = step_hi * np.float32(x >> 4) - off_hi


@_jit
def q5_k_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 0, f16)
        dmin = _fp16_at(blocks, b, 2, f16)
        for k in range(4):  # as Q4_K, each q topped with bit 2k or 2k + 1 of qh byte l as its fifth
            sc, m = _k4_scale_min(blocks, b, 2 * k)
            step_lo, off_lo = d * np.float32(sc), dmin * np.float32(m)
            sc, m = _k4_scale_min(blocks, b, 2 * k + 1)
            step_hi, off_hi = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                x = np.int32(blocks[b, 48 + 32 * k + l])
                qh = np.int32(blocks[b, 16 + l]) >> (2 * k)
                out[b, 64 * k + l] = step_lo * np.float32((x & 15) | ((qh & 1) << 4)) - off_lo
                out[b, 64 * k + 32 + l] = step_hi * np.float32((x >> 4) | ((qh & 2) << 3)) - off_hi


@_jit
def _q6_k_step(blocks, b, d, s):
    """d times Q6_K's int8 scale of sub-block s."""
    return d * np.float32(np.int32(blocks[b, 192 + s] ^ 0x80) - 128)


@_jit
def q6_k_blocks(blocks, f16, out, b0, b1):
    for b in range(b0, b1):
        d = _fp16_at(blocks, b, 208, f16)
        for h in range(2):
            for part in range(2):
                # Per byte l of this half: ql bytes l and 32 + l give elements l, 32 + l (low nibbles)
                # and 64 + l, 96 + l (high); their top 2 bits are qh byte l's fields at shifts 0-6.
                s = 8 * h + part
                step0, step1 = _q6_k_step(blocks, b, d, s), _q6_k_step(blocks, b, d, s + 2)
                step2, step3 = _q6_k_step(blocks, b, d, s + 4), _q6_k_step(blocks, b, d, s + 6)
                for l in range(16):
                    j = 16 * part + l
                    a = np.int32(blocks[b, 64 * h + j])
                    c = np.int32(blocks[b, 64 * h + 32 + j])
                    e = np.int32(blocks[b, 128 + 32 * h + j])
                    i = 128 * h + j
                    out[b, i] = step0 * np.float32(((a & 15) | ((e & 3) << 4)) - 32)
                    out[b, i + 32] = step1 * np.float32(((c & 15) | ((e & 12) << 2)) - 32)
                    out[b, i + 64] = step2 * np.float32(((a >> 4) | (e & 48)) - 32)
                    out[b, i + 96] = step3 * np.float32(((c >> 4) | ((e >> 2) & 48)) - 32)


# format -> (kernel, the scale table it takes: fp16 values, or E8M0 half scales for MXFP4)
_KERNELS: dict[str, tuple[Callable, np.ndarray]] = {
    "q8_0": (q8_0_blocks, _F16),
    "q4_0": (q4_0_blocks, _F16),
    "mxfp4": (mxfp4_blocks, E8M0_HALF),
    "mxfp4_gpt_oss": (mxfp4_gpt_oss_blocks, E8M0_HALF),
    "q2_k": (q2_k_blocks, _F16),
    "q3_k": (q3_k_blocks, _F16),
    "q4_k": (q4_k_blocks, _F16),
    "q5_k": (q5_k_blocks, _F16),
    "q6_k": (q6_k_blocks, _F16),
}
# Blocks are handed out in chunks of about this many bytes (a few hundred KB of float32 output each).
_CHUNK_BYTES = 64 * 1024


def has_numba_dequant(fmt_name: str) -> bool:
    return fmt_name in _KERNELS


def numba_dequantize(fmt: QFormat, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of `fmt`, uint8 [N, block_bytes] on the CPU, -> their values, float32 [N, block_size]."""
    fmt_name = fmt.name
    kernel, table = _KERNELS[fmt_name]
    data = blocks.contiguous().numpy()  # a zero-copy view where the bytes are already contiguous
    n_blocks, block_bytes = data.shape
    out = np.empty((n_blocks, fmt.block_size), np.float32)
    message = f"moerun: compiling the {fmt_name} dequantiser (once; cached on disk)"
    first_call(kernel, (data, table, out, 0, 0), message)
    run_in_chunks(kernel, data, table, out, chunk=max(1, _CHUNK_BYTES // block_bytes))
    return torch.from_numpy(out)
