"""Fused dequantise-and-multiply matrix-vector products for CPU decode.

`fused_matvec` runs the numba kernels of moerun.quant.numba_matvec when numba is installed (an
optional dependency) and the tensors are on the CPU; otherwise the torch.compile'd functions below.

Eager torch dequantises through a dozen full-size temporaries and reads q8_0 at ~2 GB/s on 2 cores;
the same arithmetic compiled into one loop reads ~8 GB/s (docs/PERFORMANCE.md). Each format here is
written so inductor can fuse it: blocks viewed as [out, blocks, bytes], scales and quants decoded
elementwise, the products reduced per block, then across blocks. The first call for a (format,
shape) compiles (seconds), says so on stderr, and is cached for the process (and by inductor on disk).
Formats not listed fall back to the tiled eager path in moerun.moe.experts. Measured alone on a 2048x2048
matrix (GB/s of quantised bytes, 2 cores): q8_0 5.8, q4_0 2.7, q6_k 2.6, q4_k 2.0-2.5, mxfp4 1.8,
q5_k 1.7 (hand-fused); q2_k 0.33, q3_k 0.09 (through moerun.quant.dequant's unpack functions,
which inductor does not fuse well; the numba kernels fuse these too).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from moerun.quant.dequant import (
    e8m0_half_scale,
    unpack_q2_k,
    unpack_q3_k,
)
from moerun.quant.formats import QFormat


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start + 2) of each block [out, nb, bytes] -> fp32 [out, nb]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()[..., 0]


def _q8_0(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """data uint8 [out, in/32*34], x fp32 [in] -> fp32 [out]."""
    out, nb = data.shape[0], x.shape[0] // 32
    blocks = data.view(out, nb, 34)
    d = _fp16_field(blocks, 0)  # [out, nb]
    q = blocks[..., 2:].view(torch.int8).float()  # [out, nb, 32]
    return (d * (q * x.view(nb, 32)).sum(-1)).sum(-1)


def _q4_0(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """data uint8 [out, in/32*18], x fp32 [in] -> fp32 [out]; nibble j is element j, j+16 its high half."""
    out, nb = data.shape[0], x.shape[0] // 32
    blocks = data.view(out, nb, 18)
    d = _fp16_field(blocks, 0)  # [out, nb]
    packed = blocks[..., 2:]  # [out, nb, 16]
    xs = x.view(nb, 2, 16)
    low = ((packed & 15).float() - 8) * xs[:, 0]
    high = ((packed >> 4).float() - 8) * xs[:, 1]
    return (d * (low + high).sum(-1)).sum(-1)


def _e2m1_doubled(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes 0..15 -> twice their value (0, 1, 2, 3, 4, 6, 8, 12, then negated), by arithmetic
    rather than a table gather, which inductor compiles into a slow indexed load."""
    c = code.to(torch.int32)
    m = c & 7
    magnitude = torch.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1)).float()
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def _mxfp4(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """data uint8 [out, in/32*17] (GGUF block: E8M0 byte, then nibbles j | j+16), x fp32 [in] -> [out]."""
    out, nb = data.shape[0], x.shape[0] // 32
    blocks = data.view(out, nb, 17)
    scale = e8m0_half_scale(blocks[..., 0])  # [out, nb]: ggml's half scale, the values are doubled
    packed = blocks[..., 1:]  # [out, nb, 16]
    xs = x.view(nb, 2, 16)
    low = _e2m1_doubled(packed & 15) * xs[:, 0]
    high = _e2m1_doubled(packed >> 4) * xs[:, 1]
    return (scale * (low + high).sum(-1)).sum(-1)


def _q4_k(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """data uint8 [out, in/256*144], x fp32 [in] -> [out]. Block: d, dmin (fp16), 12 bytes of 6-bit
    scales/mins for 8 sub-blocks of 32, then 128 bytes whose 32-byte chunk i holds sub-block 2i in
    its low nibbles and 2i+1 in its high nibbles (ggml's block_q4_K, get_scale_min_k4)."""
    return _scaled_nibbles_with_mins(data, x, block_bytes=144, high_bits=False)


def _q5_k(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As q4_k, with 32 `qh` bytes before the nibbles: bit 2i of qh[l] is the fifth bit of element l
    of sub-block 2i, bit 2i+1 that of sub-block 2i+1 (ggml's block_q5_K)."""
    return _scaled_nibbles_with_mins(data, x, block_bytes=176, high_bits=True)


def _scaled_nibbles_with_mins(data: torch.Tensor, x: torch.Tensor, block_bytes: int, high_bits: bool):
    out, nb = data.shape[0], x.shape[0] // 256
    blocks = data.view(out, nb, block_bytes)
    d = _fp16_field(blocks, 0)  # [out, nb]
    dmin = _fp16_field(blocks, 2)
    packed = blocks[..., 4:16].to(torch.int32)
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1).float()  # [out, nb, 8]
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1).float()
    qs = blocks[..., block_bytes - 128 :].view(out, nb, 4, 32)
    low_q, high_q = (qs & 15), (qs >> 4)  # sub-blocks 0, 2, 4, 6 and 1, 3, 5, 7
    if high_bits:
        qh = blocks[..., 16:48].view(out, nb, 1, 32)
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=data.device).view(4, 1)
        low_q = low_q | (((qh >> shifts) & 1) << 4)
        high_q = high_q | (((qh >> (shifts + 1)) & 1) << 4)
    xs = x.view(nb, 4, 2, 32)
    low = (low_q.float() * xs[:, :, 0]).sum(-1)  # [out, nb, 4]
    high = (high_q.float() * xs[:, :, 1]).sum(-1)
    qx = torch.stack([low, high], dim=-1).view(out, nb, 8)
    xsum = x.view(nb, 8, 32).sum(-1)  # [nb, 8]
    return (d * (scales * qx).sum(-1) - dmin * (mins * xsum).sum(-1)).sum(-1)


# The four 32-element quarters of each 128-element half of a q6_k block: which 32 `ql` bytes hold
# their low 4 bits (first or second), whether in the high nibble, and the shift of their 2 `qh` bits.
_Q6_K_QUARTERS = ((0, False, 0), (1, False, 2), (0, True, 4), (1, True, 6))


def _q6_k(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """data uint8 [out, in/256*210], x fp32 [in] -> [out]. Block: ql[128], qh[64], 16 int8 scales
    (one per 16 elements), d (fp16); q = (4 low bits | 2 high bits << 4) - 32 (ggml's block_q6_K)."""
    out, nb = data.shape[0], x.shape[0] // 256
    blocks = data.view(out, nb, 210)
    ql = blocks[..., 0:128].view(out, nb, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = blocks[..., 128:192].view(out, nb, 2, 32)  # [half, l]
    scales = blocks[..., 192:208].view(torch.int8).float().view(out, nb, 2, 4, 2)  # [half, quarter, 16s]
    d = _fp16_field(blocks, 208)  # [out, nb]
    xs = x.view(nb, 2, 4, 2, 16)  # [half, quarter, 16s, 16]
    total = torch.zeros(out, nb, dtype=torch.float32, device=data.device)
    for quarter, (source, high_nibble, shift) in enumerate(_Q6_K_QUARTERS):
        low_bytes = ql[:, :, :, source]
        low_bits = (low_bytes >> 4) if high_nibble else (low_bytes & 15)
        q = (low_bits | (((qh >> shift) & 3) << 4)).float() - 32  # [out, nb, 2, 32]
        dots = (q.view(out, nb, 2, 2, 16) * xs[:, :, quarter]).sum(-1)  # [out, nb, 2, 2]
        total = total + (scales[:, :, :, quarter] * dots).sum(-1).sum(-1)
    return (d * total).sum(-1)


def _q2_k(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Through dequant's unpack (value = d·sc·q − dmin·m, sub-blocks of 16), so
    W·x = Σ d·sc·(q·x) − dmin·m·Σx over the sub-blocks."""
    out, nb = data.shape[0], x.shape[0] // 256
    d, dmin, scales, mins, q = unpack_q2_k(data.view(out, nb, 84))  # q [out, nb, 256]
    xs = x.view(nb, 16, 16)
    qx = (q.view(out, nb, 16, 16).float() * xs).sum(-1)  # [out, nb, 16]
    per_sub = d[..., None] * scales.float() * qx - dmin[..., None] * mins.float() * xs.sum(-1)
    return per_sub.sum(-1).sum(-1)


def _q3_k(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Through dequant's unpack: value = d·sc·q with signed q, sub-blocks of 16."""
    out, nb = data.shape[0], x.shape[0] // 256
    d, scales, q = unpack_q3_k(data.view(out, nb, 110))
    qx = (q.view(out, nb, 16, 16).float() * x.view(nb, 16, 16)).sum(-1)  # [out, nb, 16]
    return (d[..., None] * scales.float() * qx).sum(-1).sum(-1)


_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "mxfp4": _mxfp4,
    "q2_k": _q2_k,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q3_k": _q3_k,
    "q6_k": _q6_k,
}
_compiled: dict[tuple[str, tuple[int, int]], Callable] = {}
# Formats whose compiled kernel decoded an OLMoE-shaped layer as fast as numba's or faster (2 cores,
# same process, alternating): q8_0, q4_0 and mxfp4, whose blocks of 32 inductor's two OpenMP threads
# read as fast; q6_k, 45-52 tok/s compiled vs 16 with numba. numba wins on q4_k (71-86 vs 55-57),
# q5_k (62-67 vs 37-41), q2_k and q3_k (6-9x).
_COMPILED_FIRST = frozenset({"q8_0", "q4_0", "mxfp4", "q6_k"})


@functools.cache
def _numba_kernels() -> ModuleType | None:
    """moerun.quant.numba_matvec, imported on first use (numba takes a moment to import), or None
    where numba is not installed."""
    try:
        from moerun.quant import numba_matvec
    except ImportError:
        return None
    return numba_matvec


def _numba_for(fmt: QFormat, numba: bool) -> ModuleType | None:
    if not numba or fmt.name in _COMPILED_FIRST:
        return None
    kernels = _numba_kernels()
    return kernels if kernels is not None and kernels.has_numba_matvec(fmt.name) else None


def has_fused_matvec(fmt: QFormat, numba: bool = True) -> bool:
    """Whether `fused_matvec` takes CPU tensors of this format."""
    return fmt.name in _KERNELS or _numba_for(fmt, numba) is not None


def fused_matvec(fmt: QFormat, data: torch.Tensor, x: torch.Tensor, numba: bool = True) -> torch.Tensor:
    """One expert's quantised rows data uint8 [out, row_bytes] times x [in] -> fp32 [out].
    `numba=False`: the torch.compile'd kernels even where numba's would run (to test or measure them)."""
    kernels = _numba_for(fmt, numba)
    if kernels is not None and data.device.type == "cpu" and x.device.type == "cpu":
        return kernels.numba_matvec(fmt.name, data, x)
    key = (fmt.name, (data.shape[0], x.shape[0]))
    kernel = _compiled.get(key)
    if kernel is None:
        print(
            f"moerun: compiling the {fmt.name} decode kernel for [{data.shape[0]}, {x.shape[0]}] "
            "(once per shape, a few seconds)",
            file=sys.stderr,
            flush=True,
        )
        kernel = torch.compile(_KERNELS[fmt.name], dynamic=False)
        _compiled[key] = kernel
    return kernel(data, x.float())
